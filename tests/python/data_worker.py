"""A worker of tests/python/test_data.py. argv: the output file, the case, and for "resume_after" the
state file. Cases:
  once          two epochs of a shuffled 50-sample dataset in global batches of 8, torch's loader
                with 2 processes reading ahead; records the indices of each batch it got.
  resume_before three batches of the same, then the loader's state saved (worker 0) to the state file.
  resume_after  the state loaded, the rest of the epoch.
  train         DataParallel over an epoch of 50 samples in global batches of 16, unshuffled, 2 loader
                processes: the last batch of 2 rows leaves a worker of 3 with a share of 0 rows."""
import sys

import torch

import shoal


class Indices(torch.utils.data.Dataset):
    """Sample i is (i as a float row of 5, a target row of 3), so that a batch names its indices."""

    def __len__(self):
        return 50

    def __getitem__(self, i):
        generator = torch.Generator().manual_seed(i)
        return torch.full((5,), float(i)) + torch.randn(5, generator=generator), torch.randn(3, generator=generator), i


def main(out, case, state_file=None):
    shoal.init()
    seen = []
    if case == "train":
        import dp_program as program
        net = program.model()
        model = shoal.DataParallel(net)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        loader = shoal.data.DataLoader(Indices(), batch_size=16, num_workers=2)
        for x, y, i in loader:
            seen.append(i.tolist())
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
        torch.save({"seen": seen, "params": [p.detach() for p in net.parameters()]}, "%s.%d" % (out, shoal.rank()))
        return
    loader = shoal.data.DataLoader(Indices(), batch_size=8, shuffle=True, seed=3, num_workers=2, prefetch_factor=4)
    if case == "once":
        for epoch in range(2):
            seen.append([i.tolist() for _, _, i in loader.epoch(epoch)])
    elif case == "resume_before":
        for k, (_, _, i) in enumerate(loader.epoch(0)):
            seen.append(i.tolist())
            if k == 2:
                break
        if shoal.is_main():
            torch.save(loader.state_dict(), state_file)
    elif case == "resume_after":
        loader.load_state_dict(torch.load(state_file))
        seen = [i.tolist() for _, _, i in loader.epoch(0)]
    torch.save(seen, "%s.%d" % (out, shoal.rank()))


if __name__ == "__main__":
    main(*sys.argv[1:])
