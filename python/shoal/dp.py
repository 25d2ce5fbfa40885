"""shoal.DataParallel: a torch.nn.Module whose gradients backward averages over the job's workers.
Hooks, buckets and all-reduces are shoal's C++ DataParallel's (docs/dp.md); see docs/python.md."""
import contextlib

import torch

from . import _C
from ._runtime import init

allreduce_hook = _C.allreduce_hook
fp16_compress_hook = _C.fp16_compress_hook
bf16_compress_hook = _C.bf16_compress_hook


def _first_tensor(args, kwargs):
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value
    return None


class DataParallel(torch.nn.Module):
    """Wraps `module` as shoal::DataParallel does in C++: it joins the job if the program has not,
    broadcasts the first worker's parameters and buffers, checks that every worker built the same
    model (UsageError naming the first difference), and from then on each backward averages the
    gradients, bucketed and overlapped with the rest of backward, weighing each worker's by its
    share of the global batch that went through forward (so uneven shares give the one-process
    gradient of a mean loss). Call it as the module (`model(x)`); `model.module` is the module.

    The options are DataParallelOptions' (shoal/dp/data_parallel.h), by the same names; comm_hook
    is one of shoal.fp16_compress_hook(), shoal.bf16_compress_hook() or shoal.allreduce_hook()
    (None: the all-reduce in the gradients' dtype), run in C++ (shoal/dp/comm_hooks.h)."""

    def __init__(self, module, bucket_bytes=25 * 1024 * 1024, first_bucket_bytes=1024 * 1024,
                 find_unused_parameters=False, gradient_as_bucket_view=True, broadcast_buffers=True,
                 weigh_by_batch_share=True, batch_dim=0, comm_hook=None, measure_gradient_noise=False,
                 gradient_noise_smoothing=0.99):
        super().__init__()
        if not isinstance(module, torch.nn.Module):
            raise _C.UsageError("DataParallel: the module is a %s; expected a torch.nn.Module"
                                % type(module).__name__)
        if not _C.is_initialized():
            init()
        self.module = module
        self._replication = _C.Replication(
            parameters=list(module.named_parameters()), buffers=list(module.named_buffers()),
            bucket_bytes=bucket_bytes, first_bucket_bytes=first_bucket_bytes,
            find_unused_parameters=bool(find_unused_parameters),
            gradient_as_bucket_view=bool(gradient_as_bucket_view), broadcast_buffers=bool(broadcast_buffers),
            weigh_by_batch_share=bool(weigh_by_batch_share), batch_dim=batch_dim, comm_hook=comm_hook,
            measure_gradient_noise=bool(measure_gradient_noise), gradient_noise_smoothing=gradient_noise_smoothing)

    def forward(self, *args, **kwargs):
        # Under grad mode a forward is a collective (it counts the batch's share); C++ checks it.
        self._replication.before_forward(_first_tensor(args, kwargs))
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Within it, backward accumulates gradients locally only; the first backward after it
        averages everything accumulated (PyTorch DDP's no_sync)."""
        before = self._replication.sync()
        self._replication.set_sync(False)
        try:
            yield
        finally:
            self._replication.set_sync(before)

    def bucket_assignment(self):
        """Each bucket's parameters, by their index in module.parameters()."""
        return self._replication.bucket_assignment()

    @property
    def gradient_noise(self):
        """The gradient noise measured so far (measure_gradient_noise=True), a shoal.GradientNoise
        the same on every worker: gradient_sqr (|G|^2), variance (tr(Sigma) per sample),
        noise_scale(), gain(batch, base_batch) (AdaScale's), efficiency(batch, base_batch)
        (Pollux's), measurements and batch. None when not measured. See docs/dp.md."""
        return self._replication.gradient_noise()
