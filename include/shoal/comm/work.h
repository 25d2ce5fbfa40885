// A handle on an operation in flight (c10d's Work, with shoal's deadlines and errors).
#pragma once

#include <functional>
#include <memory>

#include <ATen/ATen.h>

#include "shoal/core/timeout.h"

namespace shoal::comm {

class Group;

class Work {
 public:
  Work() = default;

  // Blocks until the operation is done. It ends no later than the operation's deadline (its
  // options' timeout, else the group's), or `timeout` when that is sooner. A lost peer or an
  // expired deadline raises CommError naming the operation, the workers and the time waited;
  // the group is then broken and every later operation on it raises CommError at once.
  // Calling wait() again after success returns at once.
  void wait(Duration timeout = kUnsetTimeout);

  // True once wait() would return or throw without blocking.
  bool is_completed() const;

  // Runs `next(result)` once the operation has succeeded, inside the wait() that sees it
  // complete (so on the waiting thread), after the operation's own completion steps; `result`
  // is what result() will return (undefined for in-place operations). For communication hooks:
  // decompress, divide, copy back.
  Work& then(std::function<void(const at::Tensor& result)> next);

  // The operation's output, for those that make a new tensor (all_gather, reduce_scatter,
  // all_to_all). Valid after wait().
  const at::Tensor& result() const;

  struct State;

 private:
  friend class Group;
  explicit Work(std::shared_ptr<State> state) : state_(std::move(state)) {}
  std::shared_ptr<State> state_;
};

}  // namespace shoal::comm
