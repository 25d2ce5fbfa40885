"""PyTorch's own parameter server (torch.distributed.rpc) on bench/ddp's MLP, for bench/ps.sh.

    /usr/bin/python3 bench/ps_torch_rpc.py --variant tutorial|careful [--mode sync|async]
        [--workers 2] [--servers 1] [--batch 64] [--warmup 3] [--steps 10] [--port 29700]

starts S servers and W trainers as processes of its own (one intra-op thread each), lets every
trainer run `warmup` untimed steps then `steps` timed ones on batches of its own, and prints one
line in bench/ddp's format:

    ps impl=torch-rpc-careful mode=sync workers=2 servers=1 batch=64 steps=10 samples_per_s=...

samples_per_s counts every trainer's samples over the slowest trainer's timed steps, as
bench/ddp.py does. The two variants:

  tutorial  as PyTorch's tutorial "Implementing a Parameter Server Using Distributed RPC
            Framework" (pytorch.org/tutorials/intermediate/rpc_param_server_tutorial.html) writes
            it: a ParameterServer module holds the model on the server; each trainer's TrainerNet
            holds an RRef to it, runs the forward through it (remote_method(ParameterServer.forward,
            ...)), and trains with dist_autograd and a DistributedOptimizer over the parameters'
            RRefs. One server (the tutorial has one); asynchronous: each trainer's step applies its
            own gradient. Two changes: the server's forward runs on a copy of the parameters, or
            two trainers fail at once (see ParameterServer.forward), and the tutorial's debugging
            check of the gradients (get_dist_gradients, one more RPC per step) is left out.
  careful   what a user who cares for speed writes: the servers hold the parameters (spread over
            the servers by size) and a torch.optim.SGD, trainers compute forward and backward
            locally and make one RPC per server per step that pushes the gradients and returns the
            new parameters. sync: the server sums the W trainers' gradients and steps once all
            have arrived (PyTorch's "Implementing Batch RPC Processing Using Asynchronous
            Executions": @rpc.functions.async_execution and a future per step), averaging them as
            DDP does; async: each push is applied at once.
SGD with lr 0.01, as bench/ddp.
"""

import argparse
import queue
import sys
import threading
import time

import torch
from torch.distributed import rpc


def build_mlp():
    import torch.nn as nn

    return nn.Sequential(nn.Linear(784, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10))


LR = 0.01


# ---- the tutorial's parameter server (names and structure as in the tutorial) ----

class ParameterServer:
    """The tutorial's ParameterServer (an nn.Module there; what matters is that it holds the model)."""

    def __init__(self):
        torch.manual_seed(0)
        self.model = build_mlp()

    def forward(self, inp):
        # The one change to the tutorial's code: the forward runs on a copy of the parameters
        # (differentiable, so the gradients still reach them). As the tutorial writes it, two
        # trainers fail at once: "one of the variables needed for gradient computation has been
        # modified by an inplace operation", one trainer's optimizer step having changed weights
        # another's backward still needed (pytorch/tutorials#2095, pytorch/examples#877).
        # torch.nn.utils.stateless.functional_call does not help: it swaps the module's
        # parameters in place, and the server runs several trainers' forwards at once.
        F = torch.nn.functional
        w1, b1, w2, b2, w3, b3 = [p.clone() for p in self.model.parameters()]
        return F.linear(F.relu(F.linear(F.relu(F.linear(inp, w1, b1)), w2, b2)), w3, b3)

    def get_param_rrefs(self):
        return [rpc.RRef(param) for param in self.model.parameters()]


param_server = None
global_lock = threading.Lock()


def get_parameter_server():
    global param_server
    with global_lock:
        if not param_server:
            param_server = ParameterServer()
        return param_server


def call_method(method, rref, *args, **kwargs):
    return method(rref.local_value(), *args, **kwargs)


def remote_method(method, rref, *args, **kwargs):
    return rpc.rpc_sync(rref.owner(), call_method, args=[method, rref] + list(args), kwargs=kwargs)


class TrainerNet:
    def __init__(self):
        self.param_server_rref = rpc.remote("ps0", get_parameter_server)

    def get_global_param_rrefs(self):
        return remote_method(ParameterServer.get_param_rrefs, self.param_server_rref)

    def __call__(self, x):
        return remote_method(ParameterServer.forward, self.param_server_rref, x)


def tutorial_trainer(args, batches, step_times):
    import torch.distributed.autograd as dist_autograd
    import torch.nn.functional as F
    from torch import optim
    from torch.distributed.optim import DistributedOptimizer

    net = TrainerNet()
    opt = DistributedOptimizer(optim.SGD, net.get_global_param_rrefs(), lr=LR)

    def step(i):
        data, target = batches[i % len(batches)]
        with dist_autograd.context() as cid:
            model_output = net(data)
            loss = F.cross_entropy(model_output, target)
            dist_autograd.backward(cid, [loss])
            opt.step(cid)

    run_steps(args, step, step_times)


# ---- the careful variant ----

def shard_of(parameters, servers):
    """Which server holds each parameter: the largest first, each to the least loaded server."""
    load = [0] * servers
    owner = [0] * len(parameters)
    for i in sorted(range(len(parameters)), key=lambda i: -parameters[i].numel()):
        s = min(range(servers), key=lambda s: load[s])
        owner[i] = s
        load[s] += parameters[i].numel()
    return owner


