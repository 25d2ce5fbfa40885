"""A worker of tests/python/test_comm.py. argv: the output file, then the case: "collectives"
(each collective against what it must give), or "mismatch" (worker 1 all-reduces a tensor of
another shape, with a deadline of 3 s). Each worker writes what it saw to OUT.<rank>."""
import sys
import time

import torch

import shoal


def collectives(group, rank, size):
    seen = {}
    t = torch.full((4,), float(rank + 1))
    group.all_reduce(t)
    seen["all_reduce"] = t.tolist()
    t = torch.full((2,), float(rank + 1))
    group.all_reduce(t, op=shoal.comm.ReduceOp.MAX)
    seen["all_reduce_max"] = t.tolist()
    t = torch.arange(3, dtype=torch.float32) + 10 * rank
    work = group.all_reduce(t, op=shoal.comm.ReduceOp.AVG, async_op=True)
    work.wait(timeout=30)
    seen["all_reduce_async_avg"] = t.tolist()
    t = torch.full((2,), float(rank))
    group.broadcast(t, root=size - 1)
    seen["broadcast"] = t.tolist()
    # Uneven parts: member r gives r + 1 rows.
    seen["all_gather"] = group.all_gather(torch.full((rank + 1, 2), float(rank)),
                                          sizes=[r + 1 for r in range(size)]).tolist()
    seen["reduce_scatter"] = group.reduce_scatter(torch.ones(size * 2) * (rank + 1)).tolist()
    seen["all_to_all"] = group.all_to_all(torch.arange(size, dtype=torch.float32) + 100 * rank).tolist()
    if size > 1:
        if rank == 0:
            group.send(torch.tensor([7.0, 8.0]), dst=1, tag=5)
        elif rank == 1:
            got = torch.zeros(2)
            group.recv(got, src=0, tag=5)
            seen["recv"] = got.tolist()
    group.barrier(timeout=30)
    try:
        group.broadcast(torch.zeros(1), root=size + 3)
    except shoal.UsageError as error:
        seen["bad_root"] = str(error)
    try:
        group.all_reduce(torch.zeros(1), timeout=-1)
    except shoal.UsageError as error:
        seen["bad_timeout"] = str(error)
    try:
        group.all_reduce([1.0, 2.0])
    except shoal.UsageError as error:
        seen["bad_type"] = str(error)
    return seen


def mismatch(group, rank):
    start = time.monotonic()
    try:
        group.all_reduce(torch.ones(4 if rank == 0 else 5), timeout=3)
        return {"error": None}
    except shoal.Error as error:
        return {"error": type(error).__name__, "message": str(error), "seconds": time.monotonic() - start,
                "broken": group.is_broken()}


def main(out, case):
    shoal.init()
    group = shoal.comm.world()
    seen = collectives(group, shoal.rank(), shoal.world_size()) if case == "collectives" else mismatch(group, shoal.rank())
    seen["members"] = group.members()
    torch.save(seen, "%s.%d" % (out, shoal.rank()))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
