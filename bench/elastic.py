"""Elastic recovery, shoal beside torchrun's elastic agent (bench/RESULTS.md, section "elastic").

    [ROUNDS=3] [CONTENDERS=shoal,shoal-etcd,shoal-python,torchrun,torchrun-tuned,torchrun-fixed] [RAW=FILE] \
        /usr/bin/python3 bench/elastic.py BUILD_DIR

For each round and contender, on the MLP of bench/ddp (784-2048-2048-10, batch 64 per worker,
one thread per worker, SGD with momentum, a commit or checkpoint after every step):
  kill: 3 workers; after step 20, SIGKILL one (not the first); time from the kill to the first
        step taken by the new, smaller world of 2 (a step of the old world that completes after
        the kill does not count).
  join: 2 workers; after step 20 a third is added (shoal: `shoal run --join`; torchrun: a second
        agent on the same rendezvous); time from starting it to the first step of a world of 3.
Contenders:
  shoal           gossip membership, one `shoal run --min 1 --max 3 -n 3`; kill: one worker.
  shoal-etcd      the same with `--rendezvous etcd://...`, on an etcd server this script starts
                  (Debian's etcd-server, one member on 127.0.0.1, its data in a temporary directory).
  shoal-python    shoal with the program in Python (bench/elastic_python.py: shoal.elastic over
                  the same C++ core, the package from BUILD_DIR/python, Debian's /usr/bin/python3).
  torchrun        torchrun's defaults for an elastic job: c10d rendezvous, `--nnodes=1:3`. A world
                  only shrinks when an agent is lost (a lost worker is restarted by its agent, the
                  world keeps its size), so the kill runs 3 agents of one worker each and SIGKILLs
                  one agent with its worker: a node lost.
  torchrun-tuned  the same, tuned for recovery: `--rdzv_conf=last_call_timeout=1` (the smallest the
                  c10d rendezvous accepts: whole seconds, positive) and `--monitor_interval=0.1`.
  torchrun-fixed  `--nnodes=1`, one agent of 3 workers, `--monitor_interval=0.1`: restarts only,
                  no membership changes. Its world never shrinks: the kill counts the first step of
                  the restarted world of 3 (a worker with TORCHELASTIC_RESTART_COUNT >= 1). No join.
Contenders take turns in an order that rotates from round to round. (CONTENDERS=none measures
only the commit cost.) Then the cost of commit() every step against never, in a static-size
elastic job of 2 workers (`--min 2 --max 2`), for the same MLP; the two alternate in order too.
Every result line also goes to RAW (default bench/results/elastic-DATE.txt, kept in the
repository beside RESULTS.md).

    /usr/bin/python3 bench/elastic.py --worker STEPS CHECKPOINT

is the torchrun worker: PyTorch DDP (gloo), the same model, torch.save of model and optimizer
after every step (to CHECKPOINT, by rank 0, through a temporary file and a rename), loaded at
start when it exists; prints "step S world W restart R t=MS" like bench/elastic.cpp (which has
no restart field).
"""

import datetime
import os
import queue
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

STEP = re.compile(r"step (\d+) world (\d+)(?: restart (\d+))? t=(\d+)")
PID = re.compile(r"pid=(\d+) rank=(\d+)")
HERE = os.path.dirname(os.path.abspath(__file__))


def worker(steps, checkpoint):
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
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
            print(f"step {step} world {world} restart {restart} t={int(time.time() * 1000)}", flush=True)
    dist.destroy_process_group()


