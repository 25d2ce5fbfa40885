"""PyTorch's DistributedDataParallel (gloo) on the models of bench/ddp.cpp, and ddp.sh's table.

One worker per process, started by bench/ddp.sh with RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set (torch.distributed's env:// rendezvous), one process per network namespace on
the shaped link:

    /usr/bin/python3 bench/ddp.py --model mlp|cnn [--batch 64] [--warmup 3] [--steps 20]

prints on rank 0 the same key=value line as bench/ddp.cpp (impl=pytorch), so that ddp.sh reads
all contenders alike. DDP runs with its defaults (bucket_cap_mb=25, gradient_as_bucket_view off,
buckets rebuilt after the first step), as a user would run it, unless asked otherwise:

    --bucket-view   gradient_as_bucket_view=True (gradients live in the buckets: no copies)
    --fp16          PyTorch's own fp16_compress_hook (torch.distributed.algorithms.ddp_comm_hooks)

The line adds DDP's own record of its buckets and of its last sampled iteration's backward
(compute, comm, overlap).

    /usr/bin/python3 bench/ddp.py summarize RESULTS_FILE

prints ddp.sh's tables from the lines the runs printed (one "round=R link=L" prefix each).
"""

import argparse
import datetime
import os
import statistics
import sys
import time


def parse_line(line):
    fields = {}
    for token in line.split():
        key, sep, value = token.partition("=")
        if sep:
            fields[key] = value
    return fields


def build_model(name):
    import torch.nn as nn

    if name == "mlp":
        return nn.Sequential(nn.Linear(784, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10))

    class Net(nn.Module):  # examples/fashion_mnist.cpp's NetImpl
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(1, 8, 5, padding=2)
            self.conv2 = nn.Conv2d(8, 16, 5, padding=2)
            self.fc1 = nn.Linear(16 * 7 * 7, 64)
            self.fc2 = nn.Linear(64, 10)

        def forward(self, x):
            f = nn.functional
            x = f.max_pool2d(f.relu(self.conv1(x)), 2)
            x = f.max_pool2d(f.relu(self.conv2(x)), 2)
            x = f.relu(self.fc1(x.flatten(1)))
            return self.fc2(x)

    return Net()


