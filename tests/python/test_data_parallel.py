"""shoal.DataParallel from Python against its oracle: a plain PyTorch program and its shoal form
(tests/python/dp_worker.py, started by `shoal run`) end at the one-process parameters on 1, 2 and
3 workers (64 rows over 3 workers are uneven shares: 22, 21, 21); a model that differs across
workers is a shoal.UsageError naming the difference on every worker, within a deadline. Gradients
accumulated over two backwards, the first under no_sync(), with uneven halves, are those of one
process accumulating the same two batches (the oracle cannot tell whether the first backward
communicated: averaging is linear; the C++ tests count that)."""
import subprocess
import sys

import pytest
import torch

import shoal

import dp_program as program

from jobs import DEADLINE, run_job


def test_the_package_is_the_build_trees():
    assert shoal.DataParallel is not None
    assert issubclass(shoal.UsageError, shoal.Error) and issubclass(shoal.CommError, shoal.Error)


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_gives_the_one_process_parameters(tmp_path, workers):
    out = tmp_path / "params.pt"
    run_job(workers, "dp_worker.py", out, "train")
    got = torch.load(out)["params"]
    want = program.train_alone()["params"]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        # relative 1e-5, as the C++ oracles
        assert torch.allclose(g, w, rtol=1e-5, atol=1e-6), (g - w).abs().max()
    # The oracle tells: the start every worker but the first was given is not where training went.
    assert not torch.allclose(got[0], program.model()[0].weight.detach() + 1.0)


@pytest.mark.parametrize("workers", [2, 3])
def test_accumulating_under_no_sync_gives_the_one_process_gradient(tmp_path, workers):
    out = tmp_path / "params.pt"
    run_job(workers, "dp_worker.py", out, "no_sync")
    got = torch.load(out)["params"]
    want = program.train_alone(accumulated_over=workers)["params"]
    for g, w in zip(got, want):
        assert torch.allclose(g, w, rtol=1e-5, atol=1e-6), (g - w).abs().max()
    # Accumulation is not the whole batch's mean: the oracle tells the two apart.
    assert not torch.allclose(got[0], program.train_alone()["params"][0], rtol=1e-5, atol=1e-6)


def test_the_fp16_hook_averages_in_half_precision(tmp_path):
    out = tmp_path / "params.pt"
    run_job(3, "dp_worker.py", out, "fp16")
    got = torch.load(out)["params"]
    want = program.train_alone()["params"]
    exact = tmp_path / "exact.pt"
    run_job(3, "dp_worker.py", exact, "train")
    exact = torch.load(exact)["params"]
    for g, w, e in zip(got, want, exact):
        # Half precision's rounding, not more; and not the exact run's values, which it would be if
        # the hook were not used.
        assert torch.allclose(g, w, rtol=1e-2, atol=1e-3), (g - w).abs().max()
    assert any(not torch.equal(g, e) for g, e in zip(got, exact))


def test_unused_parameters_keep_no_gradient_as_on_one_process(tmp_path):
    out = tmp_path / "params.pt"
    run_job(2, "dp_worker.py", out, "unused")
    got = torch.load(out)
    want = program.train_alone(case="unused")
    assert got["grad_is_none"] == want["grad_is_none"] == [False] * 4 + [True] * 2
    for g, w in zip(got["params"], want["params"]):
        assert torch.allclose(g, w, rtol=1e-5, atol=1e-6), (g - w).abs().max()


def test_a_model_that_differs_is_a_usage_error_on_every_worker(tmp_path):
    out = tmp_path / "error"
    run_job(2, "dp_worker.py", out, "differ")
    messages = [(tmp_path / ("error.%d" % r)).read_text() for r in range(2)]
    assert messages[0] == messages[1]
    assert messages[0].startswith("DataParallel: the model differs across workers: parameter '0.weight' has "
                                  "shape [8, 5] (Float) on worker 0 but [9, 5] (Float) on worker 1"), messages[0]
    assert "\n" not in messages[0]


def test_a_peer_lost_in_backward_is_a_comm_error(tmp_path):
    # DataParallel's hooks raise inside PyTorch's autograd engine; loss.backward() gives the
    # program shoal.CommError with shoal's one line, as a collective would, not a RuntimeError.
    out = tmp_path / "error"
    run_job(2, "dp_worker.py", out, "lost")
    message = out.read_text()
    assert message.startswith("CommError at step 2: "), message
    assert "\n" not in message


@pytest.mark.parametrize("workers", [2, 3])
def test_the_gradient_noise_is_the_one_process_estimate(tmp_path, workers):
    # At every step of training, on even (2) and uneven (3: 22, 21, 21 rows) shares.
    out = tmp_path / "noise.pt"
    run_job(workers, "dp_worker.py", out, "noise")
    saved = torch.load(out)
    assert len(saved["measured"]) == program.STEPS
    for step, ((measurements, batch, sqr, variance), (want_sqr, want_variance)) in enumerate(
            zip(saved["measured"], saved["oracle"])):
        assert (measurements, batch) == (step + 1, 64)
        scale = abs(want_sqr) + want_variance / 32
        assert abs(sqr - want_sqr) <= 1e-4 * scale, (step, sqr, want_sqr)
        assert abs(variance - want_variance) <= 1e-4 * scale * 64, (step, variance, want_variance)


def test_init_twice_is_a_usage_error():
    # In a process of its own, as every program: a job of one.
    code = ("import shoal\nshoal.init()\ntry:\n    shoal.init()\nexcept shoal.UsageError as e:\n"
            "    print('UsageError:', e)\n")
    result = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            timeout=DEADLINE, text=True)
    assert result.returncode == 0, result.stdout
    assert result.stdout.startswith("UsageError: shoal::init"), result.stdout
