"""examples/python/ against the C++ examples they are written from: the Fashion-MNIST demo in
Python prints the C++ demo's losses and test accuracies line for line on 2 workers (the same model,
initial weights, global batches and learning rates), and resumes the C++ demo's checkpoint on 3
workers to the same lines as the C++ demo resuming it; the elastic example, in an elastic job of
2 workers, ends at the C++ one's test accuracy and parameter checksum; the GPT on global tensors
prints the C++ one's losses in the tensor plan, in a pipeline under ZB-H1 and in the 3-D plan on 8
workers, and a checkpoint relayed C++ -> Python -> C++
across three plans trains to the losses of one process that never stopped; the CTR example on a parameter server
prints the C++ one's train and test loglosses and AUC."""
import os
import re

import pytest

from jobs import HERE, run_job

EXAMPLES_CPP = os.environ.get("SHOAL_EXAMPLES", "")  # the C++ examples' binaries
DEMO_CPP = os.path.join(EXAMPLES_CPP, "fashion_mnist")
EXAMPLES_PYTHON = os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples", "python")
DEMO_PYTHON = os.path.join(EXAMPLES_PYTHON, "fashion_mnist.py")


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


@pytest.mark.skipif(not os.path.exists(DEMO_CPP), reason="the build has no examples (no Fashion-MNIST)")
def test_the_elastic_example_ends_where_the_cpp_one_ends():
    flags = ["--limit", "1200", "--epochs", "2"]
    elastic = ["--min", "1", "--max", "2"]
    cpp = run_job(2, os.path.join(EXAMPLES_CPP, "elastic_fashion_mnist"), *flags, flags=elastic)
    python = run_job(2, os.path.join(EXAMPLES_PYTHON, "elastic_fashion_mnist.py"), *flags, flags=elastic)
    end = re.compile(r"after (\d+) steps: test accuracy ([0-9.]+), parameter checksum ([0-9.]+)")
    assert end.findall(cpp) and end.findall(python) == end.findall(cpp), (cpp, python)



def losses(out):
    return [(int(s), float(v)) for s, v in re.findall(r"step (\d+) loss ([0-9.]+)", out)]


@pytest.mark.skipif(not os.path.exists(os.path.join(EXAMPLES_CPP, "global_gpt")), reason="the build has no examples")
def test_the_gpt_on_global_tensors_trains_as_the_cpp_one_and_relays_its_checkpoint(tmp_path):
    cpp_gpt, python_gpt = os.path.join(EXAMPLES_CPP, "global_gpt"), os.path.join(EXAMPLES_PYTHON, "global_gpt.py")
    # The tensor plan on 2 workers, dropout on: the same losses to the 9 digits printed.
    cpp = losses(run_job(2, cpp_gpt, "--plan", "tensor", "--steps", "4"))
    assert len(cpp) == 4 and losses(run_job(2, python_gpt, "--plan", "tensor", "--steps", "4")) == cpp
    # A pipeline of global layers: Python's own layers (Embed, Head) and C++'s blocks, in stages,
    # under ZB-H1 on 2 workers, and in the 3-D plan (2 stages x 2 data x 2 tensor) on 8.
    for workers, plan in ((2, "pipeline"), (8, "3d")):
        flags = ["--plan", plan, "--schedule", "zb", "--steps", "2"]
        cpp = losses(run_job(workers, cpp_gpt, *flags))
        assert len(cpp) == 2 and losses(run_job(workers, python_gpt, *flags)) == cpp, plan
    # Three steps in C++ (tensor plan), two in Python (2 x 1 hybrid), one in C++ (data plan), each
    # from the one before's checkpoint: the six steps of one process that never stopped (without
    # dropout, whose masks a resumed run draws anew).
    first, second = tmp_path / "first.ckpt", tmp_path / "second.ckpt"
    relay = losses(run_job(2, cpp_gpt, "--plan", "tensor", "--dropout", "0", "--steps", "3", "--checkpoint", first))
    relay += losses(run_job(2, python_gpt, "--plan", "hybrid", "--dropout", "0", "--steps", "2", "--resume", first,
                            "--checkpoint", second))
    relay += losses(run_job(2, cpp_gpt, "--plan", "data", "--dropout", "0", "--steps", "1", "--resume", second))
    alone = losses(run_job(1, python_gpt, "--plan", "one", "--dropout", "0", "--steps", "6"))
    assert [s for s, _ in relay] == [s for s, _ in alone] == [1, 2, 3, 4, 5, 6]
    for (_, a), (_, b) in zip(relay, alone):
        assert abs(a - b) <= 1e-6 * b, (relay, alone)


@pytest.mark.skipif(not os.path.exists(os.path.join(EXAMPLES_CPP, "ctr")), reason="the build has no examples")
def test_the_ctr_example_on_servers_ends_as_the_cpp_one():
    flags = ["--samples", "20000", "--test-samples", "4000", "--reports", "2"]
    figures = re.compile(r"train logloss ([0-9.]+)|test logloss ([0-9.]+) \(Bayes ([0-9.]+)\)  AUC ([0-9.]+)")
    cpp = figures.findall(run_job(2, os.path.join(EXAMPLES_CPP, "ctr"), *flags, servers=1))
    python = figures.findall(run_job(2, os.path.join(EXAMPLES_PYTHON, "ctr.py"), *flags, servers=1))
    assert len(cpp) == 3 and python == cpp
