"""shoal.pipeline: pipeline parallelism for a torch.nn.Sequential of Python modules
(shoal/pipeline/pipeline.h, docs/pipeline.md; docs/python.md, "Pipelines").

    torch.manual_seed(0)                              # the same whole model on every worker
    net = torch.nn.Sequential(...)
    pipe = shoal.pipeline.Pipeline(net, micro_batches=8, schedule="1f1b")   # or gpipe, interleaved, zb
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)                 # this worker's stages'
    for x, y in batches:                              # the same global batch on every worker
        optimizer.zero_grad()
        loss = pipe.step(x, y, torch.nn.functional.mse_loss)   # the batch's mean loss, on every worker
        optimizer.step()

Schedules are data: `shoal.pipeline.make_schedule("1f1b", workers, 1, micro_batches)` (or gpipe(),
one_f_one_b(), interleaved_one_f_one_b(), zero_bubble_h1()) gives a Schedule whose `actions[w]`
are worker w's Actions in order; `validate(schedule)` checks one (UsageError naming the first
fault), `simulate(schedule, Costs(...))` plays it (makespan, bubble, peak_in_flight), and
Pipeline(custom_schedule=...) runs a hand-written one."""
from . import _C
from .global_nn import global_layers

_p = _C.pipeline
ActionKind, Action, Schedule, Costs, Simulation = _p.ActionKind, _p.Action, _p.Schedule, _p.Costs, _p.Simulation
gpipe, one_f_one_b, interleaved_one_f_one_b, zero_bubble_h1 = (
    _p.gpipe, _p.one_f_one_b, _p.interleaved_one_f_one_b, _p.zero_bubble_h1)
make_schedule, validate, simulate, balanced_split = _p.make_schedule, _p.validate, _p.simulate, _p.balanced_split

__all__ = ["Pipeline", "ActionKind", "Action", "Schedule", "Costs", "Simulation", "gpipe", "one_f_one_b",
           "interleaved_one_f_one_b", "zero_bubble_h1", "make_schedule", "validate", "simulate", "balanced_split"]


class Pipeline:
    """`net` cut into stages that sit on different workers (stage s on worker s % p, split by
    parameter count, or as `split` says), run under `schedule` ("gpipe", "1f1b", "interleaved",
    "zb", or `custom_schedule`) on `micro_batches` micro-batches. The options are
    PipelineOptions' by the same names; `placements` (a list of shoal.global_.Placement) replicate
    stages over data axes. Every worker builds the same whole model and calls step() with the same
    global batch. Needs shoal.init().

    Layers of global tensors (shoal.global_.nn layers, or Python modules over them and the ops)
    make stages by their placements, as in C++: `batch` is then how each micro-batch's input and
    target are laid out (an Sbp per mesh axis), and `loss(output, target)` takes and gives global
    tensors (shoal.global_.cross_entropy)."""

    def __init__(self, net, micro_batches=1, schedule="1f1b", stages_per_worker=0, split=None, placements=None,
                 custom_schedule=None, timeout=None, batch=None):
        import torch  # noqa: PLC0415

        if not isinstance(net, torch.nn.Sequential):
            raise _C.UsageError("shoal.pipeline.Pipeline: the model is a %s; expected a torch.nn.Sequential"
                                % type(net).__name__)
        self.net = net
        layers = []
        for layer in net:
            held = global_layers(layer)
            if held and held[0][0] == "":
                layers.append(("c++", None, [], [], [], held))  # a global layer itself: C++ all the way
            elif held:
                layers.append(("global", layer, [], [], [], held))
            else:
                layers.append(("plain", layer, list(layer.named_parameters()), list(layer.named_buffers()),
                               [name for name, _ in layer.named_modules() if name], []))
        batch = [] if batch is None else ([batch] if isinstance(batch, _C.global_.Sbp) else list(batch))
        self._pipeline = _p.Pipeline(layers=layers, micro_batches=micro_batches, schedule=str(schedule),
                                     stages_per_worker=stages_per_worker, split=list(split or []),
                                     placements=list(placements or []), custom_schedule=custom_schedule,
                                     timeout=timeout, batch=batch)

    def step(self, input, target, loss):
        """Forward and backward of the batch under the schedule; accumulates into the .grad of this
        worker's stages' parameters the gradient of the batch's mean loss, and returns that loss (a
        float64 scalar) on every worker. `loss(output, target)` is a micro-batch's mean loss."""
        return self._pipeline.step(input, target, loss)

    def evaluate(self, input, target, loss):
        """The batch's mean loss without backward (put the model in eval mode first where it
        matters)."""
        return self._pipeline.evaluate(input, target, loss)

    def layers(self):
        """The indices in `net` of the layers this worker's stages hold."""
        split, held, first = self._pipeline.split(), set(self._pipeline.local_stages()), 0
        mine = []
        for stage, count in enumerate(split):
            if stage in held:
                mine.extend(range(first, first + count))
            first += count
        return mine

    def parameters(self):
        """This worker's stages' parameters (a tied weight once): what its optimizer steps."""
        seen, found = set(), []
        for i in self.layers():
            for p in self.net[i].parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    found.append(p)
        return found

    def split(self):
        return self._pipeline.split()

    def local_stages(self):
        return self._pipeline.local_stages()

    def stages(self):
        return self._pipeline.stages()

    def placement(self, stage):
        return self._pipeline.placement(stage)

    def schedule(self):
        return self._pipeline.schedule()

    def last_step_stats(self):
        return self._pipeline.last_step_stats()
