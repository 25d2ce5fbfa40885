#include "shoal/comm/group.h"

#include <algorithm>
#include <atomic>
#include <numeric>
#include <optional>
#include <set>
#include <thread>
#include <utility>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "shoal/core/env.h"
#include "shoal/core/error.h"
#include "data_path.h"
#include "state.h"

namespace shoal::comm {
namespace {

// Set by RunOnWaiter: Group::submit then leaves the lane's thread asleep, and the caller runs the
// operation (Note [Running on the waiter] in shm/executor.cpp).
thread_local bool waited_at_once = false;

// Launches with waited_at_once set; the flag ends with the launch, taken or not.
template <typename Launch>
Work launch_waited_at_once(Launch&& launch) {
  RunOnWaiter promise;
  return launch();
}

void check_average(ReduceOp op, const at::Tensor& tensor, const char* name) {
  if (op == ReduceOp::kAvg && !at::isFloatingType(tensor.scalar_type())) {
    throw UsageError(std::string(name) + ": ReduceOp::kAvg needs a floating-point tensor, got " +
                     std::string(c10::toString(tensor.scalar_type())));
  }
}

void check_rows(const at::Tensor& tensor, const char* name) {
  if (tensor.dim() == 0) {
    throw UsageError(std::string(name) +
                     " works along dim 0 and needs a tensor of at least one "
                     "dimension, got a scalar");
  }
}

void check_sizes(const Sizes& sizes, int group_size, int64_t total, const char* name,
                 const char* what) {
  if (static_cast<int>(sizes.size()) != group_size) {
    throw UsageError(std::string(name) + ": " + what + " has " + std::to_string(sizes.size()) +
                     " entries [" + join(sizes) + "]; expected one per member (" +
                     std::to_string(group_size) + ")");
  }
  for (auto s : sizes) {
    if (s < 0)
      throw UsageError(std::string(name) + ": " + what + " [" + join(sizes) +
                       "] has a negative size");
  }
  const auto sum = std::accumulate(sizes.begin(), sizes.end(), int64_t{0});
  if (total >= 0 && sum != total) {
    throw UsageError(std::string(name) + ": " + what + " [" + join(sizes) + "] add up to " +
                     std::to_string(sum) + "; expected dim 0 of the input, " +
                     std::to_string(total));
  }
}

// Elements of `rows` rows of a tensor shaped like `like` (dim 0 is the rows).
size_t elements(const at::Tensor& like, int64_t rows) {
  int64_t row = 1;
  for (int64_t d = 1; d < like.dim(); ++d) row *= like.size(d);
  return static_cast<size_t>(rows * row);
}

// Bytes of `rows` rows of a tensor shaped like `like`.
int64_t bytes_of_rows(const at::Tensor& like, int64_t rows) {
  return static_cast<int64_t>(elements(like, rows) * like.element_size());
}

// Note [Bytes sent]
// What this worker hands to the network in every group, counted when an operation that sends
// anything is launched, as ring algorithms send them (docs/comm.md, "Bytes sent"): an all-reduce
// of T bytes among n members sends 2T(n-1)/n; an all-gather (n-1) parts as Gloo sends them
// (padded to the largest); an all-to-all, and so a reduce-scatter, the rows it sends to others;
// a broadcast T(n-1)/n (its tree sends (n-1)T in all, here shared evenly); a send T; a receive,
// a barrier and a group of one nothing.
std::atomic<int64_t> sent{0};

void count_sent(int64_t bytes) {
  sent.fetch_add(bytes, std::memory_order_relaxed);
}

}  // namespace

bool take_waited_at_once() {
  return std::exchange(waited_at_once, false);
}

c10d::ReduceOp to_backend(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:  // Gloo has no average: a sum, divided on completion
      return c10d::ReduceOp::SUM;
    case ReduceOp::kMax:
      return c10d::ReduceOp::MAX;
    case ReduceOp::kMin:
      return c10d::ReduceOp::MIN;
  }
  SHOAL_CHECK(false) << "unknown ReduceOp " << static_cast<int>(op);
}

