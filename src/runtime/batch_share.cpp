#include "shoal/runtime/batch_share.h"

#include <mutex>

namespace shoal::runtime {
namespace {

// A loader may run in another thread than backward (torch's loader with workers), so the share
// is guarded; it is read once per parameter per backward, which costs nothing beside the math.
std::mutex mutex;
std::optional<BatchShare> current;

}  // namespace

void set_batch_share(std::optional<BatchShare> share) {
  std::lock_guard<std::mutex> lock(mutex);
  current = share;
}

std::optional<BatchShare> batch_share() {
  std::lock_guard<std::mutex> lock(mutex);
  return current;
}

double gradient_weight(int group_size) {
  const auto share = batch_share();
  if (!share || share->workers != group_size || share->global <= 0) return 1.0;
  return static_cast<double>(share->local) * group_size / static_cast<double>(share->global);
}

}  // namespace shoal::runtime
