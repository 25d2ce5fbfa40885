"""A worker of tests/python/test_pipeline.py: a Sequential of Python modules in a pipeline under one
schedule, beside the same model trained as plain PyTorch on the whole batch.

    pipeline_worker.py OUT SCHEDULE

Every worker builds the same model (seed 0), makes a Pipeline of 8 micro-batches under SCHEDULE
(gpipe, 1f1b, interleaved, zb, or custom: GPipe's schedule built as data and passed as a custom one) and takes two steps of Adam on batches of 16 rows; it also trains a
copy of the model as one process would. Each worker writes OUT.RANK (torch.save): the two losses
from both, for each of the layers it holds the largest relative difference of its parameters from
the plain model's after the steps, and the plain model's parameters after a third step. The
pipeline is saved with its optimizer to OUT.ckpt (shoal.save of the pipeline)."""
import sys

import torch

import shoal


class Residual(torch.nn.Module):
    """A layer of the program's own, with a Python forward."""

    def __init__(self, width):
        super().__init__()
        self.fc = torch.nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


def make():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), Residual(16), torch.nn.ReLU(), Residual(16),
                               torch.nn.LayerNorm(16), Residual(16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 3))


def batches():
    torch.manual_seed(7)
    return [(torch.randn(16, 6), torch.randn(16, 3)) for _ in range(3)]


def step(model, optimizer, batch):
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(batch[0]), batch[1])
    loss.backward()
    optimizer.step()
    return float(loss)


def main(out, schedule):
    shoal.init()
    data = batches()
    net, plain = make(), make()
    if schedule == "custom":
        pipe = shoal.pipeline.Pipeline(net, micro_batches=8,
                                       custom_schedule=shoal.pipeline.gpipe(shoal.world_size(), 8))
    else:
        pipe = shoal.pipeline.Pipeline(net, micro_batches=8, schedule=schedule)
    optimizer = torch.optim.Adam(pipe.parameters(), lr=0.01)
    plain_optimizer = torch.optim.Adam(plain.parameters(), lr=0.01)
    losses, plain_losses = [], []
    for x, y in data[:2]:
        optimizer.zero_grad()
        losses.append(float(pipe.step(x, y, torch.nn.functional.mse_loss)))
        optimizer.step()
        plain_losses.append(step(plain, plain_optimizer, (x, y)))
    differences = {}
    for i in pipe.layers():
        for (name, p), q in zip(net[i].named_parameters(), plain[i].parameters()):
            differences["%d.%s" % (i, name)] = float((p - q).abs().max() / q.abs().max())
    shoal.save(out + ".ckpt", pipe, optimizer)
    step(plain, plain_optimizer, data[2])
    torch.save({"losses": losses, "plain_losses": plain_losses, "differences": differences,
                "plain_after_three": {k: v.clone() for k, v in plain.state_dict().items()},
                "stages": pipe.local_stages(), "split": pipe.split(), "schedule": pipe.schedule().name},
               "%s.%d" % (out, shoal.rank()))


if __name__ == "__main__":
    main(*sys.argv[1:])
