#!/usr/bin/env python3
"""shoal's queue policy on Pollux's cluster simulator and workloads, beside Tiresias, Optimus and
Pollux (Qiao et al., OSDI'21).

Pollux's artifact publishes a cluster simulator (16 nodes of 4 GPUs, 60 s scheduling rounds), eight
160-job workloads derived from Microsoft's Philly trace at 0.5x-2.0x load, each model's measured
throughput and statistical efficiency, its Tiresias and Optimus policies, and the per-job results
of all three. This benchmark drives shoal::queue::plan() (through build/bench/queue_plan, the very
function the scheduler calls) from that simulator, after checking the harness: Tiresias and
Optimus, run here, must reproduce their published mean JCTs within 5%. Pollux's own policy needs
pymoo, which Debian lacks; its published results stand in.

The simulator is not part of shoal. Fetch it, pinned, and name its folder:

    git clone https://github.com/petuum/adaptdl /tmp/adaptdl
    git -C /tmp/adaptdl checkout c793c7089bd307462686339d29707925c461f9a9   # branch osdi21-artifact
    POLLUX_SIMULATOR=/tmp/adaptdl/simulator /usr/bin/python3 bench/pollux.py build

Without it the benchmark says so and exits 0. It needs Debian's python3-pandas and python3-scipy
(scripts/setup.sh installs them). Neither autograd nor pymoo is in Debian: pymoo is only imported,
never run (Pollux's policy), and autograd's one use, the gradient of the throughput model's
fitting objective (goodput.py's fit_perf_params), is replaced by central differences.

How shoal's jobs are submitted (docs/queue.md, "Pollux's workloads"): as Optimus+Oracle+TunedJobs
sees them, each with the workload's tuned global batch (BatchPolicy::global: the batch stays, so
does the statistical efficiency), --min 1 and --max the most workers that batch allows
(batch / the model's smallest local batch, at most the cluster's 64), or with --max tuned the
workload's tuned worker count (what Tiresias runs each job at); all of one priority. plan()
sees the samples per second each job ran at, at each worker count, as the scheduler measures them.
Under shoal-goodput-batch the jobs are submitted as Pollux's are instead (no tuned batch: each
starts at its model's base batch) under BatchPolicy::goodput(): each picks its own batch and
gradient accumulation for its world with shoal::best_batch() (shoal/dp/goodput.h, through
queue_plan's "choose" request), from the steps it timed and the noise it measured, and plan() weighs
it by the same function. Every change of a job's allocation pauses it for the simulator's 30 s (as
for every policy), unless --resize-cost says otherwise for shoal's.

    /usr/bin/python3 bench/pollux.py build [--loads 0.5,1.0,1.5,2.0] [--policies ...] [--jobs 2]
                                           [--max bound|tuned] [--resize-cost 30] [--min-gain G]
"""
import argparse
import collections
import hashlib
import json
import math
import multiprocessing
import os
import subprocess
import sys
import time
import types

PINNED = "c793c7089bd307462686339d29707925c461f9a9"
# sha256 over the simulator folder of that commit (see digest()); another copy is refused.
DIGEST = "f5e9aa156daf0b9399e5b49b3880769ae5423ebf10363d1b2ee078b5915cecd0"
LOADS = {"0.5": "workloads-0.5", "1.0": "workloads", "1.5": "workloads-1.5", "2.0": "workloads-2.0"}
SIMULATED = ("tiresias", "optimus")  # run here, and checked against the published results
SHOAL = ("shoal-priority", "shoal-goodput", "shoal-goodput-batch")
PUBLISHED = ("tiresias", "optimus", "pollux")


def digest(folder):
    hasher = hashlib.sha256()
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            path = os.path.join(root, name)
            hasher.update(os.path.relpath(path, folder).encode() + b"\0")
            with open(path, "rb") as f:
                hasher.update(f.read())
    return hasher.hexdigest()


