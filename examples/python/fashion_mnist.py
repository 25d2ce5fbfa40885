"""Data-parallel training on Fashion-MNIST: a single-machine PyTorch program plus shoal's lines,
examples/fashion_mnist.cpp in Python.

    shoal run -n 2 /usr/bin/python3 examples/python/fashion_mnist.py [--epochs 10] [--batch-size 128]
        [--lr 0.05] [--checkpoint PATH] [--resume] [--limit N]

(with PYTHONPATH=build/python from a build tree). The lines marked "shoal" are all it takes: init()
joins the job, DataParallel averages the gradients during backward, and the loader gives each
worker its share of every global batch. The same program runs alone as a job of one. It trains the
C++ demo's model with the same initial weights, batches and learning rates, so it prints the same
losses and accuracies (to float rounding), and its checkpoint is the C++ demo's: either resumes
the other's."""
import argparse
import gzip
import math
import os
import sys
import time

import torch

import shoal  # shoal

ROOT = "/usr/share/datasets/fashion-mnist"  # Debian's dataset-fashion-mnist


def read_idx(path):
    """An IDX file (gzip-compressed) as a uint8 tensor of its shape."""
    try:
        with gzip.open(path) as f:
            data = f.read()
    except OSError as e:
        sys.exit("fashion_mnist.py: cannot read %s (%s); expected Debian's dataset-fashion-mnist" % (path, e))
    dims = data[3]
    shape = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(dims)]
    return torch.frombuffer(bytearray(data[4 + 4 * dims:]), dtype=torch.uint8).reshape(shape)


def fashion_mnist(split):
    images = read_idx(os.path.join(ROOT, "%s-images-idx3-ubyte.gz" % split)).float().div(255).unsqueeze(1)
    labels = read_idx(os.path.join(ROOT, "%s-labels-idx1-ubyte.gz" % split)).long()
    return images, labels


class Net(torch.nn.Module):
    """examples/fashion_mnist_net.h: a small CNN for 28x28 grey images, 10 classes."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 8, 5, padding=2)
        self.conv2 = torch.nn.Conv2d(8, 16, 5, padding=2)
        self.fc1 = torch.nn.Linear(16 * 7 * 7, 64)
        self.fc2 = torch.nn.Linear(64, 10)

    def forward(self, x):
        x = torch.max_pool2d(torch.relu(self.conv1(x)), 2)
        x = torch.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


class Progress:
    """One line per quarter of the epoch, printed by the main worker, with the job-wide mean loss."""

    def __init__(self, epoch, epochs, batches):
        self.epoch, self.epochs, self.batches = epoch, epochs, batches
        self.done, self.samples, self.loss_sum = 0, 0, torch.zeros(())
        self.start = time.monotonic()

    def step(self, samples, loss):
        self.done += 1
        self.samples += samples
        self.loss_sum += loss.detach() * samples
        if self.done * 4 // self.batches == (self.done - 1) * 4 // self.batches:
            return  # print as each quarter fills
        totals = torch.stack([self.loss_sum.double(), torch.tensor(float(self.samples), dtype=torch.float64)])
        shoal.comm.world().all_reduce(totals)  # shoal: every worker takes part, one prints
        seconds = time.monotonic() - self.start
        fraction = self.done / self.batches
        if not shoal.is_main():
            return
        filled = int(fraction * 24 + 0.5)
        print("epoch %d/%d [%s%s] %3.0f%%  %6.0f samples/s  loss %.4f  ETA %3.0fs"
              % (self.epoch + 1, self.epochs, "#" * filled, "." * (24 - filled), 100 * fraction,
                 totals[1].item() / seconds, totals[0].item() / totals[1].item(), seconds / fraction - seconds),
              flush=True)


def test_accuracy(net, images, labels):
    """Each worker scores its share of the test set; one all-reduce adds up the hits."""
    net.eval()
    shares = [len(s) for s in torch.arange(len(images)).tensor_split(shoal.world_size())]
    begin = sum(shares[:shoal.rank()])
    hits = torch.zeros(1, dtype=torch.float64)
    with torch.no_grad():
        for i in range(begin, begin + shares[shoal.rank()], 1000):
            end = min(i + 1000, begin + shares[shoal.rank()])
            hits += net(images[i:end]).argmax(1).eq(labels[i:end]).sum()
    shoal.comm.world().all_reduce(hits)  # shoal
    net.train()
    return hits.item() / len(images)


def main():
    parser = argparse.ArgumentParser(description="Data-parallel training on Fashion-MNIST; run alone or under "
                                                 "`shoal run -n N`.")
    parser.add_argument("--epochs", type=int, default=10, help="epochs to train")
    parser.add_argument("--batch-size", type=int, default=128, help="the global batch, whatever the workers")
    parser.add_argument("--lr", type=float, default=0.05, help="the first epoch's learning rate (cosine decay)")
    parser.add_argument("--limit", type=int, default=0, help="train on the first N images only (0: all)")
    parser.add_argument("--checkpoint", default="fashion_mnist.ckpt", help="written after every epoch")
    parser.add_argument("--resume", action="store_true", help="continue from --checkpoint, on any number of workers")
    args = parser.parse_args()

    shoal.init()  # shoal
    torch.manual_seed(0)
    net = Net()
    model = shoal.DataParallel(net)  # shoal
    images, labels = fashion_mnist("train")
    test_images, test_labels = fashion_mnist("t10k")
    if args.limit > 0:
        images, labels = images[:args.limit], labels[:args.limit]
    loader = shoal.data.DataLoader(torch.utils.data.TensorDataset(images, labels), batch_size=args.batch_size,
                                   shuffle=True)  # shoal: the global batch
    optimizer = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    if shoal.is_main():
        print("Fashion-MNIST: %d training images on %d worker(s), global batch %d"
              % (len(images), shoal.world_size(), args.batch_size), flush=True)
    # --resume: parameters, momentum and the loader's place come back from the last epoch's
    # checkpoint (this program's or the C++ demo's), on however many workers this run has.
    first_epoch = 0
    if args.resume:
        shoal.load(args.checkpoint, net, optimizer, loader)  # shoal
        first_epoch = loader.sampler.epoch + (1 if loader.sampler.batches_remaining() == 0 else 0)
        if shoal.is_main():
            print("resumed from %s at epoch %d" % (args.checkpoint, first_epoch + 1), flush=True)
    for epoch in range(first_epoch, args.epochs):
        # Cosine decay, one learning rate per epoch: a function of the epoch alone, so a resumed
        # run picks it up where it left off.
        optimizer.param_groups[0]["lr"] = args.lr * 0.5 * (1 + math.cos(math.pi * epoch / args.epochs))
        batches = loader.epoch(epoch)
        progress = Progress(epoch, args.epochs, loader.sampler.batches_remaining())
        for x, y in batches:
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)  # shoal: model, not net
            loss.backward()
            optimizer.step()
            progress.step(len(x), loss)
        shoal.save(args.checkpoint, net, optimizer, loader)  # shoal
        accuracy = test_accuracy(net, test_images, test_labels)
        if shoal.is_main():
            print("epoch %d/%d: test accuracy %.2f%%, checkpoint %s" % (epoch + 1, args.epochs, 100 * accuracy,
                                                                       args.checkpoint), flush=True)


if __name__ == "__main__":
    main()
