"""shoal.save and shoal.load from Python, against their oracles: a checkpoint written by the C++
program (tests/programs/checkpoint_interop.cpp) on 2 workers, in the middle of an epoch, is
continued by the same program in Python (checkpoint_worker.py) on 3 workers, with torch's loader
processes reading ahead, to the parameters, the Adam state and the data position that the C++
program reaches without a break on one process; and the other way round; and so with a batch
norm's buffers on one process (its statistics are each worker's). Every optimizer shoal
knows keeps its state through a file. Bad input raises UsageError with its one line and changes
nothing: not the model, not the optimizer, not the loader's position, not the file on disk."""
import os

import pytest
import torch

import checkpoint_worker as worker
import shoal
from jobs import run_job

FIRST, STEPS = 3, 10  # 4 global batches an epoch: the break is mid-epoch, and the rest crosses one
SINGLE = shoal.comm.Group.single()  # this test's own process reads the files, outside any job


def net(norm="batchnorm"):
    return worker.make_net(norm)


def read(path, norm):
    model = net(norm)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    loader = shoal.data.DataLoader(worker.dataset(), batch_size=12, shuffle=True, seed=7)
    extras = shoal.load(path, model, optimizer, loader, group=SINGLE)
    return model, optimizer, loader, extras


def assert_same_training(path, reference, norm):
    model, optimizer, loader, extras = read(path, norm)
    ref_model, ref_optimizer, ref_loader, ref_extras = read(reference, norm)
    assert int(extras["step"]) == int(ref_extras["step"]) == STEPS
    assert (loader.sampler.epoch, loader.sampler.cursor) == (ref_loader.sampler.epoch, ref_loader.sampler.cursor) == (2, 24)
    state, ref_state = model.state_dict(), ref_model.state_dict()
    assert list(state) == list(ref_state)
    for name in state:
        torch.testing.assert_close(state[name], ref_state[name], rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        mine, theirs = optimizer.state[p], ref_optimizer.state[q]
        assert sorted(mine) == sorted(theirs) == ["exp_avg", "exp_avg_sq", "step"]
        assert float(mine["step"]) == float(theirs["step"]) == STEPS
        for field in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(mine[field], theirs[field], rtol=1e-4, atol=1e-7)


# (model, workers before the break, workers after it)
RUNS = [("layernorm", 2, 3), ("batchnorm", 1, 1)]


@pytest.mark.parametrize("norm,before,after", RUNS, ids=["layernorm-2-then-3", "batchnorm-1"])
def test_a_cpp_checkpoint_continues_in_python(tmp_path, norm, before, after):
    first, resumed, reference = tmp_path / "cpp.pt", tmp_path / "python.pt", tmp_path / "reference.pt"
    run_job(before, "checkpoint_interop", norm, FIRST, first)
    run_job(after, "checkpoint_worker.py", norm, STEPS, resumed, first)
    run_job(1, "checkpoint_interop", norm, STEPS, reference)
    assert_same_training(resumed, reference, norm)


@pytest.mark.parametrize("norm,before,after", RUNS, ids=["layernorm-2-then-3", "batchnorm-1"])
def test_a_python_checkpoint_continues_in_cpp(tmp_path, norm, before, after):
    first, resumed, reference = tmp_path / "python.pt", tmp_path / "cpp.pt", tmp_path / "reference.pt"
    run_job(before, "checkpoint_worker.py", norm, FIRST, first)
    run_job(after, "checkpoint_interop", norm, STEPS, resumed, first)
    run_job(1, "checkpoint_worker.py", norm, STEPS, reference)
    assert_same_training(resumed, reference, norm)


def train(model, optimizer, steps=3):
    x = torch.linspace(-1, 1, 64).reshape(16, 4)
    for _ in range(steps):
        optimizer.zero_grad()
        (model(x) - x.sum(1, keepdim=True)).pow(2).mean().backward()
        optimizer.step()


OPTIMIZERS = [
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True)),
    (torch.optim.SGD, dict(lr=0.1)),
    (torch.optim.Adam, dict(lr=0.01, amsgrad=True)),
    (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1)),
    (torch.optim.Adagrad, dict(lr=0.1, initial_accumulator_value=0.5)),
    (torch.optim.RMSprop, dict(lr=0.01, momentum=0.5, centered=True)),
]


