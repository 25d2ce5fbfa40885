"""A worker of tests/python/test_ps.py: a click model of a shoal.ps.Embedding table and a dense
layer, trained by shoal.ps.Optimizer, or, as its oracle, the same model in plain PyTorch.

    ps_worker.py OUT ps KIND [leased]      under shoal run --servers 1 -n 2: each worker its half
                                           of every global batch of 12 (or batches leased from
                                           the servers' ledger), sync
    ps_worker.py OUT reference KIND        one process, the table's rows each a
                                           torch.nn.Embedding(1, dim, sparse=True) starting from
                                           the table's first rows, torch.optim's KIND (Adam:
                                           SparseAdam for the rows), on the whole global batches:
                                           each row its own state and step, and a row out of a
                                           batch untouched, the lazy rules the servers apply

KIND is SGD, Adagrad or Adam. The first worker writes OUT (torch.save): the dense parameters, every
row of the table, and the table's first rows; with leased batches each worker also writes
OUT.RANK: the samples it trained on in each of two epochs, and the gradient noise it measured
(measurements, batch, |G|^2, tr(Sigma))."""
import sys

import torch

import shoal

ROWS, DIM, SAMPLES, BATCH, STEPS = 64, 4, 48, 12, 8
KINDS = {"SGD": (torch.optim.SGD, dict(lr=0.5)), "Adagrad": (torch.optim.Adagrad, dict(lr=0.3)),
         "Adam": (torch.optim.Adam, dict(lr=0.05))}


def dataset():
    # Two ids among the first 40 rows per sample (rows 40..63 are never touched), three features.
    i = torch.arange(SAMPLES)
    ids = torch.stack([(i * 7) % 40, (i * 13 + 5) % 40], 1)
    features = torch.stack([torch.sin(i.float() + k) for k in range(3)], 1)
    return torch.utils.data.TensorDataset(ids, features, (i % 3 == 0).float(), i)


class Net(torch.nn.Module):
    def __init__(self, table):
        super().__init__()
        self.emb = table
        self.fc = torch.nn.Linear(2 * DIM + 3, 1)

    def forward(self, ids, features):
        return self.fc(torch.cat([self.emb(ids).flatten(1), features], 1)).squeeze(1)


def model(table):
    torch.manual_seed(1)  # the same dense layer in both
    return Net(table)


def loss(net, batch):
    ids, features, labels = batch[:3]
    return torch.nn.functional.binary_cross_entropy_with_logits(net(ids, features), labels)


def first_rows():
    # The table's rows as the servers start them: a pure function of (seed, table, id), here from
    # a job of one, whose optimizer trains in-process.
    net = model(shoal.ps.Embedding(ROWS, DIM, seed=3))
    optimizer = shoal.ps.Optimizer(net, torch.optim.SGD, lr=0.1)  # noqa: F841  (the table lives while it does)
    with torch.no_grad():
        return net.emb(torch.arange(ROWS)).clone()


def with_servers(out, kind, leased):
    shoal.init()
    cls, options = KINDS[kind]
    net = model(shoal.ps.Embedding(ROWS, DIM, seed=3))
    optimizer = shoal.ps.Optimizer(net, cls, measure_gradient_noise=leased, **options)
    if leased:
        loader = shoal.data.DataLoader(dataset(), batch_size=BATCH)
        optimizer.train_on(loader)
        # The samples this worker trained on, per epoch.
        seen = [[int(i) for batch in _steps(loader, epoch, optimizer, net) for i in batch[3]] for epoch in range(2)]
        noise = optimizer.gradient_noise
        torch.save({"seen": seen, "noise": (noise.measurements, noise.batch, noise.gradient_sqr, noise.variance)},
                   "%s.%d" % (out, shoal.rank()))
    else:
        assert optimizer.gradient_noise is None  # not measured
        data = dataset().tensors
        half = BATCH // shoal.world_size()
        for step in range(STEPS):
            rows = slice((step * BATCH) % SAMPLES + shoal.rank() * half, (step * BATCH) % SAMPLES + (shoal.rank() + 1) * half)
            optimizer.zero_grad()
            loss(net, [t[rows] for t in data]).backward()
            optimizer.step()
    if shoal.is_main():
        with torch.no_grad():
            torch.save({"dense": [p.detach().clone() for p in net.fc.parameters()], "rows": net.emb(torch.arange(ROWS))}, out)


def _steps(loader, epoch, optimizer, net):
    for batch in loader.epoch(epoch):
        optimizer.zero_grad()
        if len(batch[0]):
            loss(net, batch).backward()
        optimizer.step()
        yield batch


class Rows(torch.nn.Module):
    """The table as one torch.nn.Embedding(1, dim, sparse=True) per row."""

    def __init__(self, start):
        super().__init__()
        self.rows = torch.nn.ModuleList(torch.nn.Embedding(1, DIM, sparse=True) for _ in range(ROWS))
        with torch.no_grad():
            for row, value in zip(self.rows, start):
                row.weight.copy_(value[None])

    def forward(self, ids):
        zero = torch.zeros(1, dtype=torch.long)
        return torch.cat([self.rows[int(i)](zero) for i in ids.flatten()]).reshape(*ids.shape, DIM)


def reference(out, kind):
    shoal.init()
    start = first_rows()
    table = Rows(start)
    net = model(table)
    cls, options = KINDS[kind]
    sparse = torch.optim.SparseAdam if kind == "Adam" else cls
    optimizers = [sparse(table.parameters(), **options), cls(net.fc.parameters(), **options)]
    data = dataset().tensors
    for step in range(STEPS):
        rows = slice((step * BATCH) % SAMPLES, (step * BATCH) % SAMPLES + BATCH)
        for o in optimizers:
            o.zero_grad(set_to_none=True)  # a row out of the batch has no gradient, and no step
        loss(net, [t[rows] for t in data]).backward()
        for o in optimizers:
            o.step()
    torch.save({"dense": [p.detach().clone() for p in net.fc.parameters()],
                "rows": torch.cat([r.weight.detach() for r in table.rows]), "first_rows": start}, out)


if __name__ == "__main__":
    out, how, kind = sys.argv[1:4]
    if how == "ps":
        with_servers(out, kind, leased=sys.argv[4:] == ["leased"])
    else:
        reference(out, kind)
