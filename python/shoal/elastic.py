"""shoal.elastic: training that goes on when workers die, join or leave (shoal/elastic/state.h,
docs/elastic.md; docs/python.md, "Elastic jobs").

    shoal.init()                                          # under shoal run --min 1 --max 4
    model = shoal.DataParallel(net)
    loader = shoal.data.DataLoader(dataset, batch_size=64, shuffle=True)
    state = shoal.elastic.State(model, optimizer, loader)

    def train():
        while state.epoch < epochs:
            for x, y in loader.epoch(state.epoch):
                ...forward, backward, optimizer.step()...
                state.commit()
            state.next_epoch()

    shoal.elastic.run(state, train)

When a worker dies, the others' next collective raises; run() forms the next round with the
workers still alive (and any waiting to join), gives every member the newest commit, re-cuts
what is left of the epoch over the new world and calls train again, which goes on from the last
commit. The state is the C++ one: the Python model's tensors, the optimizer's state (moved by
field name, as shoal.save moves it) and the loader's position."""
from . import _C
from .checkpoint import _mirror, _module, _state_from_mirror
from .global_nn import global_layers

WorldChange = _C.WorldChange


class BatchPolicy:
    """What changes when the number of workers changes (elastic::BatchPolicy).
    keep_global_batch(): the loader's batch_size is the global batch, cut over the workers, and
    the learning rate stays. scale_learning_rate(reference_world_size=1, warmup_steps=0): each
    worker's batch stays (the loader is per_worker), and the learning rate is scaled linearly with
    the world, lr = lr0 * world / reference, reached over warmup_steps commits.
    adascale(reference_world_size=1): each worker's batch stays, and lr = lr0 * gain, AdaScale's
    gain of the global batch over the reference world's, from the gradient noise the model's
    shoal.DataParallel measures (measure_gradient_noise=True); State.scaled_steps counts the
    progress in reference steps.
    goodput(base_batch, max_batch, min_local=1, max_local=0, max_accumulation=1, choose_every=50):
    the batch follows the world by goodput (Pollux): at every change of the world and every
    choose_every commits, each worker's batch and the backward passes a step takes in are those of
    the highest goodput within the limits (the global batch lr0 was set for, the largest, each
    backward's batch bounds, max_local 0: none), from the step times the state measures and the
    gradient noise shoal.DataParallel measures; lr = lr0 * AdaScale's gain of that batch over
    base_batch. The loader is per_worker and its batch_size is the policy's to set; a step takes
    State.accumulation backward passes (the first ones under DataParallel.no_sync())."""

    def __init__(self, kind, reference_world_size=1, warmup_steps=0, limits=(), choose_every=0):
        self.kind, self.reference_world_size, self.warmup_steps = kind, reference_world_size, warmup_steps
        self.limits, self.choose_every = list(limits), choose_every

    @classmethod
    def keep_global_batch(cls):
        return cls("keep_global_batch")

    @classmethod
    def scale_learning_rate(cls, reference_world_size=1, warmup_steps=0):
        return cls("scale_learning_rate", reference_world_size, warmup_steps)

    @classmethod
    def adascale(cls, reference_world_size=1):
        return cls("adascale", reference_world_size)

    @classmethod
    def goodput(cls, base_batch, max_batch, min_local=1, max_local=0, max_accumulation=1, choose_every=50):
        return cls("goodput", limits=(base_batch, max_batch, min_local, max_local, max_accumulation),
                   choose_every=choose_every)


class _Values:
    """The program's own values in the state, by name: tensors of any dtype and shape, committed
    and restored with the rest. Read them again after a restore (run() replaces them)."""

    def __init__(self, state):
        self._state = state

    def __getitem__(self, name):
        value = self._state.value(name)
        if value is None:
            raise KeyError(name)
        return value

    def __setitem__(self, name, value):
        self._state.set_value(name, value)


