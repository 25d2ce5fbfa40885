"""bench/elastic.cpp written in Python, for bench/elastic.py's contender shoal-python: bench/ddp's
MLP (784-2048-2048-10), random data, SGD with momentum, batch 64 per worker, one intra-op thread,
under shoal.elastic.run, a commit after every step.

    shoal run --min 1 --max 3 -n 3 /usr/bin/python3 bench/elastic_python.py [--steps 200]

The main worker prints "step S world W t=MS" after each step (MS: milliseconds since the epoch, to
line up with the driver's clock), as bench/elastic.cpp does."""
import argparse
import sys
import time

import torch

import shoal


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=64, help="per worker")
    args = parser.parse_args()
    torch.set_num_threads(1)
    shoal.init(intra_op_threads=1)
    torch.manual_seed(1)
    net = torch.nn.Sequential(torch.nn.Linear(784, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048),
                              torch.nn.ReLU(), torch.nn.Linear(2048, 10))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    model = shoal.DataParallel(net)
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(4096, 784), torch.randint(10, (4096,)))
    loader = shoal.data.DataLoader(data, batch_size=args.batch, per_worker=True, shuffle=True)
    state = shoal.elastic.State(model, optimizer, loader, policy=shoal.elastic.BatchPolicy.scale_learning_rate(1, 0))

    def train():
        while state.version < args.steps:
            for x, y in loader.epoch(state.epoch):
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
                state.commit()
                if shoal.is_main():
                    print("step %d world %d t=%d" % (state.version, shoal.world_size(), time.time() * 1000), flush=True)
                if state.version >= args.steps:
                    return
            state.next_epoch()

    shoal.elastic.run(state, train)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
