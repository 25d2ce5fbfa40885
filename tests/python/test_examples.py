"""examples/python/ against the C++ examples they are written from: the Fashion-MNIST demo in
Python prints the C++ demo's losses and test accuracies line for line on 2 workers (the same model,
initial weights, global batches and learning rates), and resumes the C++ demo's checkpoint on 3
workers to the same lines as the C++ demo resuming it."""
import os
import re

import pytest

from jobs import HERE, run_job

DEMO_CPP = os.path.join(os.environ.get("SHOAL_EXAMPLES", ""), "fashion_mnist")  # the C++ examples' binaries
DEMO_PYTHON = os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples", "python", "fashion_mnist.py")


def results(out):
    """The lines that depend on the training alone: each quarter's mean loss, each epoch's accuracy."""
    losses = re.findall(r"epoch (\d+/\d+) \[.*\] +(\d+)%.*loss ([0-9.]+)", out)
    accuracies = re.findall(r"epoch (\d+/\d+): test accuracy ([0-9.]+)%", out)
    assert losses and accuracies, out
    return losses, accuracies


@pytest.mark.skipif(not os.path.exists(DEMO_CPP), reason="the build has no examples (no Fashion-MNIST)")
def test_the_python_demo_trains_as_the_cpp_demo_and_resumes_its_checkpoint(tmp_path):
    flags = ["--limit", "2000", "--epochs", "2"]
    cpp = run_job(2, DEMO_CPP, *flags, "--checkpoint", tmp_path / "cpp.ckpt")
    python = run_job(2, DEMO_PYTHON, *flags, "--checkpoint", tmp_path / "python.ckpt")
    assert results(python) == results(cpp)
    # A third epoch from the C++ demo's checkpoint, on 3 workers, in each language.
    cpp_resumed = run_job(3, DEMO_CPP, "--limit", "2000", "--epochs", "3", "--resume", "--checkpoint",
                          tmp_path / "cpp.ckpt")
    python_resumed = run_job(3, DEMO_PYTHON, "--limit", "2000", "--epochs", "3", "--resume", "--checkpoint",
                             tmp_path / "python.ckpt")
    assert "resumed from %s at epoch 3" % (tmp_path / "python.ckpt") in python_resumed
    assert results(python_resumed) == results(cpp_resumed)
