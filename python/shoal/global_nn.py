"""shoal.global_.nn: global layers (shoal/global/nn.h, docs/global.md), each a torch.nn.Module over
a C++ layer whose parameters are the local pieces of global tensors; and GradientSync, which sums
their gradients over the workers that hold copies of a piece (data-parallel axes).

    g = shoal.global_
    layout = g.nn.Layout(g.Placement.mesh([2, 2]), tensor_axes=[1])   # data x tensor parallel
    block = g.nn.TransformerBlock(64, heads=4, layout=layout)
    head = g.nn.Linear(64, 100, layout.placement, layout.column())
    model = torch.nn.Sequential(block, head)       # or any torch.nn.Module holding global layers
    sync = g.nn.GradientSync(model)                 # after the model is built, before backward
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)   # the local pieces

Every worker of the job builds the same layers in the same order (their initial values come from
torch's generator, seeded alike) and calls every forward."""
import torch

from . import _C

_nn = _C.global_.nn
_g = _C.global_


class Layout:
    """Where a block's layers sit and which mesh axes are tensor parallel (global::nn::Layout):
    replicated() is broadcast on every axis, column() split(0) of a [out, in] weight on the
    tensor axes, row() split(1) on them."""

    def __init__(self, placement=None, tensor_axes=()):
        self.placement = placement if placement is not None else _g.Placement.all()
        self.tensor_axes = list(tensor_axes)

    def _per_axis(self, sbp):
        return [sbp if axis in self.tensor_axes else _g.broadcast() for axis in range(self.placement.ndim)]

    def replicated(self):
        return [_g.broadcast()] * self.placement.ndim

    def column(self):
        return self._per_axis(_g.split(0))

    def row(self):
        return self._per_axis(_g.split(1))


class Module(torch.nn.Module):
    """A global layer: forward(GlobalTensor) -> GlobalTensor on the C++ layer, which it holds as
    `layer` (Note [Global layers in Python], src/python/global.cpp). Its parameters() are the C++
    layer's own local pieces, by the C++ names ("weight", "norm1.bias"): torch tensors that
    require grad, not Parameter objects."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer
        for name, piece in layer.named_parameters():
            self._parameters[name] = piece

    def forward(self, x):
        return self.layer.forward(x)

    def train(self, mode=True):
        """As torch's, and the C++ layer's mode too (its dropout)."""
        self.layer.train(bool(mode))
        return super().train(mode)

    def named_global_parameters(self):
        """(name, GlobalTensor) of each parameter, as the C++ layer names it."""
        return self.layer.named_global_parameters()

    def extra_repr(self):
        return repr(self.layer)


class Linear(Module):
    """x [..., in] times weight [out, in] transposed, plus bias: column-parallel with weight
    split(0), row-parallel with split(1); initialized as torch.nn.Linear."""

    def __init__(self, in_features, out_features, placement, sbp, bias=True):
        super().__init__(_nn.linear(in_features, out_features, placement, sbp, bias))


class Embedding(Module):
    """Rows of weight [num_embeddings, embedding_dim] for integer ids; split(0) is
    vocabulary-parallel."""

    def __init__(self, num_embeddings, embedding_dim, placement, sbp):
        super().__init__(_nn.embedding(num_embeddings, embedding_dim, placement, sbp))


class LayerNorm(Module):
    def __init__(self, dim, placement, eps=1e-5):
        super().__init__(_nn.layer_norm(dim, placement, eps))


class TransformerBlock(Module):
    """A GPT block (attention and MLP, each after a layer norm, with residuals): x [batch, time,
    dim]; its linear layers column- then row-parallel on the layout's tensor axes."""

    def __init__(self, dim, heads, layout, hidden=0, dropout=0.0):
        super().__init__(_nn.transformer_block(dim, heads, hidden, dropout, layout.placement, layout.tensor_axes))


def global_layers(model):
    """(path, C++ layer) of every global layer in `model` (the model itself: path ""), outermost
    first; a global layer's own submodules are its."""
    found = []
    for path, module in model.named_modules():
        if isinstance(module, Module) and not any(path.startswith(p + ".") for p, _ in found if p):
            found.append((path, module.layer))
    return found


class GradientSync:
    """Sums the gradients of `model`'s global layers in backward over the workers that hold copies
    of each piece (global::nn::GradientSync), bucketed and overlapped with backward. `model` is a
    global layer or any torch.nn.Module holding them; it must hold no other parameter."""

    def __init__(self, model, bucket_bytes=25 * 1024 * 1024, first_bucket_bytes=1024 * 1024):
        layers = global_layers(model)
        held = {id(p) for path, layer in layers for _, p in layer.named_parameters()}
        for name, p in model.named_parameters():
            if id(p) not in held:
                raise _C.UsageError("shoal.global_.nn.GradientSync: parameter '%s' is a plain tensor; expected every "
                                    "parameter in a global layer (shoal.global_.nn)" % name)
        if layers and layers[0][0] == "":
            layers = [("model", layers[0][1])]
        self._sync = _nn.GradientSync(layers=layers, bucket_bytes=bucket_bytes,
                                      first_bucket_bytes=first_bucket_bytes)

    def groups(self):
        """The workers each bucketed set of parameters is summed over, one list per set."""
        return self._sync.groups()
