"""Starting a job of the tests' worker programs under `shoal run`, with a deadline."""
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SHOAL = os.environ.get("SHOAL_BIN", "shoal")
DEADLINE = 120  # seconds a job may take, start to end


PROGRAMS = os.environ.get("SHOAL_TEST_PROGRAMS", "")  # the tests' C++ programs (tests/programs/)


def run_job(workers, program, *args):
    """`shoal run -n WORKERS python3 PROGRAM ARGS...` for a PROGRAM.py of this folder, else
    `shoal run -n WORKERS PROGRAM ARGS...` for one of the tests' C++ programs; returns its output,
    asserting it succeeded."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [HERE, env.get("PYTHONPATH", "")] if p)
    env["SHOAL_TIMEOUT"] = "60"
    if program.endswith(".py"):
        command = [sys.executable, os.path.join(HERE, program)]
    else:
        command = [os.path.join(PROGRAMS, program)]
    result = subprocess.run([SHOAL, "run", "-n", str(workers)] + command + [str(a) for a in args],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=DEADLINE, text=True)
    assert result.returncode == 0, result.stdout
    return result.stdout
