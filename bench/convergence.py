"""Convergence across resizes (bench/RESULTS.md, section "Convergence across resizes").

    /usr/bin/python3 bench/convergence.py BUILD_DIR [--model cnn|gpt] [--seeds 8]
        [--policy-seeds 5] [--policies global,scale,adascale,goodput] [--limit 12000] [--epochs 3]
        [--batch 64] [--lr 0.05] [--grow-at 0.25] [--shrink-at 0.6] [--eval-every 1500]
        [--test-size 10000] [--target ACCURACY] [--raw FILE]
    /usr/bin/python3 bench/convergence.py BUILD_DIR --table RAW_FILE [the run's other flags]

The demo CNN on Fashion-MNIST (bench/convergence.cpp, BUILD_DIR/bench/convergence), or with
--model gpt a character-level GPT on the GNU GPL's text (AdamW; samples are windows of 32
characters, accuracy the share of test characters predicted; its defaults: --limit 960 of its
988 training windows, --epochs 12, --batch 16, --lr 0.01, --eval-every 1920, all 109 test
windows), trained
  fixed:  on one worker, the program alone, with seeds 0 .. --seeds - 1: the reference, batch
          --batch, lr0 --lr, cosine decay over T = epochs * ceil(limit / batch) steps;
  POLICY: under `shoal run --min 1 --max 4 -n 1`, with seeds 0 .. --policy-seeds - 1 (the fixed
          runs' first seeds), resized 1 -> 4 -> 2: once the first worker reports scaled_steps()
          past --grow-at * T, three workers of `shoal run --join ... -n 3` (started earlier and
          waiting with their data loaded: --start-when) join; once a step of the world of 4
          reports past --shrink-at * T, two of those three get SIGTERM (they leave at their next
          commit). global: keep_global_batch (the global batch stays --batch); scale:
          scale_learning_rate(1, 0) (--batch per worker, lr0 * world); adascale: adascale(1)
          (--batch per worker, lr0 * AdaScale's gain; the run lasts until scaled_steps() reaches
          T, so it trains on more samples than the reference); goodput: BatchPolicy::goodput with
          --batch as the base batch (the job picks its batch for its world, --batch / 4 to
          2 * --batch a worker, at most 8 * --batch in all; lr0 * AdaScale's gain of it).
Every run evaluates on the first --test-size (default 10000: all) test images each time
--eval-every (default 1500) more samples have been trained on, and at the end. The target
accuracy (default: the lowest final accuracy of the fixed runs minus 0.02) gives "samples to
target": the samples trained on at the first evaluation at or above it. A policy is "within the
fixed spread" when the mean of its final accuracies lies between the lowest and the highest
final accuracy of the fixed runs (and likewise for the final test loss); the table also gives
its mean difference from the fixed run of the same seed (same initial parameters and data
order).

Raw lines (every evaluation, every change of world, each run's end) go to --raw (default
bench/results/convergence-DATE.txt); the table is printed at the end. Every wait has a deadline;
a run that misses one is killed and counted as failed.
"""

import argparse
import datetime
import math
import os
import queue
import re
import signal
import statistics
import subprocess
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
STEP = re.compile(r"^step (\d+) world (\d+) samples (\d+) scaled ([\d.]+)(?: lr ([\d.]+) gain ([\d.]+))?")
EVAL = re.compile(r"^(eval|final) samples (\d+) scaled ([\d.]+) commits \d+ world (\d+) loss ([\d.]+) accuracy ([\d.]+)")
LOCAL_RANK = re.compile(r"^\[\d+\] ")  # what `shoal run` puts before each line of a worker


