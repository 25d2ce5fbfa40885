"""A worker of tests/python/test_elastic.py: tests/programs/elastic_worker.cpp's program in
Python. An MLP on a synthetic classification set under shoal.DataParallel, SGD with momentum, a
shoal.data.DataLoader with torch's loader processes reading ahead, a commit after every step, and
a count of how often each sample was trained on in committed steps, kept in the elastic state so
that it rolls back with it.

    elastic_worker.py OUT [EPOCHS] [STEP_MS]

The global batch of 10 is cut 4, 3, 3 on three workers. Every worker prints "train pid=P rank=R
world=W step=S" when the training function (re)starts; the first worker prints "step S world W"
after each commit and, at the end, writes OUT (torch.save): the parameters and the counts.

ELASTIC_WORKER_POLICY=goodput puts the job under BatchPolicy.goodput(8, 48, 2, 6, 2,
choose_every=5), as tests/programs/elastic_worker.cpp's "goodput": DataParallel measures the
gradient noise, each worker's share comes in state.accumulation backward passes (all but the last
under no_sync), and the step lines add "lr=L batch=B passes=P gain=G" (the batch the step trained
on). ELASTIC_WORKER_HOLD_ALONE_AFTER=N: a worker left alone commits without training after N
steps alone, until the world changes (so that a joiner finds the job still running)."""
import os
import sys
import time

import torch

import shoal

SAMPLES, FEATURES, CLASSES = 240, 8, 4


def dataset():
    # Each sample's features with its index in the last column, so that a worker knows what it got.
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    y = x.matmul(torch.randn(FEATURES, CLASSES, generator=generator)).argmax(1)
    return torch.utils.data.TensorDataset(torch.cat([x, torch.arange(SAMPLES, dtype=torch.float32)[:, None]], 1), y)


def main(out, epochs=4, step_ms=0):
    shoal.init()
    torch.manual_seed(1)
    net = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, CLASSES))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    goodput = os.environ.get("ELASTIC_WORKER_POLICY") == "goodput"
    model = shoal.DataParallel(net, measure_gradient_noise=goodput)
    if goodput:
        loader = shoal.data.DataLoader(dataset(), batch_size=4, shuffle=True, seed=7, num_workers=1, per_worker=True)
        policy = shoal.elastic.BatchPolicy.goodput(8, 48, 2, 6, 2, choose_every=5)
    else:
        loader = shoal.data.DataLoader(dataset(), batch_size=10, shuffle=True, seed=7, num_workers=1)
        policy = None
    state = shoal.elastic.State(model, optimizer, loader, policy=policy)
    state.values["counts"] = torch.zeros(epochs, SAMPLES, dtype=torch.long)
    hold_alone_after = int(os.environ.get("ELASTIC_WORKER_HOLD_ALONE_AFTER", "-1"))
    alone = [0]

    def train():
        print("train pid=%d rank=%d world=%d step=%d" % (os.getpid(), shoal.rank(), shoal.world_size(), state.version),
              flush=True)
        while state.epoch < epochs:
            for batch, target in loader.epoch(state.epoch):
                features, indices = batch[:, :FEATURES], batch[:, FEATURES].long()
                optimizer.zero_grad()
                # What every worker trained on in this step, summed over the workers.
                seen = torch.zeros(SAMPLES, dtype=torch.long).index_add_(0, indices, torch.ones_like(indices))
                shoal.comm.world().all_reduce(seen)
                # The plain mean over this worker's share (DataParallel weighs it by the share), in
                # state.accumulation backward passes, each weighed by its part of the share.
                passes = state.accumulation if len(target) > 0 else 1
                parts = list(zip(features.chunk(passes), target.chunk(passes)))
                for i, (x, y) in enumerate(parts):
                    weight = len(y) / len(target) if len(target) > 0 else 1
                    loss = torch.nn.functional.cross_entropy(model(x), y) * weight
                    if i + 1 < len(parts):
                        with model.no_sync():
                            loss.backward()
                    else:
                        loss.backward()
                optimizer.step()
                trained = state.batch_choice
                state.values["counts"][state.epoch] += seen
                if step_ms:
                    time.sleep(step_ms / 1000)
                state.commit()
                if shoal.is_main():
                    extra = ""
                    if goodput:
                        extra = " lr=%g batch=%d passes=%d gain=%g" % (
                            optimizer.param_groups[0]["lr"], trained["global_batch"], trained["accumulation"], state.gain)
                    print("step %d world %d%s" % (state.version, shoal.world_size(), extra), flush=True)
                # After the step's commit, before the loader hands out the next batch: the commits
                # below leave the cursor where it is.
                if hold_alone_after >= 0 and shoal.world_size() == 1:
                    alone[0] += 1
                    while alone[0] >= hold_alone_after:
                        time.sleep(0.01)
                        state.commit()
            state.next_epoch()

    shoal.elastic.run(state, train)
    if shoal.is_main():
        torch.save({"parameters": [p.detach() for p in net.parameters()], "counts": state.values["counts"]},
                   out + ".tmp")
        os.rename(out + ".tmp", out)


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:]))
