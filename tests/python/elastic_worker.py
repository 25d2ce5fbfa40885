"""A worker of tests/python/test_elastic.py: tests/programs/elastic_worker.cpp's program in
Python. An MLP on a synthetic classification set under shoal.DataParallel, SGD with momentum, a
shoal.data.DataLoader with torch's loader processes reading ahead, a commit after every step, and
a count of how often each sample was trained on in committed steps, kept in the elastic state so
that it rolls back with it.

    elastic_worker.py OUT [EPOCHS] [STEP_MS]

The global batch of 10 is cut 4, 3, 3 on three workers. Every worker prints "train pid=P rank=R
world=W step=S" when the training function (re)starts; the first worker prints "step S world W"
after each commit and, at the end, writes OUT (torch.save): the parameters and the counts."""
import os
import sys
import time

import torch

import shoal

SAMPLES, FEATURES, CLASSES = 240, 8, 4


def dataset():
    # Each sample's features with its index in the last column, so that a worker knows what it got.
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    y = x.matmul(torch.randn(FEATURES, CLASSES, generator=generator)).argmax(1)
    return torch.utils.data.TensorDataset(torch.cat([x, torch.arange(SAMPLES, dtype=torch.float32)[:, None]], 1), y)


def main(out, epochs=4, step_ms=0):
    shoal.init()
    torch.manual_seed(1)
    net = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, CLASSES))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    model = shoal.DataParallel(net)
    loader = shoal.data.DataLoader(dataset(), batch_size=10, shuffle=True, seed=7, num_workers=1)
    state = shoal.elastic.State(model, optimizer, loader)
    state.values["counts"] = torch.zeros(epochs, SAMPLES, dtype=torch.long)

    def train():
        print("train pid=%d rank=%d world=%d step=%d" % (os.getpid(), shoal.rank(), shoal.world_size(), state.version),
              flush=True)
        while state.epoch < epochs:
            for batch, target in loader.epoch(state.epoch):
                features, indices = batch[:, :FEATURES], batch[:, FEATURES].long()
                optimizer.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(features), target)
                # What every worker trained on in this step, summed over the workers.
                seen = torch.zeros(SAMPLES, dtype=torch.long).index_add_(0, indices, torch.ones_like(indices))
                shoal.comm.world().all_reduce(seen)
                loss.backward()
                optimizer.step()
                state.values["counts"][state.epoch] += seen
                if step_ms:
                    time.sleep(step_ms / 1000)
                state.commit()
                if shoal.is_main():
                    print("step %d world %d" % (state.version, shoal.world_size()), flush=True)
            state.next_epoch()

    shoal.elastic.run(state, train)
    if shoal.is_main():
        torch.save({"parameters": [p.detach() for p in net.parameters()], "counts": state.values["counts"]},
                   out + ".tmp")
        os.rename(out + ".tmp", out)


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:]))
