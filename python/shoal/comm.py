"""shoal.comm: groups of workers and their collectives on torch tensors, with a deadline on every
wait (shoal/comm/group.h, docs/comm.md). Durations are in seconds; None is the group's deadline.

    group = shoal.comm.world()
    group.all_reduce(t)                               # in place, summed over the workers
    work = group.all_reduce(t, op=shoal.comm.ReduceOp.AVG, async_op=True); work.wait()
    parts = group.all_gather(t, sizes=[3, 2])         # each member's dim-0 size when they differ

A lost peer or a passed deadline raises shoal.CommError, bad arguments shoal.UsageError, each
with the C++ one-line text."""
from ._C import Group, ReduceOp, Work, world

__all__ = ["Group", "ReduceOp", "Work", "world"]
