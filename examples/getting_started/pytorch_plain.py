# plain.cpp's program in PyTorch, the starting point of the PyTorch DDP comparison in
# docs/getting-started.md; pytorch_ddp.py is the same made data parallel.
#   python3 pytorch_plain.py DATA_DIR MODEL_OUT [EPOCHS]   (DATA_DIR: MNIST-format files, uncompressed)
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from mnist_files import MnistFiles


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(784, 64), torch.nn.Linear(64, 10)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x.view(x.size(0), 784))))


def main():
    epochs = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    torch.manual_seed(0)
    dataset = MnistFiles(sys.argv[1])
    loader = DataLoader(dataset, batch_size=64, shuffle=True)
    net = Net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    for epoch in range(epochs):
        for data, target in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(net(data), target)
            loss.backward()
            optimizer.step()
    torch.save(net.state_dict(), sys.argv[2])


if __name__ == "__main__":
    main()
