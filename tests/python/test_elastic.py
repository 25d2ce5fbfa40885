"""shoal.elastic from Python, against the oracles of the C++ elastic tests: on gossip membership
and on a real etcd server (Debian's etcd-server, started here), an elastic job of three Python
workers (elastic_worker.py: DataParallel, SGD with momentum, shoal's DataLoader with
torch's loader processes reading ahead, a commit per step) loses one to SIGKILL and takes in a
new one, and ends with every sample of every epoch trained on exactly once in committed steps and
at the parameters of one process that trained alone (relative 1e-4, as in C++). SIGINT to the
launcher makes every worker leave at a commit. Outside an elastic job, the program's own error
leaves run() as it came, and WorldChange is no Exception that a program's `except Exception`
would swallow."""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest
import torch

import shoal
from jobs import HERE, Job, run_job

EPOCHS = 8
WORKER = [sys.executable, HERE + "/elastic_worker.py"]


def steps(out):
    """The (step, world) of every "step S world W" line."""
    return [(int(s), int(w)) for s, w in re.findall(r"step (\d+) world (\d+)", out)]


def reached(step, world):
    return lambda out: any(s >= step and w == world for s, w in steps(out))


def last_step(out):
    return steps(out)[-1][0] if steps(out) else -1


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def etcd():
    """A one-member etcd server on 127.0.0.1 (as tests/etcd_server.cpp starts it), its data in a
    temporary directory; yields its client endpoint, "127.0.0.1:PORT"."""
    program = os.environ.get("SHOAL_ETCD") or shutil.which("etcd") or "/usr/bin/etcd"
    if not os.access(program, os.X_OK):
        pytest.skip("no etcd program (scripts/setup.sh installs etcd-server)")
    directory = tempfile.mkdtemp(prefix="shoal-etcd-")
    client, peer = "http://127.0.0.1:%d" % free_port(), "http://127.0.0.1:%d" % free_port()
    with open(os.path.join(directory, "etcd.log"), "w") as log:
        server = subprocess.Popen([program, "--name=shoal-test", "--data-dir=%s/data" % directory,
                                   "--listen-client-urls=" + client, "--advertise-client-urls=" + client,
                                   "--listen-peer-urls=" + peer, "--initial-advertise-peer-urls=" + peer,
                                   "--initial-cluster=shoal-test=" + peer, "--heartbeat-interval=50",
                                   "--election-timeout=500"], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(client + "/health", timeout=1) as answer:
                    if json.loads(answer.read()).get("health") == "true":
                        break
            except OSError:
                pass
            assert server.poll() is None and time.monotonic() < deadline, open(os.path.join(directory, "etcd.log")).read()
            time.sleep(0.1)
        yield client[len("http://"):]
    finally:
        server.kill()
        server.wait()
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def jobs():
    started = []
    yield lambda args, env=None: started.append(Job(args, env)) or started[-1]
    for job in started:
        job.close()


@pytest.mark.parametrize("backend", ["gossip", "etcd"])
def test_a_killed_worker_and_a_joined_one_end_at_the_one_process_parameters(tmp_path, jobs, backend, request):
    reference, out = tmp_path / "reference.pt", str(tmp_path / "elastic.pt")
    run_job(1, "elastic_worker.py", reference, EPOCHS)
    rendezvous = ["--rendezvous", "etcd://" + request.getfixturevalue("etcd")] if backend == "etcd" else []
    job = jobs(rendezvous + ["--min", "1", "--max", "3", "-n", "3", "--token-file", tmp_path / "token"] + WORKER
               + [out, EPOCHS, 60])
    job.wait_for("step 10 on 3 workers", reached(10, 3))
    first = {int(rank): int(pid) for pid, rank in re.findall(r"train pid=(\d+) rank=(\d+) world=3", job.out())}
    assert sorted(first) == [0, 1, 2], job.out()

    os.kill(first[1], signal.SIGKILL)
    killed_at = last_step(job.out())
    job.wait_for("5 steps on 2 workers after the kill", reached(killed_at + 5, 2))

    flags = re.search(r"to add workers: shoal run (.+) PROGRAM", job.err())
    assert flags, job.err()
    joiner = jobs(flags.group(1).split() + ["-n", "1"] + WORKER + [out, EPOCHS, 60])
    joined_from = last_step(job.out())
    job.wait_for("a step on 3 workers after the join", reached(joined_from + 1, 3))

    assert joiner.wait() == 0, joiner.err()
    assert job.wait() == 0, job.err()
    assert "was killed by signal 9 (SIGKILL); the job goes on without it" in job.err()
    assert re.search(r"train pid=\d+ rank=\d+ world=3 step=[1-9]", job.out() + joiner.out()), job.out()
    got, want = torch.load(out), torch.load(reference)
    assert torch.equal(got["counts"], torch.ones(EPOCHS, 240, dtype=torch.long))
    assert torch.equal(want["counts"], torch.ones(EPOCHS, 240, dtype=torch.long))
    diff = sum(float((a - b).pow(2).sum()) for a, b in zip(got["parameters"], want["parameters"]))
    norm = sum(float(b.pow(2).sum()) for b in want["parameters"])
    assert (diff / norm) ** 0.5 < 1e-4


def test_under_goodput_the_batch_follows_the_world_and_every_sample_is_trained_once(tmp_path, jobs):
    # As the C++ ElasticResizes/goodput: two workers, one SIGKILLed, a joiner; torch's loader
    # processes read ahead while the policy changes the batch at commits. The survivor holds
    # after 5 steps alone until the joiner is in.
    out = str(tmp_path / "goodput.pt")
    env = {"ELASTIC_WORKER_POLICY": "goodput", "ELASTIC_WORKER_HOLD_ALONE_AFTER": "5"}
    job = jobs(["--min", "1", "--max", "2", "-n", "2", "--token-file", tmp_path / "token"] + WORKER
               + [out, EPOCHS, 30], env)
    job.wait_for("step 10 on 2 workers", reached(10, 2))
    first = {int(rank): int(pid) for pid, rank in re.findall(r"train pid=(\d+) rank=(\d+) world=2", job.out())}
    assert sorted(first) == [0, 1], job.out()
    killed_at = last_step(job.out())
    os.kill(first[1], signal.SIGKILL)
    job.wait_for("a step on 1 worker after the kill", reached(killed_at + 1, 1))
    flags = re.search(r"to add workers: shoal run (.+) PROGRAM", job.err())
    assert flags, job.err()
    joiner = jobs(flags.group(1).split() + ["-n", "1"] + WORKER + [out, EPOCHS, 30], env)
    assert joiner.wait() == 0, joiner.err()
    assert job.wait() == 0, job.err()
    text = job.out() + joiner.out()
    assert re.search(r"train pid=\d+ rank=1 world=2 step=[1-9]", text), text
    got = torch.load(out)
    assert torch.equal(got["counts"], torch.ones(EPOCHS, 240, dtype=torch.long))
    lines = re.findall(r"step \d+ world (\d+) lr=(\S+) batch=(\d+) passes=(\d+) gain=(\S+)", text)
    assert len(lines) > 10, text
    for world, lr, batch, passes, gain in lines:
        world, batch, passes, lr, gain = int(world), int(batch), int(passes), float(lr), float(gain)
        assert 8 <= batch <= 48 and batch % world == 0 and batch // world <= 6 * passes, (world, batch, passes)
        assert passes in (1, 2) and lr == pytest.approx(0.05 * gain, rel=1e-5) and gain >= 1 - 1e-9
    assert {int(w) for w, *_ in lines} == {1, 2}, text
    assert len({int(b) for _, _, b, _, _ in lines}) >= 2, text


def test_sigint_makes_every_worker_leave_at_a_commit(tmp_path, jobs):
    job = jobs(["--min", "1", "--max", "2", "-n", "2", "--token-file", tmp_path / "token"] + WORKER
               + [tmp_path / "out.pt", EPOCHS, 60])
    job.wait_for("step 5 on 2 workers", reached(5, 2))
    job._process.send_signal(signal.SIGINT)
    assert job.wait(60) == 130, job.err()
    assert "received SIGINT; stopping the workers" in job.err()
    assert job.err().count("leaves the job after step") == 2, job.err()
    assert job.err().splitlines()[-2:] == ["shoal run: worker 0 exited with code 0",
                                          "shoal run: worker 1 exited with code 0"], job.err()


def test_outside_an_elastic_job_the_program_s_error_leaves_run_as_it_came():
    assert issubclass(shoal.elastic.WorldChange, BaseException)
    assert not issubclass(shoal.elastic.WorldChange, Exception)
    net = torch.nn.Linear(2, 1)
    optimizer = torch.optim.Adam(net.parameters(), lr=0.1)
    with pytest.raises(shoal.UsageError) as raised:
        shoal.elastic.State(net, optimizer, torch.utils.data.DataLoader(list(range(8))))
    assert str(raised.value) == ("shoal.elastic.State: the loader is a DataLoader; expected a shoal.data.DataLoader "
                                 "or shoal.data.Sampler")
    loader = shoal.data.DataLoader(list(range(8)), batch_size=4, per_worker=True)
    with pytest.raises(shoal.UsageError) as raised:
        shoal.elastic.State(net, optimizer, loader)
    assert "keep_global_batch() needs a sampler whose batch_size is the global batch" in str(raised.value)


def test_adascale_needs_the_noise_measured_and_scales_by_its_gain():
    # In a job of one against a reference of two workers: the gain of 8 samples over 16 is below
    # 1 once measured (consecutive steps are the two means), and the rate is lr0 times it.
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    net = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    loader = shoal.data.DataLoader(data, batch_size=8, per_worker=True)
    policy = shoal.elastic.BatchPolicy.adascale(reference_world_size=2)
    with pytest.raises(shoal.UsageError) as raised:
        shoal.elastic.State(shoal.DataParallel(net), optimizer, loader, policy=policy)
    assert str(raised.value) == ("elastic::State: BatchPolicy::adascale() needs the gradient noise measured: "
                                 "expected the module under a DataParallel with measure_gradient_noise = true")
    model = shoal.DataParallel(net, measure_gradient_noise=True)
    state = shoal.elastic.State(model, optimizer, loader, policy=policy)
    gains = []

    def train():
        for x, y in loader.epoch(state.epoch):
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            gains.append(state.gain)
            state.commit()
            assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * state.gain, rel=1e-12)
            assert state.gain == pytest.approx(model.gradient_noise.gain(8, 16), rel=1e-12)

    shoal.elastic.run(state, train)
    assert model.gradient_noise.measurements == 7  # 8 steps, the first without a pair
    assert 0.5 <= state.gain < 1.0
    assert state.scaled_steps == pytest.approx(sum(gains), rel=1e-12)
    # A program's own schedule: a new base rate takes effect at once, times the gain.
    state.set_base_learning_rates([0.05])
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.05 * state.gain, rel=1e-12)


def test_a_new_base_rate_under_linear_scaling_takes_effect_at_once():
    # A job of one against a reference of two workers: the linear rule's factor is 1/2, from the
    # first round on; set_base_learning_rates() applies it at once, not at the next change of world.
    net = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    loader = shoal.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 4)), batch_size=8, per_worker=True)
    state = shoal.elastic.State(shoal.DataParallel(net), optimizer, loader,
                                policy=shoal.elastic.BatchPolicy.scale_learning_rate(reference_world_size=2))
    rates = []

    def train():
        rates.append(optimizer.param_groups[0]["lr"])
        state.set_base_learning_rates([0.4])
        rates.append(optimizer.param_groups[0]["lr"])

    shoal.elastic.run(state, train)
    assert rates == pytest.approx([0.05, 0.2], rel=1e-12)
