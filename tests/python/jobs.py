"""Starting a job of the tests' worker programs under `shoal run`, with a deadline."""
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SHOAL = os.environ.get("SHOAL_BIN", "shoal")
DEADLINE = 120  # seconds a job may take, start to end


def run_job(workers, program, *args):
    """`shoal run -n WORKERS python3 PROGRAM ARGS...`; returns its output, asserting it succeeded."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [HERE, env.get("PYTHONPATH", "")] if p)
    env["SHOAL_TIMEOUT"] = "60"
    result = subprocess.run([SHOAL, "run", "-n", str(workers), sys.executable, os.path.join(HERE, program)]
                            + [str(a) for a in args],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=DEADLINE, text=True)
    assert result.returncode == 0, result.stdout
    return result.stdout