class Jobs:
    """Launcher processes whose stdout lines are read, as they come, into one queue (stderr goes
    to a file each). A torchrun job of several agents prints its steps through whichever agent
    hosts rank 0, which can change when the world changes."""

    def __init__(self):
        self.processes = []
        self.lines = queue.Queue()
        self.seen = []  # (job index, line), in arrival order

    def start(self, argv, log):
        process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=open(log, "w"), text=True,
                                   start_new_session=True)
        index = len(self.processes)
        self.processes.append(process)
        threading.Thread(target=self._read, args=(index, process), daemon=True).start()
        return index

    def _read(self, index, process):
        for line in process.stdout:
            self.lines.put((index, line))
        self.lines.put((index, None))

    def wait_for(self, predicate, timeout):
        """The first non-None predicate(line) among lines still to come, or None at the deadline
        or once every launcher has ended."""
        deadline = time.time() + timeout
        ended = set()
        while time.time() < deadline and len(ended) < len(self.processes):
            try:
                index, line = self.lines.get(timeout=max(0.0, min(1.0, deadline - time.time())))
            except queue.Empty:
                continue
            if line is None:
                ended.add(index)
                continue
            self.seen.append((index, line))
            found = predicate(line)
            if found:
                return found
        return None

    def pids(self):
        """{rank: (job index, worker pid)} of the workers that said so, the latest per rank."""
        return {int(m.group(2)): (i, int(m.group(1))) for i, l in self.seen for m in [PID.search(l)] if m}

    def kill(self, index):
        """SIGKILLs a launcher and every process of its session (its workers): a node lost."""
        os.killpg(self.processes[index].pid, signal.SIGKILL)

    def stop(self):
        for process in self.processes:
            try:
                os.killpg(process.pid, signal.SIGTERM)
                process.wait(15)
            except ProcessLookupError:
                pass
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def step_line(min_step=0, world=None, after=0.0, min_restart=None):
    """Matches a step line: at least min_step, of a world of `world` workers, completed after the
    time `after` (seconds since the epoch), by workers restarted at least min_restart times.
    Returns (step, world, completed at)."""
    def predicate(line):
        m = STEP.search(line)
        if not m:
            return None
        step, size, restart, at = int(m.group(1)), int(m.group(2)), m.group(3), int(m.group(4)) / 1000
        if step < min_step or (world is not None and size != world) or at <= after:
            return None
        if min_restart is not None and (restart is None or int(restart) < min_restart):
            return None
        return step, size, at
    return predicate


ETCD = None  # "HOST:PORT" of the etcd server that main() starts for shoal-etcd


def program(build, contender):
    """The worker program's argv for a shoal contender."""
    if contender == "shoal-python":
        return ["/usr/bin/python3", os.path.join(HERE, "elastic_python.py"), "--steps", "100000"]
    return [f"{build}/bench/elastic", "--steps", "100000"]


def shoal_argv(build, n, contender, extra=()):
    if contender == "shoal-etcd":
        extra = ["--rendezvous", f"etcd://{ETCD}", *extra]
    return [f"{build}/bin/shoal", "run", "--min", "1", "--max", "3", "-n", str(n), *extra, *program(build, contender)]


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


