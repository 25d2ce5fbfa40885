"""A worker of tests/python/test_pipeline.py: a Sequential of Python modules in a pipeline under one
schedule, beside the same model trained as plain PyTorch on the whole batch.

    pipeline_worker.py OUT SCHEDULE

Every worker builds the same model (seed 0), makes a Pipeline of 8 micro-batches under SCHEDULE
(gpipe, 1f1b, interleaved, zb, or custom: GPipe's schedule built as data and passed as a custom one) and takes two steps of SGD on a batch of 16 rows; it also trains a
copy of the model as one process would. Each worker writes OUT.RANK (torch.save): the two losses
from both, and for each of the layers it holds the largest relative difference of its parameters
from the plain model's after the steps."""
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


def main(out, schedule):
    shoal.init()
    torch.manual_seed(7)
    batches = [(torch.randn(16, 6), torch.randn(16, 3)) for _ in range(2)]
    net, plain = make(), make()
    if schedule == "custom":
        pipe = shoal.pipeline.Pipeline(net, micro_batches=8,
                                       custom_schedule=shoal.pipeline.gpipe(shoal.world_size(), 8))
    else:
        pipe = shoal.pipeline.Pipeline(net, micro_batches=8, schedule=schedule)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    losses, plain_losses = [], []
    for x, y in batches:
        optimizer.zero_grad()
        losses.append(float(pipe.step(x, y, torch.nn.functional.mse_loss)))
        optimizer.step()
        plain_optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(plain(x), y)
        loss.backward()
        plain_optimizer.step()
        plain_losses.append(float(loss))
    differences = {}
    for i in pipe.layers():
        for (name, p), q in zip(net[i].named_parameters(), plain[i].parameters()):
            differences["%d.%s" % (i, name)] = float((p - q).abs().max() / q.abs().max())
    torch.save({"losses": losses, "plain_losses": plain_losses, "differences": differences,
                "stages": pipe.local_stages(), "split": pipe.split(), "schedule": pipe.schedule().name},
               "%s.%d" % (out, shoal.rank()))


if __name__ == "__main__":
    main(*sys.argv[1:])
