// How DataParallel and global::nn::GradientSync cut a model's gradients into buckets: each bucket
// is all-reduced as soon as backward has produced its last gradient, overlapping communication
// with the rest of backward (PyTorch DDP's bucket_cap_mb). Both take this one struct: a
// DataParallelOptions is a BucketOptions with DataParallel's own options beside.
#pragma once

#include <cstdint>

namespace shoal {

struct BucketOptions {
  // Gradients are summed in buckets of about this many bytes (PyTorch: bucket_cap_mb=25).
  int64_t bucket_bytes = 25 * 1024 * 1024;
  // The first bucket (the last layers' gradients, which backward produces first) is kept this
  // small so that communication starts early in backward.
  int64_t first_bucket_bytes = 1024 * 1024;
};

}  // namespace shoal
