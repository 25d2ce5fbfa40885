# The MNIST-format files that torch::data::datasets::MNIST reads, for the PyTorch programs beside
# it (torchvision, which would read them, is not in Debian's archive).
import struct

import torch
from torch.utils.data import Dataset


def _read(path, dims):
    with open(path, "rb") as f:
        data = f.read()
    shape = struct.unpack(">" + "I" * dims, data[4 : 4 + 4 * dims])
    return torch.frombuffer(bytearray(data[4 + 4 * dims :]), dtype=torch.uint8).view(*shape)


class MnistFiles(Dataset):
    def __init__(self, root):
        self.images = _read(root + "/train-images-idx3-ubyte", 3).float().div(255).unsqueeze(1)
        self.labels = _read(root + "/train-labels-idx1-ubyte", 1).long()

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return self.images[index], self.labels[index]
