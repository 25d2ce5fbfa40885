"""A job of one for tests/python/test_arguments.py: calls shoal with arguments of wrong types and
prints, one JSON line per call, the exception's type names and its text."""
import json

import torch

import shoal

g = shoal.global_


class Raises(torch.nn.Module):
    """A layer whose forward raises the program's own TypeError."""

    def forward(self, x):
        raise TypeError("the program's own TypeError")


def main():
    shoal.init()
    everyone = g.Placement.all()
    x = g.randn([4, 4], everyone, g.split(0))
    calls = [
        ("matmul", lambda: g.matmul(torch.ones(4, 4), x)),
        ("operator", lambda: x @ torch.ones(4, 4)),
        ("embedding", lambda: shoal.ps.Embedding("many", 3)),
        ("bucket_bytes", lambda: shoal.DataParallel(torch.nn.Linear(2, 2), bucket_bytes="25MB")),
        ("micro_batches", lambda: shoal.pipeline.Pipeline(torch.nn.Sequential(torch.nn.Linear(2, 2)),
                                                          micro_batches="2")),
        ("inside", lambda: shoal.pipeline.Pipeline(torch.nn.Sequential(Raises())).step(
            torch.ones(2, 2), torch.ones(2, 2), torch.nn.functional.mse_loss)),
    ]
    for name, call in calls:
        try:
            call()
            print(json.dumps({"call": name, "raised": None}))
        except Exception as error:
            print(json.dumps({"call": name, "types": [t.__name__ for t in type(error).__mro__], "text": str(error)}))


if __name__ == "__main__":
    main()
