"""shoal.data: each worker's share of every global batch, for torch.utils.data (docs/data.md,
docs/python.md).

    loader = shoal.data.DataLoader(dataset, batch_size=64, shuffle=True, num_workers=2)
    for epoch in range(loader.sampler.epoch, 10):
        for x, y in loader.epoch(epoch):     # this worker's share of each global batch of 64
            ...
    state = loader.state_dict()              # where the job stands: the batch after the last one
    loader.load_state_dict(state)            # handed out, on any number of workers

`batch_size` is the GLOBAL batch, cut among the workers (64 over 3: 22, 21, 21), as shoal's C++
loader cuts it; per_worker=True makes it each worker's. The order is one permutation of the
dataset per epoch, the same on every worker, a pure function of (seed, epoch)."""
import collections

import torch

from . import _C

LastBatch = _C.LastBatch

_LAST_BATCH = {"keep": _C.LastBatch.KEEP, "drop": _C.LastBatch.DROP, "pad": _C.LastBatch.PAD}


class Sampler:
    """Where the job stands in the data (shoal::data::Sampler): the epoch, and the cursor, the
    positions of the epoch's permutation that global batches handed out have consumed. A
    DataLoader's `sampler`; state_dict() / load_state_dict() are its checkpoint (tensors, for
    torch.save). Needs shoal.init()."""

    def __init__(self, dataset_size, batch_size, shuffle=False, seed=0, last_batch="keep", per_worker=False):
        if last_batch not in _LAST_BATCH:
            raise _C.UsageError("Sampler: last_batch %r; expected one of %s" % (last_batch, ", ".join(_LAST_BATCH)))
        self._sampler = _C.Sampler(dataset_size=dataset_size, batch_size=batch_size, shuffle=bool(shuffle),
                                   last_batch=_LAST_BATCH[last_batch], per_worker=bool(per_worker), seed=seed)

    epoch = property(lambda self: self._sampler.epoch)
    cursor = property(lambda self: self._sampler.cursor)

    def set_epoch(self, epoch):
        self._sampler.set_epoch(epoch)

    def set_batch_size(self, batch_size):
        """From the next batch on, batches of batch_size (global, or each worker's when
        per_worker); a DataLoader drops what it read ahead at the old size."""
        self._sampler.set_batch_size(batch_size)

    def batches_per_epoch(self):
        return self._sampler.batches_per_epoch()

    def batches_remaining(self):
        return self._sampler.batches_remaining()

    def state_dict(self):
        return self._sampler.state_dict()

    def load_state_dict(self, state):
        """Restores the epoch and the cursor, saved on any number of workers. UsageError, with
        nothing changed, for a state of another dataset size, seed or shuffle."""
        self._sampler.load_state_dict(dict(state))


class _Shares(torch.utils.data.Sampler):
    """The batch sampler a torch DataLoader reads: this worker's indices of each global batch from
    the cursor on, read from a copy of the sampler, so that the DataLoader may read ahead (its
    workers prefetch) while the sampler itself moves only as batches are handed out. A share of 0
    rows (a last batch smaller than the world) is asked for as the global batch's first index and
    marked, to be handed out as that batch with 0 rows."""

    def __init__(self, sampler):
        super().__init__(None)
        self._ahead = sampler.copy()
        self.empty = collections.deque()  # per batch read, in order: whether its share is empty

    def __iter__(self):
        while not self._ahead.epoch_done():
            indices = list(self._ahead.batch())
            self.empty.append(not indices)
            if not indices:
                # Some index of this batch, for its shapes; the rows are dropped when handed out.
                indices = [_first_index(self._ahead)]
            self._ahead.advance()
            yield indices

    def __len__(self):
        return self._ahead.batches_remaining()


def _first_index(sampler):
    # The first index of the whole global batch at the cursor, as a job of one would take it.
    probe = sampler.copy()
    probe.reshard(0, 1)
    return probe.batch()[0]


