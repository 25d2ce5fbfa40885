"""shoal.save and shoal.load: a model, its optimizer, where the data stands and the program's own
values, in one file, written atomically by one worker and loaded on any number of workers
(shoal::save and shoal::load, docs/checkpoint.md; docs/python.md, "Checkpoints").

    shoal.save("ckpt.pt", model, optimizer, loader, extras={"step": torch.tensor(step)})
    extras = shoal.load("ckpt.pt", model, optimizer, loader)

The file is the C++ program's: one written by a C++ program loads here into a model whose
parameter and buffer names are the C++ model's ("0.weight", "fc.bias"), with an optimizer of the
same type over its parameters in the same order, and the other way round."""
import collections

import torch

from . import _C
from .dp import DataParallel
from .global_nn import global_layers

# The optimizers whose state shoal saves, by their LibTorch name, and how Python keeps the step:
# a 0-dim float tensor (Adam, AdamW, Adagrad in torch 1.13), an int (RMSprop) or none (SGD).
_OPTIMIZERS = [
    (torch.optim.AdamW, "AdamW", "tensor"),
    (torch.optim.Adam, "Adam", "tensor"),
    (torch.optim.Adagrad, "Adagrad", "tensor"),
    (torch.optim.RMSprop, "RMSprop", "int"),
    (torch.optim.SGD, "SGD", None),
]
_OPTIONS = (bool, int, float, tuple)


def _module(model, what):
    if isinstance(model, DataParallel):
        return model.module
    if not isinstance(model, torch.nn.Module):
        raise _C.UsageError("%s: the model is a %s; expected a torch.nn.Module or shoal.DataParallel"
                            % (what, type(model).__name__))
    return model


def _tensors(module):
    """The module's parameters and persistent buffers by every name its state_dict gives them (a
    tied weight under each of its modules, as a C++ module saves it), its submodules' names (the
    tree a C++ model of the same layers has), and its global layers (shoal.global_.nn) with their
    paths, whose tensors are theirs: a checkpoint takes those C++ layers themselves, which save
    and load whole values."""
    layers = global_layers(module)
    paths = [path for path, _ in layers]

    def inside(name):
        return any(path == "" or name == path or name.startswith(path + ".") for path in paths)

    parameters, buffers = [], []
    for name, tensor in module.state_dict(keep_vars=True).items():
        if not inside(name):
            (parameters if isinstance(tensor, torch.nn.Parameter) else buffers).append((name, tensor))
    modules = [name for name, _ in module.named_modules(remove_duplicate=False) if name and not inside(name)]
    return parameters, buffers, modules, layers


def _kind(optimizer, what):
    for cls, name, step in _OPTIMIZERS:
        if isinstance(optimizer, cls):
            return name, step
    raise _C.UsageError("%s: the optimizer is %s.%s; expected torch.optim.SGD, Adam, AdamW, Adagrad or RMSprop, "
                        "whose state shoal saves" % (what, type(optimizer).__module__, type(optimizer).__name__))


def _mirror(optimizer, module, what):
    """A LibTorch optimizer of the optimizer's type over the same tensors, in the same groups and
    with the same options (Note [A Python optimizer's state in C++], src/python/checkpoint.cpp)."""
    name, _ = _kind(optimizer, what)
    of_model = {id(p) for p in module.parameters()}
    groups = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in of_model:
                raise _C.UsageError("%s: the optimizer holds a tensor of shape %s that is not a parameter of the model; "
                                    "expected an optimizer over the model's parameters" % (what, list(p.shape)))
        options = {k: v for k, v in group.items() if k != "params" and isinstance(v, _OPTIONS)}
        groups.append((list(group["params"]), options))
    return _C.OptimizerMirror(name, groups)


def _params(optimizer):
    return [p for group in optimizer.param_groups for p in group["params"]]


def _state_from_mirror(optimizer, mirror):
    _, step_kind = _kind(optimizer, "shoal.load")
    state = collections.defaultdict(dict)
    for group in optimizer.param_groups:
        for p in group["params"]:
            held = mirror.state(p)
            if held is None:
                continue
            step, fields = held
            entry = dict(fields)
            if step is not None:
                if step_kind == "int":
                    entry["step"] = step
                elif group.get("capturable") or group.get("fused"):
                    entry["step"] = torch.full((1,), float(step), device=p.device)
                else:
                    entry["step"] = torch.tensor(float(step))
            state[p] = entry
    optimizer.state = state


