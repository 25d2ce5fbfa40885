"""Elastic training on Fashion-MNIST: examples/elastic_fashion_mnist.cpp in Python. The demo's CNN,
trained by a job that goes on when workers die, join or leave, and comes back from its durable
commit when all died.

    shoal run --min 1 --max 4 -n 2 /usr/bin/python3 examples/python/elastic_fashion_mnist.py [--epochs 3] [--limit N]
    shoal run --join HOST:PORT --token-file FILE -n 1 /usr/bin/python3 examples/python/elastic_fashion_mnist.py ...
    SHOAL_CHECKPOINT=ckpt SHOAL_CHECKPOINT_EVERY=50 shoal run --min 1 --max 4 -n 2 ...

(with PYTHONPATH=build/python from a build tree). The lines marked "shoal" are what it adds to a
single-machine PyTorch program: the training loop runs inside shoal.elastic.run, counts its epochs
with the elastic state and commits after each step. When a worker is lost, the others go back to
their last commit, re-cut what is left of the epoch over the workers that remain, and go on; the
global batch stays, so the result is the one-process run's. It trains as the C++ example does and
prints the same lines. See docs/elastic.md and docs/python.md."""
import argparse
import math

import torch

import shoal  # shoal
from fashion_mnist import Net, fashion_mnist, test_accuracy


def main():
    parser = argparse.ArgumentParser(description="Elastic data-parallel training of a small CNN on Fashion-MNIST")
    parser.add_argument("--epochs", type=int, default=3, help="epochs to train")
    parser.add_argument("--batch-size", type=int, default=64, help="the global batch")
    parser.add_argument("--lr", type=float, default=0.05, help="the learning rate at the first epoch (cosine decay)")
    parser.add_argument("--limit", type=int, default=0, help="train on the first N images and test on the first "
                                                             "N/6 (0: all)")
    args = parser.parse_args()

    shoal.init()  # shoal
    torch.manual_seed(0)
    net = Net()
    model = shoal.DataParallel(net)  # shoal
    images, labels = fashion_mnist("train")
    test_images, test_labels = fashion_mnist("t10k")
    if args.limit > 0:
        images, labels = images[:args.limit], labels[:args.limit]
        test_images, test_labels = test_images[:max(1, args.limit // 6)], test_labels[:max(1, args.limit // 6)]
    loader = shoal.data.DataLoader(torch.utils.data.TensorDataset(images, labels), batch_size=args.batch_size,
                                   shuffle=True)  # shoal
    optimizer = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)

    # What a failure rolls back to and what a newcomer receives: the parameters, the optimizer's
    # momentum, the loader's place and the epoch.
    state = shoal.elastic.State(model, optimizer, loader)  # shoal

    def train():  # shoal: the loop, as a function that run() calls again after a change
        if shoal.is_main():
            print("training on %d worker(s) from step %d (epoch %d)" % (shoal.world_size(), state.version,
                                                                          state.epoch + 1), flush=True)
        while state.epoch < args.epochs:
            # Cosine decay, a function of the epoch alone, so that a round that starts mid-epoch
            # (or a job that resumes) has the right rate.
            optimizer.param_groups[0]["lr"] = args.lr * 0.5 * (1 + math.cos(math.pi * state.epoch / args.epochs))
            for x, y in loader.epoch(state.epoch):
                optimizer.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(x), y)  # shoal: model, not net
                loss.backward()
                optimizer.step()
                state.commit()  # shoal
                if shoal.is_main() and state.version % 20 == 0:
                    print("epoch %d step %d on %d worker(s): loss %.4f" % (state.epoch + 1, state.version,
                                                                           shoal.world_size(), loss.item()),
                          flush=True)
            state.next_epoch()  # shoal

    shoal.elastic.run(state, train)  # shoal
    accuracy = test_accuracy(net, test_images, test_labels)
    if shoal.is_main():
        checksum = sum(p.detach().abs().sum().item() for p in net.parameters())
        print("after %d steps: test accuracy %.4f, parameter checksum %.6f" % (state.version, accuracy, checksum))


if __name__ == "__main__":
    main()