def _no_rows(batch):
    """`batch` with 0 rows: every tensor cut to [:0] along dim 0, through tuples, lists and dicts."""
    if isinstance(batch, torch.Tensor):
        return batch[:0]
    if isinstance(batch, dict):
        return type(batch)((k, _no_rows(v)) for k, v in batch.items())
    if isinstance(batch, (list, tuple)):
        cut = [_no_rows(v) for v in batch]
        return type(batch)(*cut) if hasattr(batch, "_fields") else type(batch)(cut)
    return batch


class DataLoader:
    """A torch.utils.data.DataLoader over this worker's share of every global batch. Keyword
    arguments beyond shoal's (num_workers, collate_fn, pin_memory, prefetch_factor, ...) are
    torch's. The sampler's cursor moves as each batch is handed out, not as torch's workers read
    ahead, so state_dict() after a step resumes at exactly the next batch. A worker whose share
    of a batch is 0 rows (a last batch smaller than the world) gets that batch with 0 rows: its
    forward still counts in DataParallel's weighing, as every worker's must."""

    def __init__(self, dataset, batch_size, shuffle=False, seed=0, last_batch="keep", per_worker=False, **torch_kwargs):
        for refused in ("batch_sampler", "sampler", "shuffle", "drop_last"):
            if refused in torch_kwargs:
                raise _C.UsageError("DataLoader: %s is shoal's to set; expected batch_size, shuffle, seed, last_batch "
                                    "and per_worker" % refused)
        self.dataset = dataset
        self.sampler = Sampler(len(dataset), batch_size, shuffle, seed, last_batch, per_worker)
        self._torch_kwargs = torch_kwargs

    def epoch(self, epoch):
        """The batches of `epoch` from its start, or from the restored cursor when the sampler was
        just restored to that epoch."""
        self.sampler.set_epoch(epoch)
        return self._batches()

    def __iter__(self):
        """The rest of the current epoch; once it is done, the next epoch (so that a plain
        `for epoch ...: for batch in loader:` loop takes one epoch per pass, as with torch's
        loaders; sampler.set_epoch(e) before it starts epoch e)."""
        if self.sampler._sampler.epoch_done():
            self.sampler.set_epoch(self.sampler.epoch + 1)
        return self._batches()

    def __len__(self):
        return self.sampler.batches_per_epoch()

    def state_dict(self):
        return self.sampler.state_dict()

    def load_state_dict(self, state):
        self.sampler.load_state_dict(state)

    def _batches(self):
        if self.sampler._sampler.leased():
            return self._leased_batches()
        return self._shared_batches()

    def _leased_batches(self):
        # Each lease is taken when the step before it is done (shoal.ps.Optimizer.train_on): read
        # here, one at a time, as torch's loader would in its own process.
        if self._torch_kwargs.get("num_workers", 0):
            raise _C.UsageError("DataLoader: batches leased from the servers (shoal.ps.Optimizer.train_on) are read "
                                "one at a time, each when the step before it is done; expected num_workers=0")
        collate = self._torch_kwargs.get("collate_fn") or torch.utils.data.default_collate
        sampler = self.sampler._sampler
        while not sampler.epoch_done():
            indices = list(sampler.batch())
            batch = collate([self.dataset[i] for i in indices or [0]])  # an idle step: 0 rows
            sampler.advance()
            yield batch if indices else _no_rows(batch)

    def _shared_batches(self):
        # torch's loader reads ahead from a copy of the sampler. When the batch size changes (an
        # elastic job's BatchPolicy.goodput sets it at a commit), what it read ahead is of the old
        # size: it is dropped and a new loader reads from the cursor, which moved by the batches
        # handed out only.
        sampler = self.sampler._sampler
        while not sampler.epoch_done():
            shares = _Shares(sampler)
            size = sampler.global_batch_size()
            loader = iter(torch.utils.data.DataLoader(self.dataset, batch_sampler=shares, **self._torch_kwargs))
            for batch in loader:
                empty = shares.empty.popleft()
                sampler.advance()
                yield _no_rows(batch) if empty else batch
                if sampler.global_batch_size() != size:
                    break
            del loader  # its workers end here, not when the generator is collected
