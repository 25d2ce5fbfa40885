# pytorch_plain.py made data parallel with shoal (docs/python.md): two lines added, three changed.
#   shoal run -n 4 /usr/bin/python3 pytorch_shoal.py DATA_DIR MODEL_OUT [EPOCHS]
import sys

import torch
import torch.nn.functional as F
import shoal
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
    loader = shoal.data.DataLoader(dataset, batch_size=64, shuffle=True)
    net = Net()
    model = shoal.DataParallel(net)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    for epoch in range(epochs):
        for data, target in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(data), target)
            loss.backward()
            optimizer.step()
    if shoal.is_main(): torch.save(net.state_dict(), sys.argv[2])


if __name__ == "__main__":
    main()
