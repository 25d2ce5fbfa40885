"""A worker of tests/python/test_checkpoint.py: tests/programs/checkpoint_interop.cpp written in
Python, so that a checkpoint one of them writes is continued by the other.

    checkpoint_worker.py layernorm|batchnorm STEPS OUT [IN]

Builds Sequential(Linear(4, 8), LayerNorm or BatchNorm1d, ReLU, Linear(8, 1)) with Adam (a batch
norm's statistics are each worker's, so only one process equals one process), resumes from IN
(model, optimizer, loader, the step count as the extra "step") when given, trains with
DataParallel on the global batches of 12 of a loader over the 48 rows (torch's loader processes
reading ahead) until STEPS steps are done in all, and saves the same four to OUT."""
import sys

import torch

import shoal

ROWS = 48


def dataset():
    # The rows, computed by the same LibTorch kernels as the C++ program's.
    x = (torch.arange(ROWS * 4, dtype=torch.float32).reshape(ROWS, 4) * 0.01).sin()
    return torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).cos())


def make_net(norm):
    middle = torch.nn.BatchNorm1d(8) if norm == "batchnorm" else torch.nn.LayerNorm(8)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), middle, torch.nn.ReLU(), torch.nn.Linear(8, 1))


def main(norm, steps, out, resume=None):
    shoal.init()
    torch.manual_seed(0)
    net = make_net(norm)
    optimizer = torch.optim.Adam(net.parameters(), lr=0.01)
    loader = shoal.data.DataLoader(dataset(), batch_size=12, shuffle=True, seed=7, num_workers=2)
    step = 0
    if resume:
        step = int(shoal.load(resume, net, optimizer, loader)["step"])
    model = shoal.DataParallel(net)
    epoch = loader.sampler.epoch
    while step < steps:
        for x, y in loader.epoch(epoch):
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            step += 1
            if step == steps:
                break
        epoch += 1
    # The DataParallel saves its module, by the module's names (what the C++ program loads).
    shoal.save(out, model, optimizer, loader, extras={"step": torch.tensor(step)})


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), *sys.argv[3:])
