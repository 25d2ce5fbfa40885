"""shoal.global_ from Python, against plain PyTorch on the whole values: matmul in the data, column,
row and partial-sum plans on 2 workers, and on a 2x2 mesh of 4 workers, gives one process's output
and gradients (relative 1e-5) in the SBP its plan implies; a Megatron MLP (column-parallel, then
row-parallel, then a cross entropy) gives one process's loss and weight gradients. Bad input raises
UsageError with C++'s one line: mismatched shapes, operands on different placements, an SBP for
another mesh."""
import pytest
import torch

from jobs import run_job


@pytest.mark.parametrize("workers", [2, 4])
def test_matmul_plans_and_a_tensor_parallel_mlp_equal_plain_pytorch(tmp_path, workers):
    out = tmp_path / "global.pt"
    run_job(workers, "global_worker.py", out)
    results = torch.load(out)
    expected_sbp = {"data": "split(0)", "column": "split(1)", "row": "partial_sum", "partial": "partial_sum",
                    "2-D": "(split(0), partial_sum)", "mlp": "partial_sum"}
    plans = ["data", "column", "row", "partial", "mlp"] + (["2-D"] if workers == 4 else [])
    assert sorted(k for k in results if k != "errors") == sorted(plans)
    for plan in plans:
        result = results[plan]
        assert result.pop("sbp") == expected_sbp[plan], plan
        assert all(difference < 1e-5 for difference in result.values()), (plan, result)
    assert results["errors"] == [
        "matmul: expected a [..., n, k] and b [k, m] or [..., k, m] with a's leading dims, got [4, 6] and [5, 3]",
        "matmul: the operands are on different placements (operand 0 on [0, %s] as split(0), operand 1 on [0] as "
        "broadcast); move one with to_global(placement, sbp) first" % ", ".join(str(r) for r in range(1, workers)),
        "randn: sbp (split(0), split(1)) has 2 axes, but placement [0, %s] has 1; expected one Sbp per mesh axis"
        % ", ".join(str(r) for r in range(1, workers)),
    ]


def whole_difference(a, b):
    assert sorted(a) == sorted(b) and len(a) == 20  # every parameter of the 4 layers
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max()) for k in b)


@pytest.mark.parametrize("plan,workers", [("data", 2), ("tensor", 2), ("2-D", 4)])
def test_a_gpt_of_global_layers_trains_as_one_process_and_its_checkpoint_crosses_plans(tmp_path, plan, workers):
    one, planned, resumed = tmp_path / "one.pt", tmp_path / "planned.pt", tmp_path / "resumed.pt"
    run_job(1, "global_model_worker.py", one, "data", 6)
    run_job(workers, "global_model_worker.py", planned, plan, 3)
    # Three more steps on one process from the plan's checkpoint: its parameters and AdamW moments
    # by name, gathered whole from the plan's pieces.
    run_job(1, "global_model_worker.py", resumed, "data", 3, str(planned) + ".ckpt")
    reference, got, after = torch.load(one), torch.load(planned), torch.load(resumed)
    for a, b in zip(got["losses"] + after["losses"], reference["losses"]):
        assert abs(a - b) <= 1e-5 * abs(b), (got["losses"], after["losses"], reference["losses"])
    assert whole_difference(after["whole"], reference["whole"]) < 1e-5


def test_a_peer_lost_in_a_global_models_backward_is_a_comm_error(tmp_path):
    # GradientSync's hooks (through BucketOptions::on_backward_error) and the boxing raise inside
    # the global loss's backward(), which runs autograd from C++; the program gets shoal.CommError
    # with shoal's one line.
    out = tmp_path / "error"
    run_job(2, "global_model_worker.py", out, "lost", 3)
    message = out.read_text()
    assert message.startswith("CommError at step 1: "), message
    assert "\n" not in message
