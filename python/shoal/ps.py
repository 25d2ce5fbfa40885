"""shoal.ps: parameter-server training (shoal/ps/ps.h, docs/ps.md; docs/python.md, "Parameter
servers"). The program replaces its torch optimizer with shoal.ps.Optimizer, and its large
torch.nn.Embedding tables with shoal.ps.Embedding:

    shoal.init()
    net = Net()                                             # may hold shoal.ps.Embedding tables
    optimizer = shoal.ps.Optimizer(net, torch.optim.Adagrad, lr=0.02)
    ... optimizer.zero_grad(); loss.backward(); optimizer.step() ...

started with `shoal run --servers 2 -n 4 python3 train.py`. Without servers (a job of one) the
same program trains with the servers' rules in-process."""
import torch

from . import _C
from .checkpoint import _module

_INITS = ("zeros", "uniform", "normal")


class Embedding(torch.nn.Module):
    """A torch.nn.Embedding whose rows live on the parameter servers. forward(ids) pulls the rows
    of the batch's distinct ids and returns them as torch's Embedding does ([*ids.shape, dim]);
    their gradient goes to the servers at the optimizer's step, which updates only them. The table
    is no parameter of the module: it is never whole on a worker. Its name on the servers is the
    module's path in the model. Rows start as zeros, uniform(a, b) or normal(a, b) (init, a, b),
    a pure function of (seed, table, id): by default normal(0, 1), as torch's. num_embeddings 0:
    any int64 id (hashed ids; rows are made as they are trained)."""

    def __init__(self, num_embeddings, embedding_dim, init="normal", a=0.0, b=1.0, seed=0):
        super().__init__()
        if init not in _INITS:
            raise _C.UsageError("shoal.ps.Embedding: init %r; expected one of %s" % (init, ", ".join(_INITS)))
        self._table = _C.PsEmbedding(num_embeddings=num_embeddings, embedding_dim=embedding_dim,
                                      init=init, a=a, b=b, seed=seed)

    num_embeddings = property(lambda self: self._table.num_embeddings)
    embedding_dim = property(lambda self: self._table.embedding_dim)

    def forward(self, ids):
        return self._table.forward(ids)

    def extra_repr(self):
        return "num_embeddings=%d, embedding_dim=%d" % (self.num_embeddings, self.embedding_dim)


_KINDS = [(torch.optim.SGD, "SGD"), (torch.optim.Adagrad, "Adagrad"), (torch.optim.Adam, "Adam")]


class Optimizer:
    """The optimizer of a parameter-server trained model (shoal::ps::Optimizer). `optimizer` is
    torch.optim.SGD, Adagrad or Adam, and the keyword arguments are its (lr, momentum, betas, ...):
    the servers apply that rule to the dense parameters and its lazy row-wise form to the tables.
    `mode`: "sync" (every step applies the mean of all workers' gradients), "ssp:S" (a worker runs
    at most S steps ahead of the slowest) or "async"; None: sync, or SHOAL_PS_MODE. `timeout`
    (seconds) bounds every pull and push. `measure_gradient_noise` (sync only) measures the
    gradient noise scale as DataParallel does, read with `gradient_noise`; `batch_size` is each
    worker's batch in samples, needed for it unless train_on leases the batches (docs/ps.md,
    "Gradient noise"). Construction registers the tables and loads the first worker's values into
    every worker's parameters. Needs shoal.init()."""

    def __init__(self, model, optimizer=torch.optim.SGD, mode=None, timeout=None, measure_gradient_noise=False,
                 gradient_noise_smoothing=0.99, batch_size=0, **options):
        what = "shoal.ps.Optimizer"
        module = _module(model, what)
        kind = next((name for cls, name in _KINDS if optimizer is cls), None)
        if kind is None:
            raise _C.UsageError("%s: the optimizer is %r; expected torch.optim.SGD, Adagrad or Adam, whose rules the "
                                "servers apply" % (what, optimizer))
        tables = [(name, m._table) for name, m in module.named_modules() if isinstance(m, Embedding)]
        self._servers = _C.PsOptimizer(parameters=list(module.named_parameters()), tables=tables, kind=kind,
                                       options=dict(options), mode=mode or "", timeout=timeout,
                                       measure_gradient_noise=bool(measure_gradient_noise),
                                       gradient_noise_smoothing=gradient_noise_smoothing, batch_size=batch_size)

    def zero_grad(self):
        """Clears the dense parameters' gradients and the tables' pulled rows."""
        self._servers.zero_grad()

    def step(self):
        """Pushes this step's gradients and pulls the next step's values (sync: after every
        worker's push of this step is applied). CommError when a server does not answer in time."""
        self._servers.step()

    def train_on(self, loader):
        """From now on the loader's batches are leased from the servers' ledger: each epoch's
        samples are trained once over all workers, whatever their speed; a worker with nothing left
        gets a batch of 0 rows (its step is idle). One step() per batch; the loader reads each
        batch when the step before it is done (no loader processes)."""
        sampler = getattr(loader, "sampler", loader)
        if not hasattr(sampler, "_sampler"):
            raise _C.UsageError("shoal.ps.Optimizer.train_on: the loader is a %s; expected a shoal.data.DataLoader"
                                % type(loader).__name__)
        self._servers.train_on(sampler._sampler)

    def steps(self):
        """Steps this worker has pushed."""
        return self._servers.steps()

    def staleness(self):
        """The fastest worker's step count minus the slowest's at the last pull (0 in sync)."""
        return self._servers.staleness()

    @property
    def gradient_noise(self):
        """The gradient noise measured so far (measure_gradient_noise=True), a shoal.GradientNoise
        as DataParallel's; None when not measured. Steps of one worker alone are not measured."""
        return self._servers.gradient_noise()