class Launchers:
    """`shoal run` processes (each in a session of its own) whose stdout lines are read, as they
    come, into one queue; stderr goes to a file each."""

    def __init__(self):
        self.processes = []
        self.lines = queue.Queue()

    def start(self, argv, log):
        process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=open(log, "w"), text=True,
                                   start_new_session=True)
        self.processes.append(process)
        threading.Thread(target=self._read, args=(process,), daemon=True).start()
        return process

    def _read(self, process):
        for line in process.stdout:
            self.lines.put(LOCAL_RANK.sub("", line.rstrip("\n")))
        self.lines.put(None)

    def wait_for(self, predicate, timeout, on_line, all_end=False):
        """Feeds each line to on_line until predicate(line) holds; False at the deadline or once
        a launcher has ended (every launcher, with all_end)."""
        deadline = time.time() + timeout
        ended = 0
        while time.time() < deadline and ended < (len(self.processes) if all_end else 1):
            try:
                line = self.lines.get(timeout=max(0.0, min(1.0, deadline - time.time())))
            except queue.Empty:
                continue
            if line is None:
                ended += 1
                continue
            on_line(line)
            if predicate(line):
                return True
        return False

    def wait_exit(self, timeout):
        deadline = time.time() + timeout
        for process in self.processes:
            try:
                process.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                return False
        return True

    def stop(self):
        """Ends the launchers still running: SIGTERM, which each passes on to its workers (a
        worker still waiting for its gate file ends with it), then SIGKILL to whatever is left
        after 20 s. The workers have process groups of their own, so SIGKILL to a launcher's
        session alone would leave them behind."""
        running = [p for p in self.processes if p.poll() is None]
        for process in running:
            process.send_signal(signal.SIGTERM)
        deadline = time.time() + 20
        for process in running:
            try:
                process.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


class Run:
    """One training run's evaluations and changes of world, from its first worker's lines."""

    def __init__(self, kind, seed, emit):
        self.kind, self.seed, self.emit = kind, seed, emit
        self.evals = []  # (samples, scaled, world, loss, accuracy)
        self.final = None
        self.world = None
        self.scaled = 0.0
        self.changes = {}  # world size -> scaled_steps() at its first step
        self.gains = {}  # world size -> the gain of each of its steps
        self.failed = None

    def tag(self):
        return f"run={self.kind} seed={self.seed}"

    def feed(self, line):
        m = STEP.match(line)
        if m:
            step, world, samples, scaled = int(m.group(1)), int(m.group(2)), int(m.group(3)), float(m.group(4))
            self.scaled = scaled
            if m.group(6):
                self.gains.setdefault(world, []).append(float(m.group(6)))
            if world != self.world:
                self.changes.setdefault(world, scaled)
                self.emit(f"{self.tag()} world {world} from step {step} samples {samples} scaled {scaled:.2f}")
                self.world = world
            return
        m = EVAL.match(line)
        if m:
            entry = (int(m.group(2)), float(m.group(3)), int(m.group(4)), float(m.group(5)), float(m.group(6)))
            if m.group(1) == "final":
                self.final = entry
            else:
                self.evals.append(entry)
            self.emit(f"{self.tag()} {line}")
            return

    def emit_gains(self):
        """The policy's gain, mean and range over the steps of each world size."""
        self.emit(f"{self.tag()} gain " + "; ".join(
            f"world {w}: mean {statistics.mean(g):.3f}, {min(g):.3f} .. {max(g):.3f}"
            for w, g in self.gains.items()))

    def samples_to(self, target):
        for samples, _, _, _, accuracy in self.evals + ([self.final] if self.final else []):
            if accuracy >= target:
                return samples
        return None


def program_args(args, policy, seed):
    return [os.path.join(args.build, "bench", "convergence"), "--model", args.model, "--policy", policy,
            "--seed", str(seed),
            "--batch", str(args.batch), "--lr", str(args.lr), "--epochs", str(args.epochs),
            "--limit", str(args.limit), "--eval-every", str(args.eval_every), "--test-size", str(args.test_size)]


