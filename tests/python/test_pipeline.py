"""shoal.pipeline from Python: a Sequential of Python modules (torch's layers and one of the
program's own, with a Python forward) cut over 2 workers under GPipe, 1F1B, interleaved 1F1B,
ZB-H1 and a custom schedule given as data ends two Adam steps at plain PyTorch's losses and
parameters (relative 1e-5), every layer held by exactly one worker; the pipeline's checkpoint
(shoal.save of the pipeline) loads into the plain model on one process, whose third step then
equals plain PyTorch's (the Adam moments saved by parameter name). Schedules are data: a 1F1B's
simulated bubble is the closed form's, and a schedule with a fault is refused by validate() with
its one line."""
import pytest
import torch

import pipeline_worker as worker
import shoal
from jobs import run_job

SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "interleaved 1F1B (v = 2)", "zb": "ZB-H1",
             "custom": "GPipe"}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_a_pipeline_of_python_layers_equals_plain_pytorch(tmp_path, schedule):
    out = tmp_path / "pipeline"
    run_job(2, "pipeline_worker.py", out, schedule)
    results = [torch.load("%s.%d" % (out, rank)) for rank in range(2)]
    held = []
    for r in results:
        assert r["schedule"] == SCHEDULES[schedule]
        for loss, plain in zip(r["losses"], r["plain_losses"]):
            assert abs(loss - plain) <= 1e-5 * abs(plain)
        assert all(d < 1e-5 for d in r["differences"].values()), r["differences"]
        held += list(r["differences"])
    # Every parameter of the 8 layers (14 tensors) on exactly one worker.
    assert sorted(held) == sorted(set(held)) and len(held) == 14
    # The pipeline's file, on one process: a third step from it is plain PyTorch's third step.
    net = worker.make()
    optimizer = torch.optim.Adam(net.parameters(), lr=0.01)
    shoal.load(str(out) + ".ckpt", net, optimizer, group=shoal.comm.Group.single())
    worker.step(net, optimizer, worker.batches()[2])
    for name, value in net.state_dict().items():
        torch.testing.assert_close(value, results[0]["plain_after_three"][name], rtol=1e-5, atol=1e-6)


def test_schedules_are_data():
    one_f_one_b = shoal.pipeline.make_schedule("1f1b", 2, 1, 4)
    assert one_f_one_b.name == "1F1B" and len(one_f_one_b.actions) == 2
    assert [a.short_name() for a in one_f_one_b.actions[0][:2]] == ["F0.0", "SA0.0"]
    simulation = shoal.pipeline.simulate(one_f_one_b, shoal.pipeline.Costs(forward=1, backward=2))
    assert simulation.bubble == pytest.approx(1 / 5)  # (p - 1) / (m + p - 1)
    shoal.pipeline.validate(one_f_one_b)
    broken = shoal.pipeline.gpipe(2, 2)
    actions = broken.actions
    actions[1] = [a for a in actions[1] if a.short_name() != "F1.1"]  # worker 1 never forwards micro-batch 1
    broken.actions = actions
    with pytest.raises(shoal.UsageError) as raised:
        shoal.pipeline.validate(broken)
    assert str(raised.value) == ("invalid pipeline schedule 'GPipe': worker 1, action 3 (backward of stage 1, micro-batch 1): "
                                 "expected after the forward of stage 1, micro-batch 1, which worker 1 does not run")