def _sampler(loader, what):
    if loader is None:
        return None
    sampler = getattr(loader, "sampler", loader)
    if not hasattr(sampler, "_sampler"):
        raise _C.UsageError("%s: the loader is a %s; expected a shoal.data.DataLoader or shoal.data.Sampler "
                            "(a torch DataLoader's position is not known to shoal)" % (what, type(loader).__name__))
    return sampler._sampler


def _check(optimizer, loader, what):
    if loader is not None and optimizer is None:
        raise _C.UsageError("%s: a loader was given without an optimizer; expected both, or neither "
                            "(a checkpoint that resumes the data resumes the optimizer too)" % what)


def _parts(model, what):
    """(module, parameters, buffers, modules, global layers, pipeline) for a checkpoint of `model`:
    a module or its DataParallel; a shoal.pipeline.Pipeline of plain layers, whose whole model
    (Pipeline::module()) is saved, each value from a worker that holds it; or one of global layers,
    whose model's global layers save whole values themselves."""
    from .pipeline import Pipeline  # noqa: PLC0415  (pipeline imports nothing of this module)

    if isinstance(model, Pipeline):
        if not model._pipeline.is_global():
            return model.net, [], [], [], [], model._pipeline
        model = model.net
    module = _module(model, what)
    return (module,) + _tensors(module) + (None,)


def save(path, model, optimizer=None, loader=None, extras=None, group=None, timeout=None):
    """Writes `path`: the model's parameters and persistent buffers, the optimizer's state, the
    loader's position and `extras` (a dict of str to torch.Tensor). A collective of the world (or
    of `group`; shoal.comm.Group.single() for a process on its own): every worker calls it; the
    first writes, to a temporary file renamed over `path`, so `path` always holds a whole
    checkpoint. `model` may be the module, its shoal.DataParallel or a shoal.pipeline.Pipeline
    (the whole model's file, as one process would write it); `timeout` (seconds) bounds the other
    workers' wait for the write."""
    what = "shoal.save"
    _check(optimizer, loader, what)
    module, parameters, buffers, modules, layers, pipeline = _parts(model, what)
    mirror = None
    if optimizer is not None:
        mirror = _mirror(optimizer, module, what)
        mirror.give(optimizer)
    extras = dict(extras or {})
    for name, value in extras.items():
        if not isinstance(name, str) or not isinstance(value, torch.Tensor):
            raise _C.UsageError("%s: extras[%r] is a %s; expected str keys and torch.Tensor values "
                                "(torch.tensor(0.01))" % (what, name, type(value).__name__))
    _C.save(path=str(path), parameters=parameters, buffers=buffers, modules=modules, global_layers=layers,
            pipeline=pipeline, optimizer=mirror,
            loader=_sampler(loader, what), extras=extras, group=group, timeout=timeout)


def load(path, model, optimizer=None, loader=None, group=None, timeout=None):
    """Restores the model (values copied into its tensors, so the optimizer's and DataParallel's
    references stay valid), the optimizer's state (its param groups' options, such as the learning
    rate, stay the program's) and the loader's position (the next batch is the one after the saved
    step, on any number of workers) from `path`, and returns the file's extras (a dict). Every part
    is checked against the file before any changes: UsageError on every worker, naming the first
    mismatch, with nothing changed. A collective, as save."""
    what = "shoal.load"
    _check(optimizer, loader, what)
    module, parameters, buffers, modules, layers, pipeline = _parts(model, what)
    mirror = None if optimizer is None else _mirror(optimizer, module, what)
    extras = _C.load(path=str(path), parameters=parameters, buffers=buffers, modules=modules, global_layers=layers,
            pipeline=pipeline, optimizer=mirror,
                     loader=_sampler(loader, what), group=group, timeout=timeout)
    if mirror is not None:
        _state_from_mirror(optimizer, mirror)
    return extras
