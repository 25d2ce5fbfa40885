"""bench/ddp.cpp's --alternate, written in Python: shoal's Python DataParallel (the package shoal,
docs/python.md) beside a Python `local` (each worker trains alone: no averaging, the bound),
`lockstep` (no averaging, a barrier after every backward) and PyTorch's own DDP over Gloo at its
defaults (`pytorch`) and with gradient_as_bucket_view=True (`pytorch-view`), each its own copy of
the model, in blocks of B steps that take turns in the same processes, the order rotating from
cycle to cycle, each block starting at a barrier. Issue 40's goals: Python shoal's fraction of
Python local within 0.03 of C++ shoal's fraction of C++ local, which bench/ddp prints in the same
form; and Python shoal ahead of PyTorch's DDP by at least C++ shoal's margin. PyTorch's process
group is made from torchrun's variables, which `shoal run` sets.

    source bench/malloc_tunables.sh
    PYTHONPATH=build/python build/bin/shoal run -n 2 --no-tag-output /usr/bin/python3 \\
        bench/ddp_python.py --model mlp --impl local,lockstep,shoal --alternate 2 --steps 200 --warmup 5

prints, on the first worker, bench/ddp's lines (with lang=python):

    ddp lang=python impl=shoal model=mlp workers=2 batch=64 steps=200 samples_per_s=... step_ms=... weight_abs_sum=...
    ddp_alternate lang=python impl=shoal versus=local model=mlp block=2 cycles=100 ratio=0.95 cycle_median=...

ratio is the contender's samples/s over the first's; cycle_* the quartiles of the same ratio
taken cycle by cycle (each block's time the slower worker's). The models are bench/ddp.py's,
which are bench/ddp.cpp's."""
import argparse
import os
import statistics
import sys
import time

import torch

import shoal

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ddp import build_model  # noqa: E402  (bench/ddp.py: the same models as bench/ddp.cpp)


PYTORCH = ("pytorch", "pytorch-view")


def join_pytorch():
    """torch.distributed's Gloo process group over the same workers, as a program under torchrun
    makes it: `shoal run` gives its workers torchrun's variables and hosts the store they name."""
    import datetime  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["mlp", "cnn"], required=True)
    parser.add_argument("--impl", default="local,lockstep,shoal",
                        help="comma-separated: local, lockstep, shoal, pytorch, pytorch-view")
    parser.add_argument("--alternate", type=int, default=1, help="steps per block")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=64, help="per worker")
    args = parser.parse_args()
    impls = args.impl.split(",")
    for impl in impls:
        if impl not in ("local", "lockstep", "shoal") + PYTORCH:
            parser.error("--impl %s: expected local, lockstep, shoal, pytorch or pytorch-view" % impl)

    torch.set_num_threads(1)  # one intra-op thread per worker, as bench/ddp's contenders
    shoal.init(intra_op_threads=1)
    world = shoal.comm.world()
    rank, n = shoal.rank(), shoal.world_size()

    if any(impl in PYTORCH for impl in impls):
        join_pytorch()
    trainers = []
    for impl in impls:
        torch.manual_seed(0)  # the same initial weights for every contender
        net = build_model(args.model)
        if impl == "shoal":
            model = shoal.DataParallel(net)
        elif impl in PYTORCH:
            model = torch.nn.parallel.DistributedDataParallel(net, gradient_as_bucket_view=impl == "pytorch-view")
        else:
            model = net
        trainers.append({"impl": impl, "net": net, "model": model, "blocks": [],
                         "optimizer": torch.optim.SGD(net.parameters(), lr=0.01)})

    # Different data on every worker, the same from run to run; made before anything is timed.
    torch.manual_seed(1000 + rank)
    shape = (args.batch, 784) if args.model == "mlp" else (args.batch, 1, 28, 28)
    batches = [(torch.randn(shape), torch.randint(0, 10, (args.batch,))) for _ in range(4)]

    def step(t, i):
        x, y = batches[i % len(batches)]
        t["optimizer"].zero_grad()
        torch.nn.functional.cross_entropy(t["model"](x), y).backward()
        if t["impl"] == "lockstep":
            world.barrier()
        t["optimizer"].step()

    for t in trainers:
        for i in range(args.warmup):
            step(t, i)
    block = args.alternate
    cycles = (args.steps + block - 1) // block
    for c in range(cycles):
        first = min(c * block, args.steps)
        count = min(block, args.steps - first)
        for turn in range(len(trainers)):
            t = trainers[(c + turn) % len(trainers)]
            world.barrier()
            start = time.perf_counter()
            for i in range(count):
                step(t, args.warmup + first + i)
            t["blocks"].append(time.perf_counter() - start)

    totals, job_blocks = [], []
    for t in trainers:
        # The job is as fast as its slowest worker; so is each block.
        blocks = torch.tensor(t["blocks"], dtype=torch.float64)
        world.all_reduce(blocks, op=shoal.comm.ReduceOp.MAX)
        job_blocks.append(blocks.tolist())
        total = torch.tensor([sum(t["blocks"])], dtype=torch.float64)
        world.all_reduce(total, op=shoal.comm.ReduceOp.MAX)
        totals.append(total.item())
        if rank == 0:
            weights = sum(p.detach().double().abs().sum().item() for p in t["net"].parameters())
            print("ddp lang=python impl=%s model=%s workers=%d batch=%d steps=%d threads=%d samples_per_s=%.2f "
                  "step_ms=%.3f alternate=%d weight_abs_sum=%.6f"
                  % (t["impl"], args.model, n, args.batch, args.steps, torch.get_num_threads(),
                     n * args.batch * args.steps / totals[-1], totals[-1] * 1e3 / args.steps, block, weights))
    if rank == 0:
        # Each contender against the first; and shoal against each of PyTorch's.
        pairs = [(0, k) for k in range(1, len(trainers))]
        impls_at = {t["impl"]: k for k, t in enumerate(trainers)}
        if "shoal" in impls_at:
            pairs += [(impls_at[p], impls_at["shoal"]) for p in PYTORCH if p in impls_at and impls_at[p] != 0]
        for base, k in pairs:
            ratios = sorted(job_blocks[base][c] / job_blocks[k][c] for c in range(cycles))
            q = lambda p: ratios[int(p * (len(ratios) - 1) + 0.5)]
            print("ddp_alternate lang=python impl=%s versus=%s model=%s block=%d cycles=%d ratio=%.4f "
                  "cycle_median=%.4f cycle_q1=%.4f cycle_q3=%.4f"
                  % (trainers[k]["impl"], trainers[base]["impl"], args.model, block, cycles,
                     totals[base] / totals[k], statistics.median(ratios), q(0.25), q(0.75)))
    sys.stdout.flush()
    world.barrier()


if __name__ == "__main__":
    main()
