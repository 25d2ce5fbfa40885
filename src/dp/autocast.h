// LibTorch's CPU autocast entered and left as torch.autocast does: a nesting level each time, and
// the cache of weights cast to 16 bits dropped when the outermost level ends (it would otherwise
// serve the weights of before the optimizer's next step). Internal to shoal: DataParallel's
// mixed-precision forward and recompute's replay use it.
#pragma once

#include <ATen/autocast_mode.h>

namespace shoal::dp {

struct AutocastState {
  bool enabled = false;
  at::ScalarType dtype = at::kBFloat16;
};

// Sets the state and returns the one before, for leave_autocast.
inline AutocastState enter_autocast(const AutocastState& state) {
  const AutocastState before{at::autocast::is_cpu_enabled(),
                             at::autocast::get_autocast_cpu_dtype()};
  at::autocast::set_cpu_enabled(state.enabled);
  at::autocast::set_autocast_cpu_dtype(state.dtype);
  at::autocast::increment_nesting();
  return before;
}

inline void leave_autocast(const AutocastState& before) {
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  at::autocast::set_cpu_enabled(before.enabled);
  at::autocast::set_autocast_cpu_dtype(before.dtype);
}

}  // namespace shoal::dp
