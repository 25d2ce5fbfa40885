# pytorch_plain.py made data parallel by Horovod's documented recipe for PyTorch (its docs'
# "Horovod with PyTorch": init, pin the GPU, a DistributedSampler, wrap the optimizer, broadcast the
# parameters and the optimizer's state, save on rank 0; set_epoch as its examples do), keeping the
# global batch of 64 as pytorch_ddp.py does. Counted beside pytorch_ddp.py and pytorch_shoal.py
# (tests/python/test_getting_started.py); not run here, as Debian's archive has no Horovod.
#   horovodrun -np 4 python3 pytorch_horovod.py DATA_DIR MODEL_OUT [EPOCHS]
import sys

import torch
import torch.nn.functional as F
import horovod.torch as hvd
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
    hvd.init()
    if torch.cuda.is_available(): torch.cuda.set_device(hvd.local_rank())
    torch.manual_seed(0)
    dataset = MnistFiles(sys.argv[1])
    sampler = torch.utils.data.distributed.DistributedSampler(dataset, num_replicas=hvd.size(), rank=hvd.rank())
    loader = DataLoader(dataset, batch_size=64 // hvd.size(), sampler=sampler)
    net = Net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=net.named_parameters())
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for data, target in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(net(data), target)
            loss.backward()
            optimizer.step()
    if hvd.rank() == 0: torch.save(net.state_dict(), sys.argv[2])


if __name__ == "__main__":
    main()