std::vector<int64_t> shape_with_rows(const at::Tensor& like, int64_t rows) {
  auto shape = like.sizes().vec();
  shape[0] = rows;
  return shape;
}

at::Tensor reduce_rows(const at::Tensor& stacked, ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return stacked.sum(0);
    case ReduceOp::kAvg:
      return stacked.mean(0);
    case ReduceOp::kMax:
      return stacked.amax(0);
    case ReduceOp::kMin:
      return stacked.amin(0);
  }
  SHOAL_CHECK(false) << "unknown ReduceOp " << static_cast<int>(op);
}

std::optional<shm::DType> shm_dtype(at::ScalarType type) {
  switch (type) {
    case at::kFloat:
      return shm::DType::kFloat32;
    case at::kDouble:
      return shm::DType::kFloat64;
    case at::kInt:
      return shm::DType::kInt32;
    case at::kLong:
      return shm::DType::kInt64;
    case at::kByte:
      return shm::DType::kUInt8;
    case at::kChar:
      return shm::DType::kInt8;
    case at::kHalf:
      return shm::DType::kFloat16;
    case at::kBFloat16:
      return shm::DType::kBFloat16;
    default:
      return std::nullopt;
  }
}

shm::ReduceOp to_shm(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return shm::ReduceOp::kSum;
    case ReduceOp::kAvg:  // divided in the reduction's own pass
      return shm::ReduceOp::kAvg;
    case ReduceOp::kMax:
      return shm::ReduceOp::kMax;
    case ReduceOp::kMin:
      return shm::ReduceOp::kMin;
  }
  SHOAL_CHECK(false) << "unknown ReduceOp " << static_cast<int>(op);
}

std::vector<size_t> element_counts(const at::Tensor& like, const Sizes& rows) {
  std::vector<size_t> counts;
  for (auto r : rows) counts.push_back(elements(like, r));
  return counts;
}

RunOnWaiter::RunOnWaiter() {
  waited_at_once = true;
}
RunOnWaiter::~RunOnWaiter() {
  waited_at_once = false;
}

int64_t sent_bytes() {
  return sent.load(std::memory_order_relaxed);
}

Sizes split_sizes(int64_t length, int parts) {
  SHOAL_CHECK(parts > 0) << "split into " << parts << " parts";
  Sizes sizes(parts, length / parts);
  for (int64_t i = 0; i < length % parts; ++i) sizes[i] += 1;
  return sizes;
}

Sizes split_starts(int64_t length, int parts) {
  Sizes starts{0};
  for (int64_t size : split_sizes(length, parts)) starts.push_back(starts.back() + size);
  return starts;
}

// ----- accessors -----

int Group::rank() const {
  return state_ ? state_->rank : 0;
}
int Group::size() const {
  return state_ ? state_->size() : 0;
}
const std::vector<int>& Group::members() const {
  SHOAL_CHECK(state_ != nullptr) << "members() on an empty Group";
  return state_->members;
}
Duration Group::timeout() const {
  return state_ ? state_->options.timeout : kDefaultGroupTimeout;
}
void Group::set_timeout(Duration timeout) {
  SHOAL_CHECK(state_ != nullptr) << "set_timeout() on an empty Group";
  if (timeout.count() <= 0)
    throw UsageError("Group::set_timeout: expected a positive timeout, got " +
                     format_duration(timeout));
  state_->options.timeout = timeout;
}
bool Group::is_broken() const {
  return state_ && state_->broken;
}
std::string Group::path() const {
  if (!state_ || state_->size() == 1) return "none";
  if (state_->shm) return "shared memory";
  if (state_->hierarchy) return "hierarchical";
  return "gloo";
}

// ----- operations -----

