"""The plain PyTorch program that tests/python/test_data_parallel.py distributes: its model, its
batches and each worker's share of a batch."""
import torch

STEPS = 4
BATCH = 64


def model(width=8):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, width), torch.nn.Tanh(), torch.nn.Linear(width, 3))


class WithUnused(torch.nn.Module):
    """model() beside a layer that forward never uses: its gradient stays None."""

    def __init__(self):
        super().__init__()
        self.used = model()
        self.unused = torch.nn.Linear(5, 3)

    def forward(self, x):
        return self.used(x)


def make(case):
    return WithUnused() if case == "unused" else model()


def batch(step):
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, 5, generator=generator), torch.randn(BATCH, 3, generator=generator)


def share(tensor, rank, world_size):
    """The worker's rows of a global batch: the first ones a row more when it does not divide, as
    shoal cuts a batch (64 over 3 workers: 22, 21, 21)."""
    return torch.tensor_split(tensor, world_size)[rank]


def halves(tensor):
    """A worker's share cut in two, the first half a row more when it does not divide."""
    return torch.tensor_split(tensor, 2)


def train_alone(accumulated_over=None, case="train"):
    """The program on one process, without shoal: the oracle. With `accumulated_over` (a worker
    count), each step's gradient is accumulated over two backwards, as the workers' no_sync()
    halves make it: each backward's batch is every worker's first (then second) half of its share."""
    net = make(case)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(STEPS):
        x, y = batch(step)
        optimizer.zero_grad(set_to_none=False)
        if accumulated_over is None:
            torch.nn.functional.mse_loss(net(x), y).backward()
        else:
            n = accumulated_over
            for h in range(2):
                xs = torch.cat([halves(share(x, r, n))[h] for r in range(n)])
                ys = torch.cat([halves(share(y, r, n))[h] for r in range(n)])
                torch.nn.functional.mse_loss(net(xs), ys).backward()
        optimizer.step()
    return {"params": [p.detach() for p in net.parameters()], "grad_is_none": [p.grad is None for p in net.parameters()]}
