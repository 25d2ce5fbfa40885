// How DataParallel and global::nn::GradientSync cut a model's gradients into buckets: each bucket
// is all-reduced as soon as backward has produced its last gradient, overlapping communication
// with the rest of backward (PyTorch DDP's bucket_cap_mb). Both take this one struct: a
// DataParallelOptions is a BucketOptions with DataParallel's own options beside.
#pragma once

#include <cstdint>
#include <exception>
#include <functional>

namespace shoal {

struct BucketOptions {
  // Gradients are summed in buckets of about this many bytes (PyTorch: bucket_cap_mb=25).
  int64_t bucket_bytes = 25 * 1024 * 1024;
  // The first bucket (the last layers' gradients, which backward produces first) is kept this
  // small so that communication starts early in backward.
  int64_t first_bucket_bytes = 1024 * 1024;
  // Called, on the thread that runs backward, with the exception that the buckets' hooks are
  // about to raise there (a lost peer's CommError, a deadline passed); it may throw another in
  // its place. PyTorch's autograd engine hands a hook's exception to backward's caller as it is,
  // so a front end gives it its own type here: the Python package raises shoal.CommError through
  // it (src/python/bindings.cpp). Empty: the exception leaves as it is.
  std::function<void(std::exception_ptr)> on_backward_error;
};

}  // namespace shoal