@pytest.mark.parametrize("kind,options", OPTIMIZERS, ids=["sgd-nesterov", "sgd", "adam-amsgrad", "adamw", "adagrad", "rmsprop"])
def test_every_optimizer_continues_as_if_never_stopped(tmp_path, kind, options):
    torch.manual_seed(1)
    model, path = net(), tmp_path / "c.pt"
    optimizer = kind(model.parameters(), **options)
    train(model, optimizer)
    shoal.save(path, model, optimizer, group=SINGLE)
    resumed = net()
    resumed_optimizer = kind(resumed.parameters(), **options)
    shoal.load(path, resumed, resumed_optimizer, group=SINGLE)
    train(model, optimizer)
    train(resumed, resumed_optimizer)
    for (name, a), b in zip(model.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name


def snapshot(model, optimizer, loader):
    return ({k: v.clone() for k, v in model.state_dict().items()},
            {id(p): {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
             for p, s in optimizer.state.items()},
            (loader.sampler.epoch, loader.sampler.cursor))


def assert_unchanged(before, model, optimizer, loader):
    params, state, position = before
    now_params, now_state, now_position = snapshot(model, optimizer, loader)
    assert position == now_position
    assert params.keys() == now_params.keys() and all(torch.equal(params[k], now_params[k]) for k in params)
    assert state.keys() == now_state.keys()
    for p in state:
        assert state[p].keys() == now_state[p].keys()
        assert all(torch.equal(v, now_state[p][k]) if isinstance(v, torch.Tensor) else v == now_state[p][k]
                   for k, v in state[p].items())


@pytest.fixture
def saved(tmp_path):
    torch.manual_seed(2)
    model = net()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    loader = shoal.data.DataLoader(worker.dataset(), batch_size=12, seed=7)
    train(model, optimizer)
    loader.sampler._sampler.advance()
    path = tmp_path / "c.pt"
    shoal.save(path, model, optimizer, loader, extras={"step": torch.tensor(3)}, group=SINGLE)
    return path


def refused(path, model, optimizer=None, loader=None):
    """Loads into a model that has trained a step (so it has state to lose) and returns the one
    line of its UsageError, checking that nothing changed."""
    optimizer = optimizer or torch.optim.Adam(model.parameters(), lr=0.01)
    loader = loader or shoal.data.DataLoader(worker.dataset(), batch_size=12, seed=7)
    train(model, optimizer, steps=1)
    before = snapshot(model, optimizer, loader)
    with pytest.raises(shoal.UsageError) as raised:
        shoal.load(path, model, optimizer, loader, group=SINGLE)
    assert_unchanged(before, model, optimizer, loader)
    assert "\n" not in str(raised.value)
    return str(raised.value)


def test_a_model_of_other_shapes_is_refused_with_nothing_changed(saved):
    wider = torch.nn.Sequential(torch.nn.Linear(4, 9), torch.nn.BatchNorm1d(9), torch.nn.ReLU(), torch.nn.Linear(9, 1))
    assert refused(saved, wider) == (
        "checkpoint %s: parameter '0.weight' has shape [8, 4] in the file but [9, 4] in the module; "
        "expected a checkpoint of this model" % saved)


def test_a_model_without_a_layer_of_the_file_is_refused(saved):
    shorter = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU())
    assert "the file has '3', which the module does not" in refused(saved, shorter)


def test_an_optimizer_of_another_type_is_refused(saved):
    model = net()
    message = refused(saved, model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    assert "torch::optim::Adam" in message and "torch::optim::SGD" in message, message


def test_a_loader_over_other_data_is_refused(saved):
    other = shoal.data.DataLoader(list(range(50)), batch_size=12, seed=7)
    assert refused(saved, net(), loader=other).endswith(
        ": Sampler: the state was saved for a dataset of 48 samples; this one has 50")


def test_a_damaged_file_is_refused(saved, tmp_path):
    damaged = tmp_path / "damaged.pt"
    data = bytearray(saved.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    assert "corrupt" in refused(damaged, net())
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(saved.read_bytes()[:100])
    assert "truncated" in refused(truncated, net())


def test_bad_arguments_are_refused_before_anything_is_written(tmp_path):
    model = net()
    path = tmp_path / "c.pt"
    cases = [
        (lambda: shoal.save(path, "a model", group=SINGLE),
         "shoal.save: the model is a str; expected a torch.nn.Module or shoal.DataParallel"),
        (lambda: shoal.save(path, model, torch.optim.LBFGS(model.parameters()), group=SINGLE),
         "shoal.save: the optimizer is torch.optim.lbfgs.LBFGS; expected torch.optim.SGD, Adam, AdamW, Adagrad or "
         "RMSprop, whose state shoal saves"),
        (lambda: shoal.save(path, model, torch.optim.SGD(net().parameters(), lr=0.1), group=SINGLE),
         "shoal.save: the optimizer holds a tensor of shape [8, 4] that is not a parameter of the model; expected an "
         "optimizer over the model's parameters"),
        (lambda: shoal.save(path, model, loader=shoal.data.DataLoader(list(range(8)), batch_size=4), group=SINGLE),
         "shoal.save: a loader was given without an optimizer; expected both, or neither (a checkpoint that resumes "
         "the data resumes the optimizer too)"),
        (lambda: shoal.save(path, model, extras={"lr": 0.01}, group=SINGLE),
         "shoal.save: extras['lr'] is a float; expected str keys and torch.Tensor values (torch.tensor(0.01))"),
        (lambda: shoal.save(path, model, torch.optim.SGD(model.parameters(), lr=0.1),
                            torch.utils.data.DataLoader(list(range(8))), group=SINGLE),
         "shoal.save: the loader is a DataLoader; expected a shoal.data.DataLoader or shoal.data.Sampler (a torch "
         "DataLoader's position is not known to shoal)"),
    ]
    for call, message in cases:
        with pytest.raises(shoal.UsageError) as raised:
            call()
        assert str(raised.value) == message
    missing = tmp_path / "no" / "c.pt"
    with pytest.raises(shoal.UsageError) as raised:
        shoal.save(missing, model, group=SINGLE)
    assert str(raised.value).startswith("checkpoint %s: cannot create %s.tmp-" % (missing, missing))
    assert sorted(os.listdir(tmp_path)) == []
