"""A worker of tests/python/test_data_parallel.py: the plain PyTorch program of that test with
shoal's lines added. argv: the output file, then the case: "train"; "no_sync" (each worker's share in two halves, the
first backward under no_sync()); "fp16" (the fp16 compression hook); "unused" (a layer forward
never uses, find_unused_parameters); "differ" (worker 1 builds a wider model); "lost" (worker 1
leaves at the third step, and worker 0 writes what its backward raised); or "noise" (the gradient
noise measured at each step, beside the same estimate computed here from every worker's share)."""
import copy
import os
import sys

import torch

import shoal

import dp_program as program


def main(out, case):
    shoal.init()
    net = program.model(width=9) if case == "differ" and shoal.rank() == 1 else program.make(case)
    if shoal.rank() != 0:
        # Another start on the other workers: DataParallel starts everyone from worker 0's model.
        with torch.no_grad():
            for p in net.parameters():
                p.add_(1.0)
    try:
        model = shoal.DataParallel(net, find_unused_parameters=case == "unused",
                                   comm_hook=shoal.fp16_compress_hook() if case == "fp16" else None,
                                   measure_gradient_noise=case == "noise", gradient_noise_smoothing=0.0)
    except shoal.UsageError as error:
        # Every worker raises the same one line.
        with open("%s.%d" % (out, shoal.rank()), "w") as f:
            f.write(str(error))
        return
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    measured, oracle = [], []
    for step in range(program.STEPS):
        if case == "noise":
            oracle.append(noise_alone(net, step, shoal.world_size()))
        x, y = program.batch(step)
        x, y = program.share(x, shoal.rank(), shoal.world_size()), program.share(y, shoal.rank(), shoal.world_size())
        optimizer.zero_grad(set_to_none=False)
        if case == "lost":
            if shoal.rank() == 1 and step == 2:
                os._exit(0)
            try:
                torch.nn.functional.mse_loss(model(x), y).backward()
            except shoal.CommError as error:
                with open(out, "w") as f:
                    f.write("%s at step %d: %s" % (type(error).__name__, step, error))
                return
        elif case == "no_sync":
            first, second = program.halves(x), program.halves(y)
            with model.no_sync():
                torch.nn.functional.mse_loss(model(first[0]), second[0]).backward()
            torch.nn.functional.mse_loss(model(first[1]), second[1]).backward()
        else:
            torch.nn.functional.mse_loss(model(x), y).backward()
        if case == "noise":
            noise = model.gradient_noise
            measured.append((noise.measurements, noise.batch, noise.gradient_sqr, noise.variance))
        optimizer.step()
    if shoal.is_main():
        torch.save({"params": [p.detach() for p in net.parameters()],
                    "grad_is_none": [p.grad is None for p in net.parameters()],
                    "measured": measured, "oracle": oracle}, out)


def noise_alone(net, step, n):
    """The estimate of Note [Measuring the gradient noise] for this step's n shares, in double
    precision on this one process: each share's gradient at the current parameters, weighed by
    its share of the batch as DataParallel weighs it, then (|G|^2, tr(Sigma))."""
    x, y = program.batch(step)
    alone = copy.deepcopy(net).double()
    means = []
    for rank in range(n):
        alone.zero_grad()
        share_x, share_y = program.share(x, rank, n), program.share(y, rank, n)
        torch.nn.functional.mse_loss(alone(share_x.double()), share_y.double()).backward()
        weight = n * len(share_x) / len(x)
        means.append(torch.cat([p.grad.reshape(-1) for p in alone.parameters()]) * weight)
    mean_local = sum(float(g.dot(g)) for g in means) / n
    average = torch.stack(means).mean(0)
    average_sqr = float(average.dot(average))
    small, big = len(x) / n, float(len(x))
    return ((big * average_sqr - small * mean_local) / (big - small),
            small * big * (mean_local - average_sqr) / (big - small))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