def install_stand_ins():
    """Modules the simulator imports that Debian does not have (see the docstring)."""
    try:
        import autograd  # noqa: F401
    except ImportError:
        import numpy
        autograd = types.ModuleType("autograd")
        autograd.numpy = numpy

        def grad(function):
            def gradient(params, *args):
                params = numpy.asarray(params, dtype=float)
                result = numpy.zeros_like(params)
                for i in range(len(params)):
                    step = 1e-6 * max(1.0, abs(params[i]))
                    up, down = params.copy(), params.copy()
                    up[i] += step
                    down[i] -= step
                    result[i] = (function(up, *args) - function(down, *args)) / (2 * step)
                return result
            return gradient
        autograd.grad = grad
        sys.modules["autograd"] = autograd
    try:
        import pymoo  # noqa: F401
    except ImportError:
        class Anything(types.ModuleType):
            def __getattr__(self, name):
                return type(name, (), {})
        for name in ("pymoo", "pymoo.model", "pymoo.model.crossover", "pymoo.model.mutation",
                     "pymoo.model.problem", "pymoo.model.repair", "pymoo.optimize",
                     "pymoo.algorithms", "pymoo.algorithms.nsga2", "pymoo.operators",
                     "pymoo.operators.crossover", "pymoo.operators.crossover.util", "pymoo.util",
                     "pymoo.util.nds", "pymoo.util.nds.non_dominated_sorting"):
            sys.modules[name] = Anything(name)
            if "." in name:
                parent, _, child = name.rpartition(".")
                setattr(sys.modules[parent], child, sys.modules[name])


def reuse_interpolators(applications):
    """The simulator interpolates a placement it has no trace of over all of an application's
    traces, building a new LinearNDInterpolator (a Delaunay triangulation, 0.15 s) at every such
    call, though the traces never change: jobs whose batch follows their world ask for hundreds of
    (placement, batch) pairs. The same interpolator is kept per set of points instead: every value
    is what the simulator computes, only sooner."""
    import numpy
    built = {}
    original = applications.LinearNDInterpolator

    def interpolator(points, values):
        points, values = numpy.ascontiguousarray(points), numpy.ascontiguousarray(values)
        key = (points.shape, points.tobytes(), values.shape, values.tobytes())
        if key not in built:
            built[key] = original(points, values)
        return built[key]
    applications.LinearNDInterpolator = interpolator


