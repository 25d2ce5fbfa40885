"""Elastic recovery, shoal beside torchrun's elastic agent (bench/RESULTS.md, section "elastic").

    [ROUNDS=3] [CONTENDERS=shoal,shoal-etcd,torchrun,torchrun-fixed] /usr/bin/python3 bench/elastic.py BUILD_DIR

For each round and contender, on the MLP of bench/ddp (784-2048-2048-10, batch 64 per worker,
one thread per worker, SGD with momentum, a commit or checkpoint after every step):
  kill: 3 workers; after step 20, SIGKILL one (not the first); time from the kill to the next
        step that completes (the first committed step after it).
  join: 2 workers; after step 20 a third is added (shoal: `shoal run --join`; torchrun: a second
        agent on the same rendezvous); time from starting it to the first step of a world of 3.
Contenders: shoal (gossip membership, `shoal run --min 1 --max 3`); shoal-etcd (the same with
`--rendezvous etcd://...`, on an etcd server this script starts: Debian's etcd-server, one member on
127.0.0.1, its data in a temporary directory); torchrun (`--nnodes=1:3`, c10d
rendezvous, as elastic jobs are started; it waits out its last call); torchrun-fixed (`--nnodes=1`,
`--monitor-interval=1`: restarts only, no membership changes, its fastest recovery).
(CONTENDERS=none measures only the commit cost.) Then the cost of commit() every step against never, in a static-size elastic job of 2 workers
(`--min 2 --max 2`), for the same MLP.

    /usr/bin/python3 bench/elastic.py --worker STEPS CHECKPOINT

is the torchrun worker: PyTorch DDP (gloo), the same model, torch.save of model and optimizer
after every step (to CHECKPOINT, by rank 0, through a temporary file and a rename), loaded at
start when it exists; prints "step S world W t=MS" like bench/elastic.cpp.
"""

import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

STEP = re.compile(r"step (\d+) world (\d+) t=(\d+)")
PID = re.compile(r"pid=(\d+) rank=(\d+)")


def worker(steps, checkpoint):
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    print(f"pid={os.getpid()} rank={rank}", flush=True)
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(784, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * world, momentum=0.9)
    step = 0
    if os.path.exists(checkpoint):
        saved = torch.load(checkpoint)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        step = saved["step"]
    ddp = nn.parallel.DistributedDataParallel(model)
    generator = torch.Generator().manual_seed(rank)
    while step < steps:
        x = torch.randn(64, 784, generator=generator)
        y = torch.randint(10, (64,), generator=generator)
        optimizer.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()
        step += 1
        if rank == 0:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
                       checkpoint + ".tmp")
            os.replace(checkpoint + ".tmp", checkpoint)
            print(f"step {step} world {world} t={int(time.time() * 1000)}", flush=True)
    dist.destroy_process_group()


class Job:
    """A launcher process whose stdout is read line by line (stderr goes to a file)."""

    def __init__(self, argv, log):
        self.log = open(log, "w")
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                        start_new_session=True)
        self.lines = []

    def wait_for(self, predicate, timeout):
        deadline = time.time() + timeout
        while time.time() < deadline:
            line = self.process.stdout.readline()
            if not line:
                if self.process.poll() is not None:
                    return None
                continue
            self.lines.append(line)
            found = predicate(line)
            if found:
                return found
        return None

    def pids(self):
        return {int(m.group(2)): int(m.group(1)) for l in self.lines for m in [PID.search(l)] if m}

    def stop(self):
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(15)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.log.close()


def step_line(min_step=0, world=None):
    def predicate(line):
        m = STEP.search(line)
        if m and int(m.group(1)) >= min_step and (world is None or int(m.group(2)) == world):
            return int(m.group(1)), int(m.group(2)), int(m.group(3))
        return None
    return predicate


ETCD = None  # "HOST:PORT" of the etcd server that main() starts for shoal-etcd


def shoal_argv(build, n, contender, extra=()):
    if contender == "shoal-etcd":
        extra = ["--rendezvous", f"etcd://{ETCD}", *extra]
    return [f"{build}/bin/shoal", "run", "--min", "1", "--max", "3", "-n", str(n), *extra,
            f"{build}/bench/elastic", "--steps", "100000"]


def start_etcd(work):
    """Debian's etcd on free ports of 127.0.0.1; returns (process, "HOST:PORT") once it answers."""
    import urllib.request
    client, peer = free_port(), free_port()
    process = subprocess.Popen(
        ["/usr/bin/etcd", "--name", "bench", "--data-dir", os.path.join(work, "etcd"),
         "--listen-client-urls", f"http://127.0.0.1:{client}", "--advertise-client-urls", f"http://127.0.0.1:{client}",
         "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-cluster", f"bench=http://127.0.0.1:{peer}"],
        stdout=subprocess.DEVNULL, stderr=open(os.path.join(work, "etcd.log"), "w"))
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{client}/health", timeout=1).read()
            return process, f"127.0.0.1:{client}"
        except OSError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError("etcd did not answer within 30 s; see " + os.path.join(work, "etcd.log"))


