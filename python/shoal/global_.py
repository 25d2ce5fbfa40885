"""shoal.global_: global tensors, as OneFlow's (shoal/global/*.h, docs/global.md; docs/python.md,
"Global tensors"). A GlobalTensor is one logical tensor laid out over a Placement of workers by an
SBP per mesh axis: split(dim) (each holds a slice), broadcast() (each holds all of it) or
partial_sum() (each holds a term of a sum). Ops pick, per mesh axis, the local computation that
needs the least communication, box (re-lay out) the inputs that don't fit, and are differentiable
across workers. Every worker of the job calls every op.

    g = shoal.global_
    everyone = g.Placement.all()
    x = g.randn([8, 16], everyone, g.split(0))       # data parallel: rows split over the workers
    w = g.randn([16, 32], everyone, g.split(1))      # model parallel: columns split
    y = x @ w                                        # what one process computes, laid out
    g.sum(y).backward()                              # gradients across the workers
    x.full()                                         # the whole value, as one process holds it

("global" is a Python keyword, hence the underscore.)"""
from ._C import global_ as _g

Placement = _g.Placement
Sbp = _g.Sbp
NdSbp = _g.NdSbp
GlobalTensor = _g.GlobalTensor
split, broadcast, partial_sum = _g.split, _g.broadcast, _g.partial_sum
from_local = GlobalTensor.from_local
from_full = GlobalTensor.from_full
randn, rand, zeros, ones, arange = _g.randn, _g.rand, _g.zeros, _g.ones, _g.arange
(matmul, linear, relu, gelu, tanh, sigmoid, softmax, log_softmax, sum, mean, max, reshape, view, transpose,
 permute, cat, slice, layer_norm, embedding, cross_entropy, dropout) = (
    _g.matmul, _g.linear, _g.relu, _g.gelu, _g.tanh, _g.sigmoid, _g.softmax, _g.log_softmax, _g.sum, _g.mean, _g.max,
    _g.reshape, _g.view, _g.transpose, _g.permute, _g.cat, _g.slice, _g.layer_norm, _g.embedding, _g.cross_entropy,
    _g.dropout)

from . import global_nn as nn  # noqa: E402  (the layers, over the names above)

__all__ = ["nn", "Placement", "Sbp", "NdSbp", "GlobalTensor", "split", "broadcast", "partial_sum", "from_local", "from_full",
           "randn", "rand", "zeros", "ones", "arange", "matmul", "linear", "relu", "gelu", "tanh", "sigmoid", "softmax",
           "log_softmax", "sum", "mean", "max", "reshape", "view", "transpose", "permute", "cat", "slice",
           "layer_norm", "embedding", "cross_entropy", "dropout"]