def torchrun_argv(contender, n, nnodes, endpoint, checkpoint, logdir, is_host=None):
    """torchrun with one agent of n workers. FINDINGS: Debian 12's torchrun needs --redirects,
    --tee and --log_dir to start at all. is_host: whether this agent hosts the c10d rendezvous's
    store (None: torchrun decides; on one machine the first agent to bind the port hosts it)."""
    os.makedirs(logdir, exist_ok=True)
    argv = ["/usr/bin/python3", "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc_per_node={n}",
            "--max_restarts=5", "--redirects=2", "--tee=1", f"--log_dir={logdir}",
            "--rdzv_backend=c10d", f"--rdzv_endpoint={endpoint}"]
    conf = [] if is_host is None else [f"is_host={int(is_host)}"]
    if contender == "torchrun-tuned":
        conf.append("last_call_timeout=1")
        argv += ["--monitor_interval=0.1"]
    elif contender == "torchrun-fixed":
        argv += ["--monitor_interval=0.1"]
    if conf:
        argv.append("--rdzv_conf=" + ",".join(conf))
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
    jobs = Jobs()
    try:
        if contender.startswith("shoal"):
            jobs.start(shoal_argv(build, 3, contender), os.path.join(work, "kill.err"))
        elif contender == "torchrun-fixed":
            jobs.start(torchrun_argv(contender, 3, "1", f"127.0.0.1:{free_port()}", checkpoint,
                                     os.path.join(work, "kill-logs")), os.path.join(work, "kill.err"))
        else:
            endpoint = f"127.0.0.1:{free_port()}"
            # Agent 0 hosts the rendezvous's store, which the job cannot lose (the victim is another).
            for a in range(3):
                jobs.start(torchrun_argv(contender, 1, "1:3", endpoint, checkpoint, os.path.join(work, f"kill-logs{a}"),
                                         is_host=a == 0), os.path.join(work, f"kill{a}.err"))
        if not jobs.wait_for(step_line(20, 3), 180):
            return None
        if contender.startswith("shoal"):
            victim = find_shoal_worker(jobs.processes[0].pid, exclude_first=True)
            killed = time.time()
            os.kill(victim, signal.SIGKILL)
        elif contender == "torchrun-fixed":
            victim = jobs.pids()[1][1]
            killed = time.time()
            os.kill(victim, signal.SIGKILL)
        else:
            # A node lost: an agent, with its worker, that neither hosts the store nor runs rank 0.
            agent = next(i for i in (2, 1) if i != jobs.pids()[0][0])
            killed = time.time()
            jobs.kill(agent)
        if contender == "torchrun-fixed":
            after = jobs.wait_for(step_line(0, 3, killed, min_restart=1), 180)
        else:
            after = jobs.wait_for(step_line(0, 2, killed), 180)
        return after[2] - killed if after else None
    finally:
        jobs.stop()


def find_shoal_worker(launcher_pid, exclude_first):
    """A worker of `shoal run` (its children, in start order), not the first one when asked."""
    out = subprocess.run(["pgrep", "-P", str(launcher_pid)], capture_output=True, text=True).stdout.split()
    pids = sorted(int(p) for p in out)
    workers = [p for p in pids if any(a.endswith(("bench/elastic", "bench/elastic_python.py"))
                                      for a in open(f"/proc/{p}/cmdline").read().split("\0")[:2])]
    return workers[1] if exclude_first and len(workers) > 1 else workers[0]


def measure_join(contender, build, work):
    checkpoint = os.path.join(work, f"{contender}-join.ckpt")
    if os.path.exists(checkpoint):
        os.remove(checkpoint)
    endpoint = f"127.0.0.1:{free_port()}"
    token = os.path.join(work, "join.token")
    if os.path.exists(token):
        os.remove(token)
    jobs = Jobs()
    try:
        if contender.startswith("shoal"):
            jobs.start(shoal_argv(build, 2, contender, ["--token-file", token]), os.path.join(work, "join.err"))
        else:
            jobs.start(torchrun_argv(contender, 2, "1:2", endpoint, checkpoint, os.path.join(work, "join-logs")),
                       os.path.join(work, "join.err"))
        if not jobs.wait_for(step_line(20, 2), 180):
            return None
        started = time.time()
        if contender.startswith("shoal"):
            hint = open(os.path.join(work, "join.err")).read()
            flags = re.search(r"to add workers: shoal run (.+) PROGRAM", hint).group(1).split()
            jobs.start([f"{build}/bin/shoal", "run", *flags, "-n", "1", *program(build, contender)],
                       os.path.join(work, "join2.err"))
        else:
            jobs.start(torchrun_argv(contender, 1, "1:2", endpoint, checkpoint, os.path.join(work, "join-logs2")),
                       os.path.join(work, "join2.err"))
        after = jobs.wait_for(step_line(0, 3, started), 180)
        return after[2] - started if after else None
    finally:
        jobs.stop()