def train(args):
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    torch.set_num_threads(1)  # one intra-op thread per worker, as shoal's contenders
    # The group's timeout bounds every collective, so a lost peer ends the run instead of hanging.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, workers = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)
    # Broadcasts rank 0's parameters.
    model = nn.parallel.DistributedDataParallel(build_model(args.model), gradient_as_bucket_view=args.bucket_view)
    if args.fp16:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    # Different data on every worker, the same from run to run; made before anything is timed.
    torch.manual_seed(1000 + rank)
    shape = (args.batch, 784) if args.model == "mlp" else (args.batch, 1, 28, 28)
    batches = [(torch.randn(shape), torch.randint(0, 10, (args.batch,))) for _ in range(4)]

    sums = {"forward": 0.0, "backward": 0.0, "optim": 0.0}

    def step(i, timed):
        x, y = batches[i % len(batches)]
        optimizer.zero_grad()
        t0 = time.perf_counter()
        loss = nn.functional.cross_entropy(model(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        optimizer.step()
        t3 = time.perf_counter()
        if timed:
            sums["forward"] += t1 - t0
            sums["backward"] += t2 - t1
            sums["optim"] += t3 - t2

    for i in range(args.warmup):
        step(i, False)
    dist.barrier()
    start = time.perf_counter()
    for i in range(args.steps):
        step(args.warmup + i, True)
    seconds = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the job is as fast as its slowest worker

    if rank == 0:
        slowest = seconds.item()
        weight_sum = sum(p.detach().double().abs().sum().item() for p in model.parameters())
        data = model._get_ddp_logging_data()
        ns = lambda key: data.get(key, 0) / 1e6  # DDP records nanoseconds
        print(
            f"ddp impl=pytorch model={args.model} workers={workers} batch={args.batch} steps={args.steps} "
            f"threads={torch.get_num_threads()} gloo_threads={data.get('gloo_num_threads', '?')} "
            f"bucket_view={int(args.bucket_view)} hook={'fp16' if args.fp16 else 'none'} "
            f"samples_per_s={workers * args.batch * args.steps / slowest:.2f} "
            f"step_ms={slowest * 1e3 / args.steps:.3f} forward_ms={sums['forward'] * 1e3 / args.steps:.3f} "
            f"backward_ms={sums['backward'] * 1e3 / args.steps:.3f} comm_ms=0.000 "
            f"optim_ms={sums['optim'] * 1e3 / args.steps:.3f} "
            f"bucket_bytes={str(data.get('rebuilt_bucket_sizes', data.get('bucket_sizes', '?'))).replace(' ', '')} "
            f"ddp_iteration={data.get('iteration', '?')} ddp_backward_compute_ms={ns('backward_compute_time'):.3f} "
            f"ddp_backward_comm_ms={ns('backward_comm_time'):.3f} "
            f"ddp_overlap_ms={ns('backward_compute_comm_overlap_time'):.3f} weight_abs_sum={weight_sum:.6f}",
            flush=True,
        )
    # No barrier and no teardown: the all_reduce above was both workers' last collective and the
    # result is printed. A last collective at exit left a worker on the shaped link waiting for a
    # peer that had gone, and destroy_process_group() left one spinning after its result line
    # until the run's timeout (2026-11-24); neither is part of what is measured.
    sys.stdout.flush()
    os._exit(0)


# PyTorch's float32 configurations and its fp16 hook's; "best" is the one with the highest
# median throughput on that link and model, in that run.
PYTORCH = ("pytorch", "pytorch-view")
PYTORCH_FP16 = ("pytorch-fp16", "pytorch-view-fp16")
NAMES = {
    "pytorch": "default",
    "pytorch-view": "gradient_as_bucket_view",
    "pytorch-fp16": "fp16 hook",
    "pytorch-view-fp16": "fp16 hook, bucket view",
}


def summarize(path):
    """Medians per (link, model, contender) over rounds, and the ratios between contenders."""
    runs = {}
    with open(path) as results:
        for line in results:
            f = parse_line(line)
            if "contender" in f and "samples_per_s" in f:
                runs.setdefault((f["link"], f["model"], f["contender"]), []).append(f)
    links = [l for l in ("loopback", "shaped") if any(k[0] == l for k in runs)]
    models = [m for m in ("mlp", "cnn") if any(k[1] == m for k in runs)]
    present = {k[2] for k in runs}
    main = [c for c in ("shoal", *PYTORCH, "hand") if c in present]
    fp16 = [c for c in ("shoal-fp16", *PYTORCH_FP16) if c in present]
    others = sorted(present - set(main) - set(fp16))
    nan = float("nan")

    def median(link, model, contender, key="samples_per_s"):
        values = [float(r[key]) for r in runs.get((link, model, contender), []) if key in r]
        return statistics.median(values) if values else nan

    def spread(link, model, contender):
        values = [float(r["samples_per_s"]) for r in runs.get((link, model, contender), [])]
        return f"{min(values):.1f}–{max(values):.1f} ({len(values)})" if values else "–"

    def first(link, model, contender, key):
        return next((r[key] for r in runs.get((link, model, contender), []) if key in r), "–")

    def paired(link, model, a, b):
        """Median over rounds of a/b within each round: noise that drifts over minutes cancels."""
        by_round = lambda c: {r["round"]: float(r["samples_per_s"]) for r in runs.get((link, model, c), [])}
        x, y = by_round(a), by_round(b)
        ratios = [x[r] / y[r] for r in x if r in y]
        return statistics.median(ratios) if ratios else nan

    def best(link, model, candidates):
        measured = [c for c in candidates if (link, model, c) in runs]
        return max(measured, key=lambda c: median(link, model, c)) if measured else None

    def ratio(link, model, a, b):
        """a/b as a ratio of medians, with the median of the rounds' ratios in brackets."""
        if b is None or (link, model, a) not in runs or (link, model, b) not in runs:
            return "–"
        return f"{median(link, model, a) / median(link, model, b):.3f} ({paired(link, model, a, b):.3f})"

    def cell(x):
        return "–" if x != x else f"{x:.1f}"

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    shown_path = os.path.relpath(os.path.abspath(path), root)
    print(f"raw lines: {path if shown_path.startswith('..') else shown_path}")
    print("Ratios: ratio of the medians over rounds (in brackets: median of the rounds' ratios).")
    print("PyTorch best: the faster of PyTorch's configurations in this run, named.")
    print()
    print("| link | model | shoal samples/s | PyTorch default | PyTorch bucket view | hand | "
          "shoal/PyTorch default | shoal/PyTorch best | PyTorch best | shoal/hand |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|---:|")
    for link in links:
        for model in models:
            top = best(link, model, PYTORCH)
            values = [median(link, model, c) for c in ("shoal", "pytorch", "pytorch-view", "hand")]
            print(f"| {link} | {model} | " + " | ".join(cell(v) for v in values) +
                  f" | {ratio(link, model, 'shoal', 'pytorch')} | {ratio(link, model, 'shoal', top)} | "
                  f"{NAMES.get(top, '–')} | {ratio(link, model, 'shoal', 'hand')} |")
    if fp16:
        print()
        print("16-bit gradients: shoal's dp::fp16_compress_hook() beside PyTorch's own fp16_compress_hook.")
        print()
        print("| link | model | shoal-fp16 samples/s | PyTorch fp16 hook | PyTorch fp16 hook, bucket view | "
              "shoal-fp16/PyTorch fp16 best | PyTorch fp16 best |")
        print("|---|---|---:|---:|---:|---:|---|")
        for link in links:
            for model in models:
                top = best(link, model, PYTORCH_FP16)
                values = [median(link, model, c) for c in ("shoal-fp16", *PYTORCH_FP16)]
                print(f"| {link} | {model} | " + " | ".join(cell(v) for v in values) +
                      f" | {ratio(link, model, 'shoal-fp16', top)} | {NAMES.get(top, '–')} |")
    print()
    print("Spread: min–max samples/s over rounds (runs):")
    print()
    shown = main + fp16
    print("| link | model | " + " | ".join(shown) + " |")
    print("|---|---|" + "---:|" * len(shown))
    for link in links:
        for model in models:
            print(f"| {link} | {model} | " + " | ".join(spread(link, model, c) for c in shown) + " |")
    print()
    print("Where a step goes: medians over rounds of the main worker's per-step means, ms. backward")
    print("includes DataParallel's (DDP's) wait for its last buckets; after: the hand loop's all-reduces after")
    print("backward (least: the smaller of the two workers' waits, which holds no waiting for the peer).")
    print()
    print("| link | model | contender | step | forward | backward | after | after, least | optimizer | buckets (bytes) |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---|")
    for link in links:
        for model in models:
            for c in shown:
                if (link, model, c) not in runs:
                    continue
                cells = [median(link, model, c, k) for k in ("step_ms", "forward_ms", "backward_ms", "comm_ms", "tail_min_ms", "optim_ms")]
                print(f"| {link} | {model} | {c} | " + " | ".join(cell(x) for x in cells) +
                      f" | {first(link, model, c, 'bucket_bytes')} |")
    if not others:
        return
    print()
    print("Other contenders: samples/s, and medians of the rounds' ratios to shoal and to PyTorch's")
    print("default (shoal-copy beside PyTorch's default is the matched pair: both copy into buckets).")
    print()
    print("| link | model | contender | samples/s | /shoal | /PyTorch default | /PyTorch best | step ms | backward ms |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for link in links:
        for model in models:
            top = best(link, model, PYTORCH)
            for c in others:
                if (link, model, c) not in runs:
                    continue
                x = median(link, model, c)
                cells = [median(link, model, c, k) for k in ("step_ms", "backward_ms")]
                print(f"| {link} | {model} | {c} | {x:.1f} | {paired(link, model, c, 'shoal'):.3f} | "
                      f"{paired(link, model, c, 'pytorch'):.3f} | "
                      f"{paired(link, model, c, top) if top else nan:.3f} | " + " | ".join(cell(v) for v in cells) + " |")


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "summarize":
        summarize(sys.argv[2])
        return
    parser = argparse.ArgumentParser(description="PyTorch DDP (gloo) throughput on bench/ddp.cpp's models")
    parser.add_argument("--model", choices=("mlp", "cnn"), default="mlp")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--bucket-view", action="store_true", help="gradient_as_bucket_view=True")
    parser.add_argument("--fp16", action="store_true", help="PyTorch's fp16_compress_hook")
    args = parser.parse_args()
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        if var not in os.environ:
            sys.exit(f"ddp.py: {var} is not set; start it as bench/ddp.sh does (or under torchrun)")
    train(args)


if __name__ == "__main__":
    main()
