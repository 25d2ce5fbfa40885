"""bench/pipeline.cpp's `--impl shoal` written in Python: the same stack (layers x (Linear(dim, dim),
Tanh), seed 0) as a torch.nn.Sequential of Python modules in shoal.pipeline.Pipeline, the same batch
(seed 1) and step (forward and backward of the batch's mean MSE loss, the gradients cleared before
it, no optimizer), timed on worker 0 between barriers; `--impl local` runs the stack on the whole
batch in one Python process. It prints bench/pipeline's line with lang=python, so that the two
languages' speeds over one process compare: what the pipeline's Python layers cost, each forward
taking the GIL back from the C++ runtime that called it (docs/python.md, "Pipelines").

    PYTHONPATH=build/python build/bin/shoal run -n 2 --no-tag-output /usr/bin/python3 bench/pipeline_python.py \\
        --impl shoal --schedule 1f1b --batch 4096 --micro-batches 8
    PYTHONPATH=build/python /usr/bin/python3 bench/pipeline_python.py --impl local --batch 4096"""
import argparse
import statistics
import sys
import time

import torch

import shoal


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--impl", choices=["shoal", "local"], required=True)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.dim, args.dim), torch.nn.Tanh()]
    net = torch.nn.Sequential(*layers)
    torch.manual_seed(1)
    x, y = torch.randn(args.batch, args.dim), torch.randn(args.batch, args.dim)
    if args.impl == "local":
        params, workers, v, m = list(net.parameters()), 1, 1, 1
        barrier = lambda: None  # noqa: E731

        def step():
            torch.nn.functional.mse_loss(net(x), y).backward()
    else:
        shoal.init(intra_op_threads=1)
        workers = shoal.world_size()
        v = 2 if args.schedule == "interleaved" else 1
        stages = workers * v
        split = [2 * args.layers // stages] * stages
        pipe = shoal.pipeline.Pipeline(net, micro_batches=args.micro_batches, schedule=args.schedule,
                                       stages_per_worker=v, split=split)
        params, m = pipe.parameters(), args.micro_batches
        world = shoal.comm.world()
        barrier = world.barrier

        def step():
            pipe.step(x, y, torch.nn.functional.mse_loss)
    ms = []
    for s in range(args.warmup + args.steps):
        for p in params:
            p.grad = None
        barrier()
        start = time.perf_counter()
        step()
        barrier()
        if s >= args.warmup:
            ms.append((time.perf_counter() - start) * 1e3)
    if args.impl == "local" or shoal.is_main():
        median = statistics.median(ms)
        print("pipeline lang=python impl=%s schedule=%s p=%d v=%d m=%d layers=%d activation=tanh dim=%d batch=%d "
              "steps=%d step_ms=%.2f min_ms=%.2f samples_per_s=%.1f"
              % (args.impl, args.schedule if args.impl == "shoal" else "-", workers, v, m, args.layers, args.dim,
                 args.batch, len(ms), median, min(ms), 1000.0 * args.batch / median))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
