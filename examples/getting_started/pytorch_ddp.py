# pytorch_plain.py made data parallel with PyTorch's DDP, for the comparison in
# docs/getting-started.md.
#   torchrun --nproc_per_node 4 pytorch_ddp.py DATA_DIR MODEL_OUT [EPOCHS]
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from mnist_files import MnistFiles


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(784, 64), torch.nn.Linear(64, 10)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x.view(x.size(0), 784))))


def main():
    epochs = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    dataset = MnistFiles(sys.argv[1])
    sampler = DistributedSampler(dataset, shuffle=True)
    loader = DataLoader(dataset, batch_size=64 // dist.get_world_size(), sampler=sampler)
    net = Net()
    model = DistributedDataParallel(net)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for data, target in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(data), target)
            loss.backward()
            optimizer.step()
    if dist.get_rank() == 0:
        torch.save(net.state_dict(), sys.argv[2])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