def shoal_policy_class(optimus_policy):
    """plan() as a policy of the simulator. It derives from Optimus's only so that the simulator
    submits its jobs as Optimus's (tuned batch, worker count free): optimize() is plan()'s."""

    class ShoalPolicy(optimus_policy):
        def __init__(self, queue_plan, kind, tuned=None, adaptive=False, options=None):
            super().__init__()
            self.options = options or {}  # PolicyOptions given on the command line
            self.kind = kind
            self.tuned = tuned  # job name -> --max, instead of the batch's bound
            self.adaptive = adaptive  # jobs under BatchPolicy::goodput() (but ncf, as Pollux's)
            self.steps = collections.defaultdict(dict)  # job -> {(workers, local batch): s}
            self.noise = {}  # job name -> the noise scale it measured, in samples
            self.cluster = None
            self.process = subprocess.Popen([queue_plan], stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE, text=True)
            self.ids = {}  # job name -> id in plan()'s snapshots
            self.workers = collections.defaultdict(list)  # job name -> [(worker id, node)]
            self.running = set()
            self.last_resize = {}
            self.resizes = collections.Counter()  # job -> resizes and preemptions so far
            self.throughput = collections.defaultdict(dict)  # job -> {workers: samples/s}
            self.idle_since = None  # None: +inf
            self.next_worker = 1
            self.plan_calls = 0
            self.plan_seconds = 0.0

        def measure(self):
            """Samples per second each job trained at in the round that just ended, at its worker
            count, as the scheduler measures them from the jobs' progress (docs/queue.md)."""
            for job in self.cluster.jobs:
                placement = tuple(filter(None, job.placement))
                if not placement or job.rescale_time > 0 or job.completion_time is not None:
                    continue
                step_time, sync_time = job.application.get_throughput(placement, job.atomic_bsz)
                batch = sum(placement) * job.atomic_bsz * (job.accum_steps + 1)
                seconds = step_time + (step_time - sync_time) * job.accum_steps
                self.throughput[job.name][sum(placement)] = batch / seconds

        def limits(self, job):
            """BatchPolicy::goodput()'s limits for a job of the workload: from the base batch the
            application starts at (its smallest validated) to its largest, each backward's batch
            within what the application was measured at, and as many backward passes a step as
            its largest batch needs on one worker (Pollux's jobs accumulate without a bound)."""
            app = job.application
            return {"base": int(app.init_batch_size), "max": int(app.max_batch_size),
                    "min_local": int(app.min_local_bsz), "max_local": int(app.max_local_bsz),
                    "max_accumulation": max(1, math.ceil(app.max_batch_size / app.max_local_bsz))}

        def adapts(self, job):
            return self.adaptive and job.target_batch_size is None

        def record(self, job, num_replicas, local_bsz, passes, seconds, grad_sqr, grad_var):
            """What a job under BatchPolicy::goodput() measures as it trains: each step's time
            at its world, batch and backward passes, and the gradient noise scale (Pollux's
            simulator keeps the noise per base batch: var / sqr base batches)."""
            self.steps[job.name][(num_replicas, local_bsz, passes)] = seconds
            if grad_sqr > 0:
                self.noise[job.name] = grad_var / grad_sqr * job.application.init_batch_size

        def steps_of(self, name):
            return [[w, m, t, k] for (w, m, k), t in sorted(self.steps[name].items())]

        def choose(self, job, num_replicas):
            """The job's own pick of its batch on `num_replicas` workers: shoal::best_batch(),
            as (batch per backward, backward passes)."""
            choice = self.call_plan({"choose": {
                "world": num_replicas, "batch": self.limits(job), "steps": self.steps_of(job.name),
                "noise_scale": self.noise.get(job.name, 0)}}, count=False)
            return choice["local_batch"], choice["accumulation"]

        def snapshot(self, jobs, nodes, now):
            views = []
            for name, job in jobs.items():
                job_id = self.ids.setdefault(name, len(self.ids) + 1)
                extra = {}
                if self.adapts(self.cluster_jobs[name]):
                    extra = {"batch": self.limits(self.cluster_jobs[name]),
                             "steps": self.steps_of(name), "noise_scale": self.noise.get(name, 0)}
                views.append(dict(extra, **{
                    "id": job_id, "min": 1,
                    "max": min(self.tuned[name] if self.tuned else job.max_replicas, len(nodes) * 4),
                    "preemptible": True, "submitted": job.creation_timestamp,
                    "running": name in self.running, "last_resize": self.last_resize.get(name),
                    "resizes": self.resizes[name],
                    "workers": [{"id": w, "host": "h%d" % node} for w, node in self.workers[name]],
                    "throughput": {str(k): v for k, v in self.throughput[name].items()},
                }))
            return {"now": now, "idle_since": self.idle_since, "policy": self.kind,
                    # The simulator's rounds (60 s) already wait longer than the scheduler's 5 s
                    # before idle capacity goes to running jobs.
                    "options": dict({"grow_idle": 0}, **self.options),
                    "hosts": [{"name": "h%d" % node, "capacity": int(info.resources["nvidia.com/gpu"])}
                              for node, info in nodes.items()],
                    "jobs": views}

        def call_plan(self, snapshot, count=True):
            started = time.perf_counter()
            self.process.stdin.write(json.dumps(snapshot) + "\n")
            self.process.stdin.flush()
            line = self.process.stdout.readline()
            if count:
                self.plan_seconds += time.perf_counter() - started
                self.plan_calls += 1
            if not line:
                raise RuntimeError("queue_plan ended without a plan (its error is above)")
            return json.loads(line)

        def optimize(self, jobs, nodes, prev_allocations, node_template):
            now = self.cluster.current_time
            self.measure()
            for name in list(self.workers):
                if name not in jobs:  # finished
                    del self.workers[name]
                    self.running.discard(name)
            by_id = {}
            # The scheduler plans again at once after every change; the simulator only every round:
            # plan until nothing changes. Leaving workers are gone by the next round.
            for _ in range(1000):
                plan = self.call_plan(self.snapshot(jobs, nodes, now))
                if not by_id:
                    by_id = {job_id: name for name, job_id in self.ids.items()}
                for action in plan["actions"]:
                    name = by_id[action["job"]]
                    kind = action["kind"]
                    if kind in ("start", "grow"):
                        for host in action["hosts"]:
                            self.workers[name].append((self.next_worker, int(host[1:])))
                            self.next_worker += 1
                        self.running.add(name)
                    elif kind in ("shrink", "preempt"):
                        gone = set(action["workers"])
                        self.workers[name] = [w for w in self.workers[name] if w[0] not in gone]
                        if kind == "preempt":
                            self.running.discard(name)
                    else:
                        raise RuntimeError("plan() asked to %s, which no worker here needs" % kind)
                    if kind != "start":  # as the scheduler's apply(): a start is no resize
                        self.last_resize[name] = now
                        self.resizes[name] += 1
                if plan["free_after"] > 0:
                    if self.idle_since is None:
                        self.idle_since = now
                else:
                    self.idle_since = None
                if not plan["actions"]:
                    break
            else:
                raise RuntimeError("plan() kept changing the allocation at t=%s s" % now)
            allocations = {name: sorted(node for _, node in self.workers[name])
                           for name in self.running if self.workers[name]}
            return allocations, len(nodes)

        def close(self):
            self.process.stdin.close()
            self.process.wait(timeout=10)

    return ShoalPolicy


