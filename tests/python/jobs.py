"""Starting a job of the tests' worker programs under `shoal run`, with a deadline."""
import os
import signal
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SHOAL = os.environ.get("SHOAL_BIN", "shoal")
DEADLINE = 120  # seconds a job may take, start to end


def job_env():
    """The tests' jobs' environment: this folder on PYTHONPATH, a 60 s collective deadline, and one
    intra-op thread per worker. A job of one would take both cores (docs/runtime.md, "Threads"),
    and two OpenMP threads that wait by spinning slow down many times over on a shared 2-core
    machine: beside two busy loops and another test, one epoch of the getting-started program on
    one process took over 120 s, against 10 s alone."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [HERE, env.get("PYTHONPATH", "")] if p)
    env["SHOAL_TIMEOUT"] = "60"
    env["SHOAL_NUM_THREADS"] = "1"
    return env


PROGRAMS = os.environ.get("SHOAL_TEST_PROGRAMS", "")  # the tests' C++ programs (tests/programs/)


def run_job(workers, program, *args, servers=0, flags=()):
    """`shoal run -n WORKERS python3 PROGRAM ARGS...` for a PROGRAM.py (of this folder, or a path),
    else `shoal run -n WORKERS PROGRAM ARGS...` for one of the tests' C++ programs (or a path), with
    `--servers SERVERS` parameter servers when given and `flags` before -n (`--min 1 --max 2`);
    returns its output, asserting it succeeded.
    (os.path.join keeps an absolute path as it is.)"""
    env = job_env()
    if program.endswith(".py"):
        command = [sys.executable, os.path.join(HERE, program)]
    else:
        command = [os.path.join(PROGRAMS, program)]
    flags = (["--servers", str(servers)] if servers else []) + [str(f) for f in flags]
    result = subprocess.run([SHOAL, "run"] + flags + ["-n", str(workers)] + command + [str(a) for a in args],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=DEADLINE, text=True)
    assert result.returncode == 0, result.stdout
    return result.stdout


class Job:
    """`shoal run ARGS...` running in the background, its output collected as it comes, for tests
    that act on a job while it runs (kill a worker, add one). Stops what is left of it on close."""

    def __init__(self, args, env=None):
        env = dict(job_env(), **(env or {}))
        self._lock = threading.Lock()
        self._text = {"out": [], "err": []}
        self._process = subprocess.Popen([SHOAL, "run"] + [str(a) for a in args], env=env, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, text=True, start_new_session=True)
        self._readers = [threading.Thread(target=self._read, args=(stream, name), daemon=True)
                         for stream, name in ((self._process.stdout, "out"), (self._process.stderr, "err"))]
        for reader in self._readers:
            reader.start()

    def _read(self, stream, name):
        for line in stream:
            with self._lock:
                self._text[name].append(line)

    def out(self):
        with self._lock:
            return "".join(self._text["out"])

    def err(self):
        with self._lock:
            return "".join(self._text["err"])

    def wait_for(self, what, predicate, seconds=60):
        """Waits until predicate(out) holds, failing after `seconds` (or when the job ended first)
        with what was awaited and the job's output."""
        deadline = time.monotonic() + seconds
        while not predicate(self.out()):
            if time.monotonic() > deadline or self._process.poll() is not None:
                raise AssertionError("waited for %s; the job said:\n%s\n%s" % (what, self.out(), self.err()))
            time.sleep(0.05)

    def wait(self, seconds=DEADLINE):
        """The job's exit code, once it ended (failing after `seconds`)."""
        code = self._process.wait(timeout=seconds)
        for reader in self._readers:
            reader.join(timeout=10)
        return code

    def close(self):
        if self._process.poll() is None:
            os.killpg(self._process.pid, signal.SIGKILL)
            self._process.wait()
