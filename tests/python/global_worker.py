"""A worker of tests/python/test_global.py: matmul plans and a tensor-parallel MLP on global tensors,
each beside plain PyTorch on the whole values (what one process computes after the same seed).

    global_worker.py OUT

The first worker writes OUT (torch.save): for every plan, the largest relative difference of the
output and of each input's gradient from PyTorch's, and the SBP the output came in; and the one-line
errors that bad input raised."""
import sys

import torch

import shoal

g = shoal.global_


def relative(a, b):
    return float((a - b).abs().max() / b.abs().max())


def plans(world):
    line = g.Placement.all()
    found = {
        "data": (line, g.split(0), g.broadcast()),
        "column": (line, g.broadcast(), g.split(1)),
        "row": (line, g.split(1), g.split(0)),
        "partial": (line, g.partial_sum(), g.broadcast()),
    }
    if world == 4:
        mesh = g.Placement.mesh([2, 2])
        found["2-D"] = (mesh, [g.split(0), g.split(1)], [g.broadcast(), g.split(0)])
    return found


def matmul_plan(placement, a_sbp, b_sbp):
    torch.manual_seed(3)
    a = g.randn([6, 8], placement, a_sbp).requires_grad_()
    b = g.randn([8, 4], placement, b_sbp).requires_grad_()
    y = a @ b
    g.sum(g.tanh(y)).backward()
    torch.manual_seed(3)
    a0, b0 = torch.randn(6, 8, requires_grad=True), torch.randn(8, 4, requires_grad=True)
    y0 = a0 @ b0
    y0.tanh().sum().backward()
    return {"out": relative(y.full(), y0), "grad_a": relative(a.grad.full(), a0.grad),
            "grad_b": relative(b.grad.full(), b0.grad), "sbp": repr(y.sbp)}


def tensor_parallel_mlp():
    """Megatron's MLP: the first layer column-parallel, the second row-parallel, a cross entropy."""
    line = g.Placement.all()
    torch.manual_seed(5)
    x = g.randn([8, 6], line, g.broadcast())
    w1 = g.randn([12, 6], line, g.split(0)).requires_grad_()
    w2 = g.randn([3, 12], line, g.split(1)).requires_grad_()
    target = g.from_full(torch.tensor([0, 1, 2, 0, 1, 2, 0, 1]), line, g.broadcast())
    loss = g.cross_entropy(g.linear(g.gelu(g.linear(x, w1)), w2), target)
    loss.backward()
    torch.manual_seed(5)
    x0, w10, w20 = torch.randn(8, 6), torch.randn(12, 6, requires_grad=True), torch.randn(3, 12, requires_grad=True)
    loss0 = torch.nn.functional.cross_entropy(
        torch.nn.functional.linear(torch.nn.functional.gelu(torch.nn.functional.linear(x0, w10)), w20),
        torch.tensor([0, 1, 2, 0, 1, 2, 0, 1]))
    loss0.backward()
    return {"out": relative(loss.full(), loss0), "grad_w1": relative(w1.grad.full(), w10.grad),
            "grad_w2": relative(w2.grad.full(), w20.grad), "sbp": repr(loss.sbp)}


def errors():
    found = []
    line = g.Placement.all()
    a = g.randn([4, 6], line, g.split(0))
    for bad in (lambda: a @ g.randn([5, 3], line, g.broadcast()),
                lambda: a @ g.randn([6, 3], g.Placement([0]), g.broadcast()),
                lambda: g.randn([4, 6], line, [g.split(0), g.split(1)])):
        try:
            bad()
            found.append("no error")
        except shoal.UsageError as e:
            found.append(str(e))
    return found


def main(out):
    shoal.init()
    results = {name: matmul_plan(*plan) for name, plan in plans(shoal.world_size()).items()}
    results["mlp"] = tensor_parallel_mlp()
    results["errors"] = errors()
    if shoal.is_main():
        torch.save(results, out)


if __name__ == "__main__":
    main(sys.argv[1])
