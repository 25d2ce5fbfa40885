"""Wrong argument types from Python are shoal's one line (python/shoal/_arguments.py): an
ArgumentTypeError, which is a shoal.UsageError and a TypeError, naming the public function and
the argument that was wrong (or the types given and the ones expected), not pybind11's several
lines. A TypeError the program raises inside a call leaves as it came."""
import json

from jobs import run_job


def raised():
    out = run_job(1, "arguments_worker.py")
    calls = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return {call["call"]: call for call in calls}


def test_wrong_types_are_one_line_usage_errors_and_the_programs_own_type_errors_pass():
    got = raised()
    want = {
        "matmul": "shoal.global_.matmul: arguments of types (Tensor, GlobalTensor); "
                  "expected (a: GlobalTensor, b: GlobalTensor)",
        "operator": "shoal.global_.GlobalTensor.__matmul__: arguments of types (Tensor); expected (arg0: GlobalTensor)",
        "embedding": "shoal.ps.Embedding: num_embeddings is a str; expected an int",
        "bucket_bytes": "shoal.DataParallel: bucket_bytes is a str; expected an int",
        "micro_batches": "shoal.pipeline.Pipeline: micro_batches is a str; expected an int",
    }
    for call, text in want.items():
        assert got[call].get("text") == text, got[call]
        assert got[call]["types"][:4] == ["ArgumentTypeError", "UsageError", "Error", "RuntimeError"], got[call]
        assert "TypeError" in got[call]["types"]
    inside = got["inside"]
    assert inside["types"][0] == "TypeError" and inside["text"] == "the program's own TypeError", inside
