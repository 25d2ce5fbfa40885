"""shoal for Python: a PyTorch program made distributed with a few lines, over shoal's C++ core.

    import shoal
    shoal.init()                          # joins the job `shoal run -n 4 python3 train.py` started
    model = shoal.DataParallel(net)       # averages gradients over the workers in backward
    ...                                   # the training loop as before

See docs/python.md.
"""
import torch  # noqa: F401  (LibTorch first: the C++ core links the very same libraries)

from . import _C
from ._C import CommError, Error, UsageError
from . import comm, data
from .dp import DataParallel, allreduce_hook, bf16_compress_hook, fp16_compress_hook

__all__ = ["comm", "data", "init", "is_initialized", "world_size", "rank", "local_rank", "is_main", "DataParallel",
           "allreduce_hook", "fp16_compress_hook", "bf16_compress_hook",
           "Error", "CommError", "UsageError"]


def init(connect_timeout=60.0, timeout=None, intra_op_threads=0, master=""):
    """Joins the job that started this process (shoal run, torchrun, Open MPI, Slurm), or makes a
    job of one when nothing did. Call once, before anything else of shoal's; a second call raises
    UsageError. `connect_timeout` and `timeout` (the collectives' default deadline; None:
    SHOAL_TIMEOUT or 10 minutes) are in seconds. As shoal::init in C++ (docs/runtime.md)."""
    _C.init(connect_timeout=float(connect_timeout), timeout=0.0 if timeout is None else float(timeout),
            intra_op_threads=int(intra_op_threads), master=str(master))


is_initialized = _C.is_initialized
world_size = _C.world_size
rank = _C.rank
local_rank = _C.local_rank
is_main = _C.is_main
