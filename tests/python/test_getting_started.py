"""docs/python.md's two-line change (examples/getting_started/pytorch_plain.py to
pytorch_shoal.py), counted as tests/getting_started_test.cpp counts the C++ one and PyTorch DDP's
(9 added, 3 changed) and Horovod's documented recipe (8 added, 2 changed): two lines added, three
changed; and the shoal form on 3 workers ends, after an epoch of
Fashion-MNIST, where it ends on one process (relative 1e-4, as the C++ program's test)."""
import gzip
import os

import pytest
import torch

from jobs import HERE, run_job

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples", "getting_started")
FASHION_MNIST = "/usr/share/datasets/fashion-mnist"


def code_lines(path):
    """The file's lines without its leading comment block (which says what the file is)."""
    lines = open(path).read().split("\n")
    while lines and lines[0].startswith("#"):
        lines.pop(0)
    return lines


def lines_not_kept(a, b):
    """Lines of `b` not in a longest common subsequence with `a`: what was added or changed."""
    common = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
    for i in range(len(a) - 1, -1, -1):
        for j in range(len(b) - 1, -1, -1):
            common[i][j] = common[i + 1][j + 1] + 1 if a[i] == b[j] else max(common[i + 1][j], common[i][j + 1])
    return len(b) - common[0][0]


def test_the_shoal_form_adds_two_lines_and_changes_three():
    plain = code_lines(os.path.join(EXAMPLES, "pytorch_plain.py"))
    shoal_form = code_lines(os.path.join(EXAMPLES, "pytorch_shoal.py"))
    assert len(plain) > 20
    assert (len(shoal_form) - len(plain), lines_not_kept(shoal_form, plain), lines_not_kept(plain, shoal_form)) == (2, 3, 5)
    # Horovod's documented recipe on the same program (pytorch_horovod.py: not run, as Debian has
    # no Horovod): init, the GPU pin, the sampler and its set_epoch, the optimizer's wrapper, two
    # broadcasts; the loader and the save changed.
    horovod = code_lines(os.path.join(EXAMPLES, "pytorch_horovod.py"))
    assert (len(horovod) - len(plain), lines_not_kept(horovod, plain), lines_not_kept(plain, horovod)) == (8, 2, 10)


@pytest.mark.skipif(not os.path.exists(FASHION_MNIST), reason="Fashion-MNIST is not installed")
def test_three_workers_end_where_one_process_ends(tmp_path):
    for name in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"):
        with gzip.open(os.path.join(FASHION_MNIST, name + ".gz")) as f:
            (tmp_path / name).write_bytes(f.read())
    program = os.path.join(EXAMPLES, "pytorch_shoal.py")
    run_job(1, program, tmp_path, tmp_path / "one.pt", 1)
    run_job(3, program, tmp_path, tmp_path / "three.pt", 1)
    one, three = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "three.pt")
    assert list(one) == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    diff = max(float((one[k] - three[k]).abs().max()) for k in one)
    scale = max(float(one[k].abs().max()) for k in one)
    assert diff / scale < 1e-4  # 938 steps of SGD; only the order of summation differs
