"""shoal.comm from Python: every collective gives what it must on 1, 2 and 3 workers (in place where
C++ works in place, uneven parts, async handles, a send and its receive), bad arguments are
shoal.UsageError with C++'s one line, and a collective whose members disagree on the shape ends
within its deadline on every worker with a shoal error."""

import pytest
import torch

from jobs import run_job


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_collectives_give_what_they_must(tmp_path, workers):
    out = tmp_path / "seen"
    run_job(workers, "comm_worker.py", out, "collectives")
    n = workers
    for rank in range(n):
        seen = torch.load("%s.%d" % (out, rank))
        assert seen["members"] == list(range(n))
        assert seen["all_reduce"] == [float(n * (n + 1) // 2)] * 4
        assert seen["all_reduce_max"] == [float(n)] * 2
        assert seen["all_reduce_async_avg"] == [10 * (n - 1) / 2 + i for i in range(3)]
        assert seen["broadcast"] == [float(n - 1)] * 2
        assert seen["all_gather"] == [[float(r)] * 2 for r in range(n) for _ in range(r + 1)]
        assert seen["reduce_scatter"] == [float(n * (n + 1) // 2)] * 2
        assert seen["all_to_all"] == [100.0 * r + rank for r in range(n)]
        if n > 1 and rank == 1:
            assert seen["recv"] == [7.0, 8.0]
        assert seen["bad_root"] == "broadcast: root %d is not a member of a group of %d" % (n + 3, n)
        assert seen["bad_timeout"] == "timeout -1.000000 s; expected a positive number of seconds or None"
        assert seen["bad_type"] == "Group.all_reduce: tensor is a list; expected a torch.Tensor"


def test_a_shape_mismatch_ends_within_the_deadline_on_every_worker(tmp_path):
    out = tmp_path / "seen"
    run_job(2, "comm_worker.py", out, "mismatch")
    for rank in range(2):
        seen = torch.load("%s.%d" % (out, rank))
        assert seen["error"] in ("CommError", "UsageError"), seen
        assert "\n" not in seen["message"] and seen["message"], seen
        assert seen["seconds"] < 3 + 5, seen  # the deadline, and room for a loaded machine