class State:
    """What a failure rolls back to and what a newcomer receives: the model's parameters and
    buffers (of the module, or of the shoal.DataParallel given), the optimizer's state and learning
    rates (torch.optim SGD, Adam, AdamW, Adagrad or RMSprop), the loader's position
    (shoal.data.DataLoader) and `values`. The options are elastic::StateOptions' (policy,
    copy_parameters, checkpoint, checkpoint_every), by the same names."""

    def __init__(self, model, optimizer, loader, policy=None, copy_parameters=False, checkpoint="",
                 checkpoint_every=0):
        what = "shoal.elastic.State"
        module = _module(model, what)
        policy = policy or BatchPolicy.keep_global_batch()
        sampler = getattr(loader, "sampler", loader)
        if not hasattr(sampler, "_sampler"):
            raise _C.UsageError("%s: the loader is a %s; expected a shoal.data.DataLoader or shoal.data.Sampler"
                                % (what, type(loader).__name__))
        layers = global_layers(module)
        in_layers = {id(t) for _, layer in layers for _, t in layer.named_parameters()}
        parameters = [(n, p) for n, p in module.named_parameters() if id(p) not in in_layers]
        buffers = list(module.named_buffers())
        self._optimizer = optimizer
        self._mirror = _mirror(optimizer, module, what)
        self._give()  # a state loaded before (shoal.load) is the first commit's
        self._state = _C.ElasticState(
            parameters=parameters, buffers=buffers, global_layers=layers, optimizer=self._mirror,
            sampler=sampler._sampler,
            policy=policy.kind, reference_world_size=policy.reference_world_size, warmup_steps=policy.warmup_steps,
            limits=policy.limits, choose_every=policy.choose_every,
            copy_parameters=bool(copy_parameters), checkpoint=str(checkpoint), checkpoint_every=checkpoint_every)
        self._state.on_reset(self._take)
        self.values = _Values(self._state)

    epoch = property(lambda self: self._state.epoch, doc="The epoch the training loop is in.")
    version = property(lambda self: self._state.version,
                       doc="Commits so far in the job's history, the same on every worker.")
    scaled_steps = property(lambda self: self._state.scaled_steps,
                            doc="The progress in steps at the policy's reference world (adascale: "
                                "the sum of the steps' gains), committed with the rest.")
    gain = property(lambda self: self._state.gain,
                    doc="The factor the policy scales the learning rates by for the next step.")
    accumulation = property(lambda self: self._state.accumulation,
                            doc="BatchPolicy.goodput: the backward passes the next step takes its batch in "
                                "(the loader's batch cut in as many chunks); 1 under the other policies.")
    batch_choice = property(lambda self: self._state.batch_choice,
                            doc="BatchPolicy.goodput: the batch chosen for this world, a dict of local_batch, "
                                "accumulation, global_batch, throughput, efficiency and goodput.")

    def commit(self):
        """Records the state as the point a failure rolls back to, and agrees with the other
        workers whether the world changes now (then raises WorldChange, for run() to catch: let
        it through). A collective: every worker commits at the same points."""
        self._give()
        self._state.commit()
        self._take_rates()

    def next_epoch(self):
        """Moves to the next epoch, and commits."""
        self._give()
        self._state.next_epoch()
        self._take_rates()

    def on_reset(self, callback):
        """Calls `callback()` on every worker after the world changed and the state was restored
        and shared, before the training function runs again."""
        self._state.on_reset(callback)

    def set_base_learning_rates(self, rates):
        """The policy's base rates (lr0), per param group, for a schedule of the program's own: the
        optimizer's rates become base * gain at once (during a warm-up, its commits move them)."""
        self._state.set_base_learning_rates(list(rates))
        self._take_rates()

    def _give(self):
        # The Python optimizer's state and rates into its mirror, which the commit records: the
        # tensors are shared, but the steps are counted apart and new entries appear on first steps.
        self._mirror.give(self._optimizer)

    def _take_rates(self):
        # The policy may have set new rates (scale_learning_rate, its warm-up; adascale).
        for group, rate in zip(self._optimizer.param_groups, self._mirror.learning_rates()):
            group["lr"] = rate

    def _take(self):
        # After a restore and the sharing of the newest commit: the mirror's state is the job's.
        _state_from_mirror(self._optimizer, self._mirror)
        self._take_rates()


def run(state, train):
    """Calls `train()` and, in an elastic job, recovers from the loss of a worker and from changes
    agreed at commit(): forms the next round, restores and shares the newest commit, and calls
    `train()` again. Returns when `train` returns. Outside an elastic job it calls `train` once,
    after sharing the first worker's state. `train` must let shoal's exceptions and WorldChange
    through."""
    def start():
        state._take()
        train()

    state._state.run(start)
