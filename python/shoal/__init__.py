"""shoal for Python: a PyTorch program made distributed with a few lines, over shoal's C++ core.

    import shoal
    shoal.init()                          # joins the job `shoal run -n 4 python3 train.py` started
    model = shoal.DataParallel(net)       # averages gradients over the workers in backward
    ...                                   # the training loop as before
    shoal.save("ckpt.pt", model, optimizer, loader)   # every worker; resumes on any number

See docs/python.md.
"""
import torch  # noqa: F401  (LibTorch first: the C++ core links the very same libraries)

from . import _C
from . import _arguments
_arguments.wrap_all()  # before any module takes a name from _C
from ._C import CommError, Error, GradientNoise, UsageError  # noqa: E402
from ._arguments import ArgumentTypeError  # noqa: E402
from . import comm, data, datasets, elastic, global_, pipeline, ps  # noqa: E402
from ._runtime import init  # noqa: E402
from .checkpoint import load, save  # noqa: E402
from .dp import DataParallel, allreduce_hook, bf16_compress_hook, fp16_compress_hook  # noqa: E402

__all__ = ["comm", "data", "datasets", "elastic", "global_", "pipeline", "ps", "init", "save", "load", "is_initialized", "world_size", "rank", "local_rank", "is_main", "DataParallel",
           "allreduce_hook", "fp16_compress_hook", "bf16_compress_hook",
           "Error", "CommError", "UsageError", "ArgumentTypeError", "GradientNoise"]


is_initialized = _C.is_initialized
world_size = _C.world_size
rank = _C.rank
local_rank = _C.local_rank
is_main = _C.is_main
