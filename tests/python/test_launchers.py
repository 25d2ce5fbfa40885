"""A Python program is started as a C++ one is: under Open MPI's mpirun and under torchrun, with
no launcher flag of shoal's, shoal.init() finds the job from the launcher's variables (the C++
shoal::init's code) and every worker knows its rank, the world and its local rank, and all-reduces
with the others."""
import os
import re
import shutil
import subprocess
import sys

import pytest

from jobs import DEADLINE, HERE, job_env

WORKER = os.path.join(HERE, "launched_worker.py")


def launched(command):
    result = subprocess.run(command, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            timeout=DEADLINE)
    assert result.returncode == 0, result.stdout
    found = re.findall(r"launched rank=(\d+) world=(\d+) local=(\d+) sum=(\d+)", result.stdout)
    return sorted(tuple(int(v) for v in f) for f in found), result.stdout


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun is not installed (scripts/setup.sh installs it)")
def test_mpirun_starts_a_python_program():
    found, out = launched(["mpirun", "--allow-run-as-root", "--oversubscribe", "-n", "3", sys.executable, WORKER])
    assert found == [(0, 3, 0, 6), (1, 3, 1, 6), (2, 3, 2, 6)], out


def test_torchrun_starts_a_python_program(tmp_path):
    # Debian 12's torchrun crashes at start on Python 3.11 unless its redirects are given.
    found, out = launched([sys.executable, "-m", "torch.distributed.run", "--redirects=2", "--tee=2",
                           "--log_dir=%s" % tmp_path, "--nproc_per_node", "2", WORKER])
    assert found == [(0, 2, 0, 3), (1, 2, 1, 3)], out