def adapt_jobs(simulator, cluster, policy):
    """Submits the workload's jobs as Pollux's are submitted (no tuned batch: each starts at its
    application's base batch; ncf at 32768, fixed), under BatchPolicy::goodput(): at every change
    of its world, and as it trains, each job picks its batch by shoal::best_batch() from the steps
    and the noise it measured, through queue_plan. Its --max is the most workers its largest batch
    allows (at most the cluster's 64)."""
    for job in cluster.jobs:
        job.target_batch_size = 32768 if job.application.name == "ncf" else None
        if job.target_batch_size is not None:
            continue

        def update_local_bsz(job, placement):
            workers = sum(filter(None, placement))
            job.atomic_bsz, passes = policy.choose(job, workers)
            job.accum_steps = passes - 1

        def update_params(job, num_nodes, num_replicas, local_bsz, step_time, sync_time,
                          grad_sqr, grad_var):
            # A step as Job.step() times it: the accumulating passes without the exchange.
            job.grad_params = (grad_sqr, grad_var)
            seconds = step_time + (step_time - sync_time) * job.accum_steps
            policy.record(job, num_replicas, local_bsz, job.accum_steps + 1, seconds, grad_sqr,
                          grad_var)
        job.update_local_bsz = types.MethodType(update_local_bsz, job)
        job.update_params = types.MethodType(update_params, job)
    tuned_info = cluster.get_optimus_job_info

    def job_info(job):
        if job.target_batch_size is not None:
            return tuned_info(job)
        info = cluster.get_pollux_job_info(job)
        app = job.application
        info.max_replicas = min(app.max_batch_size // app.min_local_bsz, 64)
        return info
    cluster.get_optimus_job_info = job_info


def run_one(keyed):
    """One workload under one policy; returns its key, {job name: JCT} and plan()'s cost."""
    key, (simulator_dir, workload, policy_name, queue_plan, resize_cost, max_from, options) = keyed
    install_stand_ins()
    sys.path.insert(0, simulator_dir)
    import contextlib
    import io
    import warnings
    # The simulator's fit of its throughput model tries parameters where a log is undefined, and
    # its pandas calls are deprecated.
    warnings.filterwarnings("ignore")
    import pandas
    import applications
    reuse_interpolators(applications)
    import simulator
    frame = pandas.read_csv(workload)
    clock = {}
    if policy_name == "tiresias":
        policy = simulator.TiresiasPolicy(lambda: clock["cluster"].current_time)
    elif policy_name == "optimus":
        policy = simulator.OptimusPolicy()
    else:
        tuned = dict(zip(frame["name"], frame["num_replicas"])) if max_from == "tuned" else None
        policy = shoal_policy_class(simulator.OptimusPolicy)(
            queue_plan, policy_name.split("-")[1], tuned, adaptive=policy_name.endswith("-batch"),
            options=options)
    cluster = simulator.Cluster(frame, policy, 16, num_gpus=4)
    clock["cluster"] = cluster
    if policy_name in SHOAL:
        policy.cluster = cluster
        policy.cluster_jobs = {job.name: job for job in cluster.jobs}
        if policy.adaptive:
            adapt_jobs(simulator, cluster, policy)
        if resize_cost != 30:
            original = simulator.Job.reallocate

            def reallocate(job, placement):
                original(job, placement)
                if placement:
                    job.rescale_time = resize_cost
            for job in cluster.jobs:
                job.reallocate = types.MethodType(reallocate, job)
    started = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):  # the simulator prints every round
        while not cluster.all_complete():
            cluster.step(60)
    result = {"jcts": cluster.get_jcts(), "seconds": time.perf_counter() - started}
    if policy_name in SHOAL:
        result["plan_calls"] = policy.plan_calls
        result["plan_seconds"] = policy.plan_seconds
        policy.close()
    return key, result