def commit_cost(build, r):
    rates = {}
    for every in ((1, 0) if r % 2 == 0 else (0, 1)):
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
    if len(sys.argv) != 2:
        sys.exit("usage: /usr/bin/python3 bench/elastic.py BUILD_DIR")
    build = sys.argv[1]
    rounds = int(os.environ.get("ROUNDS", "3"))
    known = ("shoal", "shoal-etcd", "shoal-python", "torchrun", "torchrun-tuned", "torchrun-fixed")
    contenders = [c for c in os.environ.get("CONTENDERS", ",".join(known)).split(",") if c and c != "none"]
    for c in contenders:
        if c not in known:
            sys.exit(f"elastic.py: unknown contender '{c}'; expected some of {','.join(known)} or none")
    if "shoal-python" in contenders:
        os.environ["PYTHONPATH"] = os.path.join(build, "python")  # the package shoal of BUILD_DIR
    stamp = datetime.datetime.utcnow().strftime("%Y%m%dT%H%MZ")
    raw_path = os.environ.get("RAW", os.path.join(HERE, "results", f"elastic-{stamp}.txt"))
    os.makedirs(os.path.dirname(raw_path), exist_ok=True)
    raw = open(raw_path, "w")

    def emit(line):
        print(line, flush=True)
        raw.write(line + "\n")
        raw.flush()

    emit(f"# bench/elastic.py raw lines; date: {datetime.datetime.utcnow():%Y-%m-%d %H:%M} UTC; cores: "
         f"{os.cpu_count()}; load before: {' '.join(open('/proc/loadavg').read().split()[:3])}")
    emit(f"# ROUNDS={rounds} CONTENDERS={','.join(contenders) or 'none'}")
    work = tempfile.mkdtemp(prefix="shoal-elastic-bench-")
    global ETCD
    etcd = None
    if "shoal-etcd" in contenders:
        etcd, ETCD = start_etcd(work)
    kill = {c: [] for c in contenders}
    join = {c: [] for c in contenders if c != "torchrun-fixed"}
    cost = []
    for r in range(rounds):
        order = contenders[r % len(contenders):] + contenders[:r % len(contenders)] if contenders else []
        for c in order:
            t = measure_kill(c, build, work)
            kill[c].append(t)
            emit(f"round={r} contender={c} kill_to_next_step_s={t}")
            if c in join:
                t = measure_join(c, build, work)
                join[c].append(t)
                emit(f"round={r} contender={c} join_to_first_step_s={t}")
        rates = commit_cost(build, r)
        cost.append(rates)
        emit(f"round={r} commit_every_step_samples_per_s={rates[1]} never_samples_per_s={rates[0]}")
    emit(f"# load after: {' '.join(open('/proc/loadavg').read().split()[:3])}")

    def median(values):
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else float("nan")

    shown = os.path.relpath(os.path.abspath(raw_path), os.path.dirname(HERE))
    print(f"\nraw lines: {raw_path if shown.startswith('..') else shown}")
    if contenders:
        print("\n| contender | kill -> first step of the new world (s), median | runs | "
              "join -> first step with it (s), median | runs |")
        print("|---|---:|---|---:|---|")
    fmt = lambda values: ", ".join("failed" if v is None else f"{v:.2f}" for v in values)
    for c in contenders:
        print(f"| {c} | {median(kill[c]):.2f} | {fmt(kill[c])} | "
              + (f"{median(join[c]):.2f} | {fmt(join[c])} |" if c in join else "– | – |"))
    for c in contenders:
        if c.startswith("torchrun"):
            for ours in (x for x in contenders if x.startswith("shoal")):
                print(f"{c} / {ours}, kill: {median(kill[c]) / median(kill[ours]):.1f}x"
                      + (f", join: {median(join[c]) / median(join[ours]):.1f}x" if c in join else ""))
    if etcd:
        etcd.kill()
    ratios = [x[1] / x[0] for x in cost if x[0] and x[1]]
    if ratios:
        print(f"commit every step / never (throughput): {statistics.median(ratios):.3f} (rounds: "
              + ", ".join(f"{r:.3f}" for r in ratios) + ")")


if __name__ == "__main__":
    main()
