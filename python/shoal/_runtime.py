"""Joining the job: shoal.init, which shoal.DataParallel also calls when the program has not."""
from . import _C


def init(connect_timeout=60.0, timeout=None, intra_op_threads=0, master=""):
    """Joins the job that started this process (shoal run, torchrun, Open MPI, Slurm), or makes a
    job of one when nothing did. Call once, before anything else of shoal's; a second call raises
    UsageError. `connect_timeout` and `timeout` (the collectives' default deadline; None:
    SHOAL_TIMEOUT or 10 minutes) are in seconds. As shoal::init in C++ (docs/runtime.md)."""
    _C.init(connect_timeout=connect_timeout, timeout=0.0 if timeout is None else timeout,
            intra_op_threads=intra_op_threads, master=master)