def torchrun_argv(n, nnodes, endpoint, checkpoint, logdir, fixed):
    argv = ["/usr/bin/python3", "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc_per_node={n}",
            "--max_restarts=5", "--redirects=2", "--tee=1", f"--log_dir={logdir}"]
    if fixed:
        argv += ["--monitor_interval=1", "--rdzv_backend=c10d", f"--rdzv_endpoint={endpoint}"]
    else:
        argv += ["--rdzv_backend=c10d", f"--rdzv_endpoint={endpoint}"]
    return argv + [os.path.abspath(__file__), "--worker", "100000", checkpoint]


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure_kill(contender, build, work):
    checkpoint = os.path.join(work, f"{contender}.ckpt")
    if os.path.exists(checkpoint):
        os.remove(checkpoint)
    if contender.startswith("shoal"):
        job = Job(shoal_argv(build, 3, contender), os.path.join(work, "kill.err"))
    else:
        job = Job(torchrun_argv(3, "1" if contender == "torchrun-fixed" else "1:3", f"127.0.0.1:{free_port()}",
                                checkpoint, work, contender == "torchrun-fixed"), os.path.join(work, "kill.err"))
    try:
        if not job.wait_for(step_line(20), 180):
            return None
        if contender.startswith("shoal"):
            victim = find_shoal_worker(job.process.pid, exclude_first=True)
        else:
            victim = job.pids().get(1)
        killed = time.time()
        os.kill(victim, signal.SIGKILL)
        after = job.wait_for(lambda l: (m := STEP.search(l)) and int(m.group(3)) / 1000 > killed and m, 180)
        return int(after.group(3)) / 1000 - killed if after else None
    finally:
        job.stop()


def find_shoal_worker(launcher_pid, exclude_first):
    """A worker of `shoal run` (its children, in start order), not the first one when asked."""
    out = subprocess.run(["pgrep", "-P", str(launcher_pid)], capture_output=True, text=True).stdout.split()
    pids = sorted(int(p) for p in out)
    workers = [p for p in pids if open(f"/proc/{p}/cmdline").read().split("\0")[0].endswith("bench/elastic")]
    return workers[1] if exclude_first and len(workers) > 1 else workers[0]


def measure_join(contender, build, work):
    checkpoint = os.path.join(work, f"{contender}-join.ckpt")
    if os.path.exists(checkpoint):
        os.remove(checkpoint)
    endpoint = f"127.0.0.1:{free_port()}"
    token = os.path.join(work, "join.token")
    if os.path.exists(token):
        os.remove(token)
    if contender.startswith("shoal"):
        job = Job(shoal_argv(build, 2, contender, ["--token-file", token]), os.path.join(work, "join.err"))
    else:
        job = Job(torchrun_argv(2, "1:2", endpoint, checkpoint, work, False), os.path.join(work, "join.err"))
    second = None
    try:
        if not job.wait_for(step_line(20), 180):
            return None
        started = time.time()
        if contender.startswith("shoal"):
            hint = open(os.path.join(work, "join.err")).read()
            flags = re.search(r"to add workers: shoal run (.+) PROGRAM", hint).group(1).split()
            second = Job([f"{build}/bin/shoal", "run", *flags, "-n", "1",
                          f"{build}/bench/elastic", "--steps", "100000"], os.path.join(work, "join2.err"))
        else:
            second = Job(torchrun_argv(1, "1:2", endpoint, checkpoint, work + "/second", False),
                         os.path.join(work, "join2.err"))
        after = job.wait_for(step_line(0, 3), 180)
        return int(after[2]) / 1000 - started if after else None
    finally:
        if second:
            second.stop()
        job.stop()


def commit_cost(build, work):
    rates = {}
    for every in (1, 0):
        out = subprocess.run([f"{build}/bin/shoal", "run", "--min", "2", "--max", "2", "-n", "2",
                              f"{build}/bench/elastic", "--steps", "40", "--commit-every", str(every)],
                             capture_output=True, text=True, timeout=600).stdout
        m = re.search(r"samples_per_s=([\d.]+)", out)
        rates[every] = float(m.group(1)) if m else None
    return rates


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), sys.argv[3])
        return
    build = sys.argv[1]
    rounds = int(os.environ.get("ROUNDS", "3"))
    contenders = [c for c in os.environ.get("CONTENDERS", "shoal,shoal-etcd,torchrun,torchrun-fixed").split(",")
                  if c and c != "none"]
    work = tempfile.mkdtemp(prefix="shoal-elastic-bench-")
    global ETCD
    etcd = None
    if "shoal-etcd" in contenders:
        etcd, ETCD = start_etcd(work)
    os.makedirs(os.path.join(work, "second"), exist_ok=True)
    kill = {c: [] for c in contenders}
    join = {c: [] for c in contenders if c != "torchrun-fixed"}
    cost = []
    for r in range(rounds):
        for c in contenders:
            t = measure_kill(c, build, work)
            kill[c].append(t)
            print(f"round={r} contender={c} kill_to_next_step_s={t}", flush=True)
            if c in join:
                t = measure_join(c, build, work)
                join[c].append(t)
                print(f"round={r} contender={c} join_to_first_step_s={t}", flush=True)
        rates = commit_cost(build, work)
        cost.append(rates)
        print(f"round={r} commit_every_step_samples_per_s={rates[1]} never_samples_per_s={rates[0]}", flush=True)

    def median(values):
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else float("nan")

    if contenders:
        print("\n| contender | kill -> next step (s), median | join -> first step with it (s), median |")
        print("|---|---|---|")
    for c in contenders:
        print(f"| {c} | {median(kill[c]):.2f} | {median(join[c]) if c in join else float('nan'):.2f} |")
    for c in contenders:
        if c.startswith("torchrun"):
            for ours in (x for x in contenders if x.startswith("shoal")):
                print(f"{c} / {ours}, kill: {median(kill[c]) / median(kill[ours]):.1f}x")
    if etcd:
        etcd.kill()
    ratios = [x[1] / x[0] for x in cost if x[0] and x[1]]
    print(f"commit every step / never (throughput): {statistics.median(ratios):.3f} (rounds: "
          + ", ".join(f"{r:.3f}" for r in ratios) + ")")


if __name__ == "__main__":
    main()