class ShardServer:
    """A server's share of the parameters and their optimizer."""

    def __init__(self, index, servers, workers, mode):
        torch.manual_seed(0)  # every process builds the same model and takes its own share
        parameters = list(build_mlp().parameters())
        owner = shard_of(parameters, servers)
        self.params = [p.detach().clone() for p, o in zip(parameters, owner) if o == index]
        for p in self.params:
            p.grad = torch.zeros_like(p)
        self.optimizer = torch.optim.SGD(self.params, lr=LR)
        self.workers = workers
        self.mode = mode
        self.lock = threading.Lock()
        self.arrived = 0
        self.future = torch.futures.Future()

    def values(self):
        return [p.detach().clone() for p in self.params]


shard_server = None


def make_shard_server(index, servers, workers, mode):
    global shard_server
    shard_server = ShardServer(index, servers, workers, mode)


def get_values():
    with shard_server.lock:
        return shard_server.values()


@rpc.functions.async_execution
def push_sync(grads):
    server = shard_server
    with server.lock:
        for p, g in zip(server.params, grads):
            p.grad += g
        server.arrived += 1
        future = server.future
        if server.arrived == server.workers:
            for p in server.params:
                p.grad /= server.workers  # the mean over the global batch, as DDP's average
            server.optimizer.step()
            for p in server.params:
                p.grad.zero_()
            server.arrived = 0
            server.future = type(future)()
            future.set_result(server.values())
    return future


@rpc.functions.async_execution
def push_async(grads):
    server = shard_server
    with server.lock:
        for p, g in zip(server.params, grads):
            p.grad.copy_(g)
        server.optimizer.step()
        future = torch.futures.Future()
        future.set_result(server.values())
    return future


def careful_trainer(args, batches, step_times):
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = build_mlp()
    parameters = list(model.parameters())
    owner = shard_of(parameters, args.servers)
    mine = [[i for i, o in enumerate(owner) if o == s] for s in range(args.servers)]
    push = push_sync if args.mode == "sync" else push_async

    def load(values_per_server):
        with torch.no_grad():
            for s, values in enumerate(values_per_server):
                for i, v in zip(mine[s], values):
                    parameters[i].copy_(v)

    load([rpc.rpc_sync(f"ps{s}", get_values) for s in range(args.servers)])

    def step(i):
        data, target = batches[i % len(batches)]
        model.zero_grad()
        F.cross_entropy(model(data), target).backward()
        futures = [
            rpc.rpc_async(f"ps{s}", push, args=([parameters[i].grad for i in mine[s]],))
            for s in range(args.servers)
        ]
        load([f.wait() for f in futures])

    run_steps(args, step, step_times)


def run_steps(args, step, step_times):
    for i in range(args.warmup):
        step(i)
    start = time.perf_counter()
    for i in range(args.steps):
        step(args.warmup + i)
    step_times.put(time.perf_counter() - start)


# ---- processes ----

def process(rank, args, step_times):
    torch.set_num_threads(1)  # one intra-op thread per process, as bench/ddp
    options = rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=16, rpc_timeout=120, init_method=f"tcp://127.0.0.1:{args.port}"
    )
    world = args.servers + args.workers
    if rank < args.servers:
        if args.variant == "careful":
            make_shard_server(rank, args.servers, args.workers, args.mode)
        rpc.init_rpc(f"ps{rank}", rank=rank, world_size=world, rpc_backend_options=options)
    else:
        trainer = rank - args.servers
        rpc.init_rpc(f"trainer{trainer}", rank=rank, world_size=world, rpc_backend_options=options)
        torch.manual_seed(1000 + trainer)  # different data on every trainer, the same every run
        batches = [(torch.randn(args.batch, 784), torch.randint(0, 10, (args.batch,))) for _ in range(4)]
        if args.variant == "tutorial":
            tutorial_trainer(args, batches, step_times)
        else:
            careful_trainer(args, batches, step_times)
    rpc.shutdown()  # waits for every process: the servers serve until the trainers are done


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variant", choices=["tutorial", "careful"], required=True)
    parser.add_argument("--mode", choices=["sync", "async"], default="async")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--servers", type=int, default=1)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--port", type=int, default=29700)
    args = parser.parse_args()
    if args.variant == "tutorial" and (args.servers != 1 or args.mode != "async"):
        parser.error("the tutorial's parameter server is one asynchronous server: "
                     "--variant tutorial takes --servers 1 --mode async")
    if args.workers < 1 or args.servers < 1:
        parser.error("--workers and --servers must be at least 1")

    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    step_times = context.Queue()
    processes = [context.Process(target=process, args=(rank, args, step_times))
                 for rank in range(args.servers + args.workers)]
    for p in processes:
        p.start()
    times = []
    while len(times) < args.workers and not any(p.exitcode for p in processes):
        try:
            times.append(step_times.get(timeout=1))
        except queue.Empty:
            pass
    for p in processes:
        p.join(timeout=120 if len(times) == args.workers else 1)
        if p.exitcode is None:
            p.kill()  # a failed peer left it waiting
            p.join()
    failed = [p.exitcode for p in processes if p.exitcode != 0]
    if failed:
        print(f"ps_torch_rpc.py: processes exited with {failed}", file=sys.stderr)
        sys.exit(1)
    slowest = max(times)
    print(
        f"ps impl=torch-rpc-{args.variant} mode={args.mode} workers={args.workers} servers={args.servers} "
        f"batch={args.batch} steps={args.steps} samples_per_s={args.workers * args.batch * args.steps / slowest:.2f} "
        f"step_ms={slowest * 1e3 / args.steps:.3f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
