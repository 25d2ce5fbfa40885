"""A worker of tests/python/test_launchers.py: joins whatever job started it with shoal.init(),
all-reduces its rank + 1 and prints "launched rank=R world=W local=L sum=S"."""
import torch

import shoal

shoal.init()
t = torch.tensor([float(shoal.rank() + 1)])
shoal.comm.world().all_reduce(t)
print("launched rank=%d world=%d local=%d sum=%d" % (shoal.rank(), shoal.world_size(), shoal.local_rank(), t.item()),
      flush=True)