Work Group::launch(const char* op, const std::function<void(Work::State&)>& start, Duration timeout,
                   int64_t bytes, int peer) {
  if (!state_) throw UsageError(std::string(op) + " on an empty Group; call shoal::init() first");
  if (state_->broken) {
    std::lock_guard<std::mutex> lock(state_->mutex);
    throw CommError(
        std::string(op) + " on " + state_->describe() +
        " cannot start: the group was broken by an earlier failure: " + state_->broken_reason);
  }
  auto work = std::make_shared<Work::State>();
  work->op = op;
  work->group = state_;
  work->deadline = Deadline(timeout == kUnsetTimeout ? state_->options.timeout : timeout);
  if (timeline::enabled()) {
    work->slice = peer < 0 ? timeline::AsyncSlice(op, "comm", {{"bytes", bytes}, {"group", size()}})
                           : timeline::AsyncSlice(
                                 op, "comm", {{"bytes", bytes}, {"group", size()}, {"peer", peer}});
  }
  try {
    try {
      start(*work);
    } catch (...) {
      // Queued for this caller to run (Note [Running on the waiter]) but never to be waited for:
      // its lane runs it, as it runs every other operation queued.
      if (work->shm_task && state_->shm) state_->shm->hand_over(work->shm_task);
      throw;
    }
  } catch (const shoal::Error&) {
    throw;
  } catch (const c10::Error& e) {
    throw UsageError(std::string(op) + " on " + state_->describe() + ": " +
                     e.what_without_backtrace());
  }
  return Work(work);
}

DataPath& Group::path_for(const at::Tensor* tensor) const {
  // Point-to-point and barriers take the segment for any dtype; the collectives where it reduces.
  if (state_->shm_path && (tensor == nullptr || shm_dtype(tensor->scalar_type())))
    return *state_->shm_path;
  return *state_->gloo_path;
}

Work Group::all_reduce_async(at::Tensor& tensor, const AllReduceOptions& options) {
  check_average(options.op, tensor, "all_reduce");
  at::Tensor target = tensor;
  at::Tensor buffer = tensor.is_contiguous() ? tensor : tensor.contiguous();
  const int n = size();
  const ReduceOp op = options.op;
  return launch(
      "all_reduce",
      [&](Work::State& work) {
        bool averaged = false;  // kAvg's division done by the path itself
        if (n > 1 && buffer.numel() > 0) {
          DataPath* path = &path_for(&buffer);
          // Note [Hierarchical all-reduce] (path.cpp): large enough, and of a dtype the hosts'
          // segments reduce.
          if (state_->hierarchical_path && shm_dtype(buffer.scalar_type()) &&
              static_cast<int64_t>(buffer.nbytes()) >= state_->hierarchy->flat_below)
            path = state_->hierarchical_path.get();
          averaged = path->all_reduce(work, buffer, op);
          count_sent(2 * static_cast<int64_t>(buffer.nbytes()) * (n - 1) / n);
        }
        work.finish = [target, buffer, op, n, averaged](Work::State&) mutable {
          if (op == ReduceOp::kAvg && n > 1 && !averaged) buffer.div_(n);
          if (!buffer.is_same(target)) target.copy_(buffer);
        };
      },
      options.timeout, static_cast<int64_t>(buffer.nbytes()));
}

void Group::all_reduce(at::Tensor& tensor, const AllReduceOptions& options) {
  launch_waited_at_once([&] { return all_reduce_async(tensor, options); }).wait();
}

Work Group::broadcast_async(at::Tensor& tensor, const BroadcastOptions& options) {
  if (options.root < 0 || options.root >= size()) {
    throw UsageError("broadcast: root " + std::to_string(options.root) +
                     " is not a member of a group of " + std::to_string(size()));
  }
  at::Tensor target = tensor;
  at::Tensor buffer = tensor.is_contiguous() ? tensor : tensor.contiguous();
  return launch(
      "broadcast",
      [&](Work::State& work) {
        if (size() > 1 && buffer.numel() > 0) {
          path_for(&buffer).broadcast(work, buffer, options.root);
          count_sent(static_cast<int64_t>(buffer.nbytes()) * (size() - 1) / size());
        }
        work.finish = [target, buffer](Work::State&) mutable {
          if (!buffer.is_same(target)) target.copy_(buffer);
        };
      },
      options.timeout, static_cast<int64_t>(buffer.nbytes()));
}