def submissions(workload):
    import pandas
    frame = pandas.read_csv(workload)
    return dict(zip(frame["name"], frame["time"]))


def measures(runs, submitted):
    """Mean JCT (the mean of the workloads' means, as Pollux's summary.json), p99 JCT over every
    job of every workload, and makespan (first submission to last completion, mean over workloads)."""
    means, everything, spans = [], [], []
    for workload, jcts in runs.items():
        means.append(sum(jcts.values()) / len(jcts))
        everything.extend(jcts.values())
        times = submitted[workload]
        spans.append(max(times[name] + jct for name, jct in jcts.items()) - min(times.values()))
    everything.sort()
    p99 = everything[min(len(everything) - 1, math.ceil(0.99 * len(everything)) - 1)]
    return {"mean": sum(means) / len(means), "p99": p99, "makespan": sum(spans) / len(spans)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("build", help="shoal's build folder (holds bench/queue_plan)")
    parser.add_argument("--simulator", default=os.environ.get("POLLUX_SIMULATOR", ""),
                        help="Pollux's simulator/ folder (default: $POLLUX_SIMULATOR)")
    parser.add_argument("--loads", default=",".join(LOADS))
    parser.add_argument("--policies", default=",".join(SIMULATED + SHOAL))
    parser.add_argument("--workloads", default="1,2,3,4,5,6,7,8")
    parser.add_argument("--jobs", type=int, default=2, help="simulations run at once")
    parser.add_argument("--resize-cost", type=float, default=30,
                        help="seconds a change of allocation pauses a job under shoal's policies "
                             "(the simulator's 30 s for every policy by default)")
    parser.add_argument("--max", dest="max_from", choices=("bound", "tuned"), default="bound",
                        help="each shoal job's --max: the most workers its batch allows (as "
                             "Optimus), or the workload's tuned worker count (what Tiresias runs)")
    parser.add_argument("--min-gain", type=float,
                        help="PolicyOptions::min_gain for shoal's policies (default: plan()'s)")
    parser.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                        help="another PolicyOptions field for shoal's policies (cooldown, "
                             "fair_share, overhead_prior, ...), as bench/queue_plan reads it")
    parser.add_argument("--charge-resizes", action="store_true",
                        help="tell shoal's goodput policy what a resize costs (--resize-cost as "
                             "PolicyOptions::resize_cost, as Pollux's policy knows its 30 s)")
    parser.add_argument("--json", help="also write every JCT here")
    args = parser.parse_args()

    folder = args.simulator
    if not folder or not os.path.isfile(os.path.join(folder, "simulator.py")):
        print("pollux: skipped: no Pollux simulator (set POLLUX_SIMULATOR; bench/pollux.py says how "
              "to fetch it)")
        return 0
    folder = os.path.abspath(folder)
    found = digest(folder)
    if found != DIGEST:
        sys.exit("pollux: %s is not the pinned simulator (adaptdl %s): sha256 %s, expected %s"
                 % (folder, PINNED[:12], found, DIGEST))
    queue_plan = os.path.join(os.path.abspath(args.build), "bench", "queue_plan")
    policies = args.policies.split(",")
    for name in policies:
        if name not in SIMULATED + SHOAL:
            sys.exit("pollux: unknown policy %r; expected some of %s" % (name, ", ".join(SIMULATED + SHOAL)))
    if any(p in SHOAL for p in policies) and not os.access(queue_plan, os.X_OK):
        sys.exit("pollux: %s is missing; build it with `cmake --build %s --target queue_plan`"
                 % (queue_plan, args.build))
    loads = args.loads.split(",")
    for load in loads:
        if load not in LOADS:
            sys.exit("pollux: load %r has no workloads; expected some of %s" % (load, ", ".join(LOADS)))
    names = ["workload-%s" % n for n in args.workloads.split(",")]

    tasks, keys = [], []
    for load in loads:
        for policy in sorted(policies, key=lambda p: p not in SHOAL):  # shoal's first
            for name in names:
                workload = os.path.join(folder, LOADS[load], name + ".csv")
                options = {} if args.min_gain is None else {"min_gain": args.min_gain}
                if args.charge_resizes:
                    options["resize_cost"] = args.resize_cost
                for given in args.option:
                    field, _, value = given.partition("=")
                    options[field] = float(value)
                tasks.append((folder, workload, policy, queue_plan, args.resize_cost, args.max_from,
                              options))
                keys.append((load, policy, name))
    started = time.time()
    results = {}
    with multiprocessing.Pool(args.jobs) as pool:
        for key, result in pool.imap_unordered(run_one, list(zip(keys, tasks))):
            results[key] = result
            print("pollux: %d/%d: %s at %sx, %s: mean JCT %.0f s (%.0f s to simulate)" % (
                len(results), len(tasks), key[1], key[0], key[2],
                sum(result["jcts"].values()) / max(1, len(result["jcts"])), result["seconds"]),
                flush=True)

    submitted = {load: {name: submissions(os.path.join(folder, LOADS[load], name + ".csv"))
                        for name in names} for load in loads}
    table, failed = [], False
    for load in loads:
        published = {}
        for policy in PUBLISHED:
            with open(os.path.join(folder, "results-jobload", "%s-%s" % (policy, load),
                                   "summary.json")) as f:
                summary = json.load(f)
            published[policy] = measures({n: summary["jcts"][n] for n in names}, submitted[load])
        rows = {"%s (published)" % p: m for p, m in published.items()}
        for policy in policies:
            runs = {name: results[(load, policy, name)]["jcts"] for name in names}
            incomplete = [n for n in names if len(runs[n]) != len(submitted[load][n])]
            if incomplete:
                sys.exit("pollux: %s at %sx left jobs unfinished in %s" % (policy, load, incomplete))
            rows[policy] = measures(runs, submitted[load])
        print("\nload %sx (%d workloads of 160 jobs; 16 nodes x 4 GPUs; JCT in s; shoal's jobs: "
              "--max %s, a resize pauses %g s%s%s%s)" % (
                  load, len(names), args.max_from, args.resize_cost,
                  "" if args.min_gain is None else ", min_gain %g" % args.min_gain,
                  ", charged to plan()" if args.charge_resizes else "",
                  "".join(", " + o for o in args.option)))
        print("%-24s %10s %10s %10s %12s %12s" % ("policy", "mean JCT", "p99 JCT", "makespan",
                                                  "/tiresias", "/pollux"))
        for policy, m in rows.items():
            print("%-24s %10.0f %10.0f %10.0f %12.3f %12.3f" % (
                policy, m["mean"], m["p99"], m["makespan"],
                m["mean"] / published["tiresias"]["mean"], m["mean"] / published["pollux"]["mean"]))
        for policy in SIMULATED:
            if policy in policies:
                ratio = rows[policy]["mean"] / published[policy]["mean"]
                verdict = "ok" if abs(ratio - 1) <= 0.05 else "OUTSIDE 5%"
                failed |= verdict != "ok"
                print("harness check: %s here / published = %.4f (%s)" % (policy, ratio, verdict))
        for policy in policies:
            if policy in SHOAL:
                calls = sum(results[(load, policy, n)]["plan_calls"] for n in names)
                seconds = sum(results[(load, policy, n)]["plan_seconds"] for n in names)
                print("%s: %d plan() calls, %.2f ms each with the JSON round trip" % (
                    policy, calls, 1e3 * seconds / max(calls, 1)))
        table.append({"load": load, "rows": rows})
    print("\n%d simulations in %.0f s" % (len(tasks), time.time() - started))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"table": table, "jcts": {"|".join(k): v["jcts"] for k, v in results.items()}},
                      f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
