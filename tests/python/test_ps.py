"""shoal.ps from Python, against its oracles: a click model of a shoal.ps.Embedding table and a
dense layer, trained by shoal.ps.Optimizer on `shoal run --servers 1 -n 2` in sync, each worker
its half of every global batch, ends at the dense parameters and table rows (relative 1e-5) of one
process training the plain PyTorch model with torch.optim's SGD, Adagrad or Adam (SparseAdam for
the rows, each row its own state: the lazy rules the servers apply) on the whole batches; rows no
batch touched keep their first values bit for bit. With batches leased from the servers' ledger,
every sample of every epoch is trained on exactly once over both workers, and the gradient noise
measured through the servers is the same on both, over batches of both workers' leases. Bad input
raises UsageError with its one line."""
import pytest
import torch

import shoal
from jobs import run_job


@pytest.mark.parametrize("kind", ["SGD", "Adagrad", "Adam"])
def test_sync_training_on_servers_equals_one_process(tmp_path, kind):
    reference, trained = tmp_path / "reference.pt", tmp_path / "ps.pt"
    run_job(1, "ps_worker.py", reference, "reference", kind)
    run_job(2, "ps_worker.py", trained, "ps", kind, servers=1)
    want, got = torch.load(reference), torch.load(trained)
    for a, b in zip(got["dense"], want["dense"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got["rows"], want["rows"], rtol=1e-5, atol=1e-6)
    assert not torch.equal(want["rows"][:40], want["first_rows"][:40])  # the rows trained moved
    assert torch.equal(got["rows"][40:], want["first_rows"][40:])  # the others never did


def test_leased_batches_train_every_sample_once_per_epoch(tmp_path):
    out = tmp_path / "leased.pt"
    run_job(2, "ps_worker.py", out, "ps", "Adagrad", "leased", servers=1)
    written = [torch.load("%s.%d" % (out, rank)) for rank in range(2)]
    seen = [w["seen"] for w in written]
    for epoch in range(2):
        assert sorted(seen[0][epoch] + seen[1][epoch]) == list(range(48))
    # The noise (docs/ps.md, "Gradient noise"): the leases' rows are its samples, the global
    # batch of 12 (6 per worker's lease).
    measurements, batch, _, _ = written[0]["noise"]
    assert measurements >= 1 and batch == 12
    assert written[0]["noise"] == written[1]["noise"]


def test_bad_input_is_refused_with_one_line():
    net = torch.nn.Linear(2, 1)
    with pytest.raises(shoal.UsageError) as raised:
        shoal.ps.Optimizer(net, torch.optim.RMSprop, lr=0.1)
    assert str(raised.value) == ("shoal.ps.Optimizer: the optimizer is <class 'torch.optim.rmsprop.RMSprop'>; "
                                 "expected torch.optim.SGD, Adagrad or Adam, whose rules the servers apply")
    table = shoal.ps.Embedding(8, 2)
    assert repr(table) == "Embedding(num_embeddings=8, embedding_dim=2)"
    with pytest.raises(shoal.UsageError) as raised:
        table(torch.tensor([1, 2]))
    assert str(raised.value) == ("ps::Embedding: forward before a shoal::ps::Optimizer took the model (or after it was "
                                 "destroyed); expected the optimizer made first, as its rows live on the servers")
    with pytest.raises(shoal.UsageError) as raised:
        shoal.ps.Embedding(8, 0)
    assert str(raised.value) == "ps::Embedding(8, 0); expected num_embeddings >= 0 (0: any id) and embedding_dim >= 1"
    with pytest.raises(shoal.UsageError) as raised:
        shoal.ps.Embedding(8, 2, init="ones")
    assert str(raised.value) == "shoal.ps.Embedding: init 'ones'; expected one of zeros, uniform, normal"