void Group::broadcast(at::Tensor& tensor, const BroadcastOptions& options) {
  launch_waited_at_once([&] { return broadcast_async(tensor, options); }).wait();
}

Work Group::all_gather_async(const at::Tensor& tensor, const AllGatherOptions& options) {
  check_rows(tensor, "all_gather");
  const int n = size();
  Sizes sizes = options.sizes;
  if (sizes.empty()) {
    sizes.assign(n, tensor.size(0));
  } else {
    check_sizes(sizes, n, -1, "all_gather", "sizes");
    if (sizes[rank()] != tensor.size(0)) {
      throw UsageError("all_gather: sizes[" + std::to_string(rank()) +
                       "] = " + std::to_string(sizes[rank()]) + " but this worker's tensor has " +
                       std::to_string(tensor.size(0)) + " rows");
    }
  }
  const int64_t rows = *std::max_element(sizes.begin(), sizes.end());
  at::Tensor input = tensor.contiguous();
  return launch(
      "all_gather",
      [&](Work::State& work) {
        if (n == 1) {
          work.finish = [input](Work::State& done) { done.result = at::cat({input}, 0); };
          return;
        }
        path_for(&input).all_gather(work, input, sizes, rank());
        // As Gloo sends it (padded to the largest part): see Note [Bytes sent].
        count_sent(bytes_of_rows(input, rows) * (n - 1));
      },
      options.timeout, static_cast<int64_t>(tensor.nbytes()));
}

at::Tensor Group::all_gather(const at::Tensor& tensor, const AllGatherOptions& options) {
  auto work = launch_waited_at_once([&] { return all_gather_async(tensor, options); });
  work.wait();
  return work.result();
}

Work Group::all_to_all_async(const at::Tensor& input_tensor, const AllToAllOptions& options) {
  check_rows(input_tensor, "all_to_all");
  const int n = size();
  Sizes send =
      options.send_sizes.empty() ? split_sizes(input_tensor.size(0), n) : options.send_sizes;
  check_sizes(send, n, input_tensor.size(0), "all_to_all", "send_sizes");
  Sizes recv = options.recv_sizes;
  if (recv.empty()) {
    recv.assign(n, split_sizes(input_tensor.size(0), n)[rank()]);
  } else {
    check_sizes(recv, n, -1, "all_to_all", "recv_sizes");
  }
  at::Tensor input = input_tensor.contiguous();
  const int64_t total = std::accumulate(recv.begin(), recv.end(), int64_t{0});
  at::Tensor output = at::empty(shape_with_rows(input, total), input.options());
  return launch(
      "all_to_all",
      [&](Work::State& work) {
        if (n == 1) {
          output.copy_(input);
          work.finish = [output](Work::State& done) { done.result = output; };
          return;
        }
        count_sent(bytes_of_rows(input, input.size(0) - send[rank()]));
        path_for(&input).all_to_all(work, input, output, send, recv);
      },
      options.timeout, static_cast<int64_t>(input.nbytes()));
}

at::Tensor Group::all_to_all(const at::Tensor& input, const AllToAllOptions& options) {
  auto work = launch_waited_at_once([&] { return all_to_all_async(input, options); });
  work.wait();
  return work.result();
}

Work Group::reduce_scatter_async(const at::Tensor& input, const ReduceScatterOptions& options) {
  check_rows(input, "reduce_scatter");
  check_average(options.op, input, "reduce_scatter");
  const int n = size();
  Sizes sizes = options.sizes.empty() ? split_sizes(input.size(0), n) : options.sizes;
  check_sizes(sizes, n, input.size(0), "reduce_scatter", "sizes");
  at::Tensor contiguous = input.contiguous();
  const ReduceOp op = options.op;
  return launch(
      "reduce_scatter",
      [&](Work::State& work) {
        if (n == 1) {
          work.finish = [contiguous, op](Work::State& done) {
            done.result = reduce_rows(contiguous.unsqueeze(0), op);
          };
          return;
        }
        count_sent(bytes_of_rows(contiguous, contiguous.size(0) - sizes[rank()]));
        path_for(&contiguous).reduce_scatter(work, contiguous, sizes, rank(), op);
      },
      options.timeout, static_cast<int64_t>(contiguous.nbytes()));
}