def fixed_run(args, seed, emit):
    run = Run("fixed", seed, emit)
    try:
        out = subprocess.run(program_args(args, "global", seed), capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        run.failed = "no end within 600 s"
        return run
    for line in out.stdout.splitlines():
        run.feed(line)
    if out.returncode != 0 or run.final is None:
        run.failed = f"exit code {out.returncode}: {out.stderr.strip()[-300:]}"
    return run


def launcher_workers(launcher_pid):
    """The worker processes of a `shoal run` (its children running bench/convergence)."""
    out = subprocess.run(["pgrep", "-P", str(launcher_pid)], capture_output=True, text=True).stdout.split()
    workers = []
    for pid in sorted(int(p) for p in out):
        try:
            argv0 = open(f"/proc/{pid}/cmdline").read().split("\0")[0]
        except OSError:
            continue
        if argv0.endswith("bench/convergence"):
            workers.append(pid)
    return workers


def resized_run(args, policy, seed, work, emit):
    """1 worker, then 4 from --grow-at * T, then 2 from --shrink-at * T."""
    run = Run(policy, seed, emit)
    total = args.epochs * math.ceil(args.limit / args.batch)
    token = os.path.join(work, f"{policy}-{seed}.token")
    first_log = os.path.join(work, f"{policy}-{seed}-first.err")
    launchers = Launchers()
    shoal = os.path.join(args.build, "bin", "shoal")
    program = program_args(args, policy, seed)

    def step_where(world=None, scaled=0.0):
        def predicate(line):
            m = STEP.match(line)
            return bool(m) and (world is None or int(m.group(2)) == world) and float(m.group(4)) >= scaled
        return predicate

    try:
        launchers.start([shoal, "run", "--min", "1", "--max", "4", "-n", "1", "--token-file", token, *program],
                        first_log)
        if not launchers.wait_for(step_where(1), 120, run.feed):
            run.failed = "no first step within 120 s, or the job ended first"
            return run
        hint = re.search(r"to add workers: shoal run (.+) PROGRAM", open(first_log).read())
        if not hint:
            run.failed = "no join hint on the first launcher's stderr"
            return run
        # The joining workers start now and load their data, then wait for the gate file before
        # they join, so that the resize comes close to the point asked for.
        gate = os.path.join(work, f"{policy}-{seed}.go")
        joiner = launchers.start([shoal, "run", *hint.group(1).split(), "-n", "3", *program, "--start-when", gate],
                                 os.path.join(work, f"{policy}-{seed}-join.err"))
        if not launchers.wait_for(step_where(1, args.grow_at * total), 300, run.feed):
            run.failed = "no step past the grow point within 300 s, or the job ended first"
            return run
        emit(f"{run.tag()} adding 3 workers at scaled {run.scaled:.2f}")
        open(gate, "w").close()
        if not launchers.wait_for(step_where(4, args.shrink_at * total), 300, run.feed):
            run.failed = "no step of a world of 4 past the shrink point within 300 s, or the job ended first"
            return run
        leaving = launcher_workers(joiner.pid)[:2]
        if len(leaving) < 2:
            run.failed = f"found {len(leaving)} workers of the joining launcher, expected 3"
            return run
        emit(f"{run.tag()} SIGTERM to 2 workers at scaled {run.scaled:.2f}")
        for pid in leaving:
            os.kill(pid, signal.SIGTERM)
        # Either launcher may end first: the job's last round ends on all its workers at once.
        if not launchers.wait_for(lambda line: line.startswith("final "), 600, run.feed, all_end=True):
            run.failed = "no final line within 600 s"
            return run
        # The rest of the output (nothing that matters is expected after "final").
        if not launchers.wait_exit(60):
            run.failed = "the launchers did not end within 60 s of the final line"
        codes = [p.returncode for p in launchers.processes]
        if run.failed is None and any(c != 0 for c in codes):
            run.failed = f"launcher exit codes {codes}"
        return run
    finally:
        launchers.stop()


def spread(values):
    return (min(values), max(values)) if values else (float("nan"), float("nan"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("build")
    parser.add_argument("--seeds", type=int, default=8, help="fixed runs (seeds 0..N-1)")
    parser.add_argument("--policy-seeds", type=int, default=5, help="resized runs per policy")
    parser.add_argument("--policies", default="global,scale,adascale,goodput")
    parser.add_argument("--model", choices=("cnn", "gpt"), default="cnn")
    parser.add_argument("--limit", type=int)
    parser.add_argument("--epochs", type=int)
    parser.add_argument("--batch", type=int)
    parser.add_argument("--lr", type=float)
    parser.add_argument("--eval-every", type=int)
    parser.add_argument("--test-size", type=int)
    parser.add_argument("--grow-at", type=float, default=0.25)
    parser.add_argument("--shrink-at", type=float, default=0.6)
    parser.add_argument("--target", type=float, default=None)
    parser.add_argument("--raw", default=None)
    parser.add_argument("--table", metavar="RAW", default=None,
                        help="print the table of an earlier run's raw file (give its other flags too)")
    args = parser.parse_args()
    defaults = {"cnn": dict(limit=12000, epochs=3, batch=64, lr=0.05, eval_every=1500, test_size=10000),
                "gpt": dict(limit=960, epochs=12, batch=16, lr=0.01, eval_every=1920, test_size=1000)}
    for name, value in defaults[args.model].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    policies = [p for p in args.policies.split(",") if p]
    for p in policies:
        if p not in ("global", "scale", "adascale", "goodput"):
            parser.error(f"unknown policy '{p}'; expected some of global,scale,adascale,goodput")
    if args.table:
        fixed, resized, wall = read_raw(args.table, policies)
        report(fixed, resized, args, wall, args.table)
        return

    started = time.time()
    stamp = datetime.datetime.utcnow().strftime("%Y%m%dT%H%MZ")
    raw_path = args.raw or os.path.join(HERE, "results", f"convergence-{stamp}.txt")
    os.makedirs(os.path.dirname(os.path.abspath(raw_path)), exist_ok=True)
    raw = open(raw_path, "w")

    def emit(line):
        print(line, flush=True)
        raw.write(line + "\n")
        raw.flush()

    emit(f"# bench/convergence.py raw lines; date: {datetime.datetime.utcnow():%Y-%m-%d %H:%M} UTC; cores: "
         f"{os.cpu_count()}; load before: {' '.join(open('/proc/loadavg').read().split()[:3])}")
    emit(f"# {' '.join(f'--{k.replace(chr(95), chr(45))} {v}' for k, v in vars(args).items() if k not in ('raw', 'table'))}")
    fixed = [fixed_run(args, s, emit) for s in range(args.seeds)]
    work = tempfile.mkdtemp(prefix="shoal-convergence-bench-")
    resized = {p: [] for p in policies}
    for seed in range(args.policy_seeds):
        for p in policies:
            run = resized_run(args, p, seed, work, emit)
            run.emit_gains()
            if run.failed:
                emit(f"{run.tag()} FAILED: {run.failed}")
            resized[p].append(run)
    wall = time.time() - started
    emit(f"# load after: {' '.join(open('/proc/loadavg').read().split()[:3])}; wall time {wall:.0f} s")

    report(fixed, resized, args, wall, raw_path)


def read_raw(path, policies):
    """The runs of a raw file, as main() collected them: (fixed runs, {policy: runs}, wall s)."""
    runs, wall = {}, float("nan")
    for line in open(path):
        m = re.match(r"# load after: .*; wall time (\d+) s", line)
        if m:
            wall = float(m.group(1))
        m = re.match(r"run=(\w+) seed=(\d+) (.*)", line.rstrip("\n"))
        if not m:
            continue
        key = (m.group(1), int(m.group(2)))
        run = runs.setdefault(key, Run(key[0], key[1], lambda _: None))
        rest = m.group(3)
        if rest.startswith("FAILED: "):
            run.failed = rest[len("FAILED: "):]
        elif rest.startswith("world "):
            w = re.match(r"world (\d+) from step \d+ samples (\d+) scaled ([\d.]+)", rest)
            run.feed(f"step 0 world {w.group(1)} samples {w.group(2)} scaled {w.group(3)}")
        else:
            run.feed(rest)
    fixed = [r for (kind, _), r in sorted(runs.items()) if kind == "fixed"]
    resized = {p: [r for (kind, _), r in sorted(runs.items()) if kind == p] for p in policies}
    for run in runs.values():
        if run.final is None and not run.failed:
            run.failed = "no final line"
    return fixed, resized, wall


def report(fixed, resized, args, wall, raw_path):
    total = args.epochs * math.ceil(args.limit / args.batch)
    good_fixed = [r for r in fixed if not r.failed]
    low, high = spread([r.final[4] for r in good_fixed])
    loss_low, loss_high = spread([r.final[3] for r in good_fixed])
    target = args.target if args.target is not None else round(low - 0.02, 4)
    fixed_final = {r.seed: r.final for r in good_fixed}
    shown = os.path.relpath(os.path.abspath(raw_path), os.path.dirname(HERE))
    print(f"\nraw lines: {raw_path if shown.startswith('..') else shown}")
    print(f"T = {total} reference steps; target accuracy {target:.4f}; fixed runs' final accuracy "
          f"{low:.4f} .. {high:.4f}, test loss {loss_low:.4f} .. {loss_high:.4f}; wall time {wall / 60:.1f} min\n")
    print("| run | seeds | final test accuracy (each seed) | mean ± sd | minus the fixed run of the same seed, "
          "mean | final test loss (each) | minus the fixed run's, mean | samples trained | samples to target (each) | "
          "world 4 / world 2 from, share of T (mean) | within the fixed spread |")
    print("|---|---|---|---|---:|---|---:|---|---|---|---|")

    def row(name, runs, judge):
        done = [r for r in runs if not r.failed]
        accuracy = [r.final[4] for r in done]
        mean = statistics.mean(accuracy) if accuracy else float("nan")
        sd = statistics.stdev(accuracy) if len(accuracy) > 1 else float("nan")
        paired = [r.final[4] - fixed_final[r.seed][4] for r in done if r.seed in fixed_final]
        paired_loss = [r.final[3] - fixed_final[r.seed][3] for r in done if r.seed in fixed_final]
        losses = [r.final[3] for r in done]
        reach = [r.samples_to(target) for r in done]
        trained = sorted({r.final[0] for r in done})
        trained = f"{trained[0]} each" if len(trained) == 1 else ", ".join(str(r.final[0]) for r in done)
        within, changes = "–", "–"
        if judge and accuracy:
            inside = sum(low <= a <= high for a in accuracy)
            within = f"{'yes' if low <= mean <= high else 'no'} (mean; {inside} of {len(accuracy)} seeds)"
            loss_mean = statistics.mean(losses)
            within += f"; loss {'yes' if loss_low <= loss_mean <= loss_high else 'no'}"
            grow = [r.changes[4] / total for r in done if 4 in r.changes]
            shrink = [r.changes[2] / total for r in done if 2 in r.changes]
            if grow and shrink:
                changes = f"{statistics.mean(grow):.2f} / {statistics.mean(shrink):.2f}"
        fails = len(runs) - len(done)
        print(f"| {name} | {len(runs)}{f' ({fails} failed)' if fails else ''} | "
              f"{', '.join(f'{a:.4f}' for a in accuracy)} | {mean:.4f} ± {sd:.4f} | "
              f"{f'{statistics.mean(paired):+.4f}' if judge and paired else '–'} | "
              f"{', '.join(f'{x:.4f}' for x in losses)} | "
              f"{f'{statistics.mean(paired_loss):+.4f}' if judge and paired_loss else '–'} | {trained} | "
              f"{', '.join('never' if x is None else str(x) for x in reach)} | {changes} | {within} |")

    row("fixed, 1 worker", fixed, False)
    names = {"global": "1 -> 4 -> 2, keep_global_batch", "scale": "1 -> 4 -> 2, scale_learning_rate",
             "adascale": "1 -> 4 -> 2, adascale", "goodput": "1 -> 4 -> 2, goodput"}
    for p, runs in resized.items():
        row(names[p], runs, True)
    fixed_reach = [r.samples_to(target) for r in good_fixed]
    if fixed_reach and all(x is not None for x in fixed_reach):
        print(f"\nfixed runs' samples to target: {min(fixed_reach)} .. {max(fixed_reach)}")


if __name__ == "__main__":
    main()