at::Tensor Group::reduce_scatter(const at::Tensor& input, const ReduceScatterOptions& options) {
  auto work = launch_waited_at_once([&] { return reduce_scatter_async(input, options); });
  work.wait();
  return work.result();
}

namespace {
void check_peer(const Group& group, int peer, const char* op, const char* role) {
  if (peer < 0 || peer >= group.size() || peer == group.rank()) {
    throw UsageError(std::string(op) + ": " + role + " " + std::to_string(peer) +
                     " is not another member of a group of " + std::to_string(group.size()) +
                     " (this worker is " + std::to_string(group.rank()) + ")");
  }
}
}  // namespace

Work Group::send_async(const at::Tensor& tensor, int dst, const PointToPointOptions& options) {
  check_peer(*this, dst, "send", "destination");
  at::Tensor buffer = tensor.contiguous();
  return launch(
      "send",
      [&](Work::State& work) {
        work.point_to_point = true;
        path_for(nullptr).send(work, buffer, dst, options.tag);
        count_sent(static_cast<int64_t>(buffer.nbytes()));
        work.finish = [buffer](Work::State&) {};  // keeps the buffer alive until sent
      },
      options.timeout, static_cast<int64_t>(buffer.nbytes()), state_->members[dst]);
}

void Group::send(const at::Tensor& tensor, int dst, const PointToPointOptions& options) {
  send_async(tensor, dst, options).wait();
}

Work Group::recv_async(at::Tensor& tensor, int src, const PointToPointOptions& options) {
  check_peer(*this, src, "recv", "source");
  at::Tensor target = tensor;
  at::Tensor buffer = tensor.is_contiguous() ? tensor : tensor.contiguous();
  return launch(
      "recv",
      [&](Work::State& work) {
        work.point_to_point = true;
        path_for(nullptr).recv(work, buffer, src, options.tag);
        work.finish = [target, buffer](Work::State&) mutable {
          if (!buffer.is_same(target)) target.copy_(buffer);
        };
      },
      options.timeout, static_cast<int64_t>(buffer.nbytes()), state_->members[src]);
}

void Group::recv(at::Tensor& tensor, int src, const PointToPointOptions& options) {
  recv_async(tensor, src, options).wait();
}

at::Tensor Group::empty_shared(int64_t numel, at::ScalarType dtype) {
  if (numel < 0)
    throw UsageError("empty_shared: numel " + std::to_string(numel) + ", expected 0 or more");
  const auto options = at::TensorOptions().dtype(dtype);
  if (!state_ || size() == 1 || !state_->shm_path || numel == 0 || !shm_dtype(dtype))
    return at::empty({numel}, options);
  const auto bytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
  auto memory = std::make_shared<std::shared_ptr<unsigned char>>();
  launch_waited_at_once([&] {
    return launch(
        "empty_shared",
        [&](Work::State& work) {
          state_->shm_path->submit(work, [memory, bytes](shm::LocalGroup& group, Duration timeout) {
            *memory = group.allocate(bytes, timeout);
          });
        },
        kUnsetTimeout, static_cast<int64_t>(bytes));
  }).wait();
  if (!*memory) return at::empty({numel}, options);
  std::shared_ptr<unsigned char> keep = std::move(*memory);
  unsigned char* data = keep.get();
  return at::from_blob(
      data, {numel}, [keep = std::move(keep)](void*) mutable { keep.reset(); }, options);
}

Work Group::barrier_async(const BarrierOptions& options) {
  return launch(
      "barrier",
      [&](Work::State& work) {
        if (size() > 1) path_for(nullptr).barrier(work);
      },
      options.timeout, 0);
}

void Group::barrier(const BarrierOptions& options) {
  launch_waited_at_once([&] { return barrier_async(options); }).wait();
}

}  // namespace shoal::comm
