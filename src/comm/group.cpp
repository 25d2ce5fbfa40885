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

std::string join(const std::vector<int>& values) {
  std::string text;
  for (size_t i = 0; i < values.size(); ++i) text += (i ? ", " : "") + std::to_string(values[i]);
  return text;
}

std::string join(const Sizes& values) {
  std::string text;
  for (size_t i = 0; i < values.size(); ++i) text += (i ? ", " : "") + std::to_string(values[i]);
  return text;
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

// The element type of the shared-memory path for a tensor's dtype; nullopt: Gloo takes it.
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

std::vector<size_t> element_counts(const at::Tensor& like, const Sizes& rows) {
  std::vector<size_t> counts;
  for (auto r : rows) counts.push_back(elements(like, r));
  return counts;
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

// ----- Group::State -----

std::string Group::State::describe() const {
  return "workers [" + join(members) + "] (this worker: " + std::to_string(members[rank]) + ")";
}

void Group::State::mark_broken(const std::string& reason) {
  std::lock_guard<std::mutex> lock(mutex);
  if (!broken.exchange(true)) broken_reason = reason;
  // An operation still running on the shared-memory path waits for nobody now.
  if (shm) shm->cancel();
  if (hierarchy && hierarchy->local) hierarchy->local->cancel();
}

std::string Group::State::lost_members() const {
  // A group that says how to learn of lost members asks that instead of the store: in an elastic
  // job the store is a member's own, which may be the one that is gone (and reading it would
  // block for as long as the store's timeout).
  if (options.lost_check) return options.lost_check();
  if (!store) return "";
  // Members that failed come first: they are the cause. One that exited cleanly may only have
  // left after seeing the same failure, sooner than this worker.
  std::string failed, clean;
  for (int i = 0; i < size(); ++i) {
    if (i == rank) continue;
    std::string how;
    try {
      how = try_get(store, worker_exit_key(members[i]));
    } catch (const std::exception&) {
      continue;  // the store itself may be gone with the job; the deadline still holds
    }
    if (how.empty()) continue;
    std::string& list = how == "exited with code 0" ? clean : failed;
    list +=
        (list.empty() ? "" : "; ") + ("worker " + std::to_string(members[i]) + ", which " + how);
  }
  std::string lost = failed + (failed.empty() || clean.empty() ? "" : "; ") + clean;
  if (lost.empty()) return lost;
  // Those members may have left after a failure elsewhere in the job (a pipeline stage's members
  // see another stage's worker die first, and leave with its error): name that one too.
  std::string elsewhere;
  for (int r : job) {
    if (std::find(members.begin(), members.end(), r) != members.end()) continue;
    std::string how;
    try {
      how = try_get(store, worker_exit_key(r));
    } catch (const std::exception&) {
      continue;
    }
    if (how.empty() || how == "exited with code 0") continue;
    elsewhere +=
        (elsewhere.empty() ? "" : "; ") + ("worker " + std::to_string(r) + ", which " + how);
  }
  return elsewhere.empty() ? lost : lost + " (outside this group, the job lost " + elsewhere + ")";
}

Group::State::~State() {
  // A broken group may still have an operation blocked in a Gloo thread until the group's
  // timeout; c10d's destructor would join that thread. Leave the backend behind instead.
  if (broken && backend) (void)backend.release();
  if (broken && hierarchy && hierarchy->across) (void)hierarchy->across.release();
}

// ----- construction -----

// Note [Creating a group ends with a barrier]
// Gloo's connectFullMesh returns on a worker once its own end of every pair is connected, and
// that can be before the other end is: the end that connects is done at the TCP handshake, the
// end that listens only once its device thread has accepted, and a worker connects its pairs one
// after the other, so it may look at one pair long after the peer connected it. A member that
// returns first and then drops the group, or ends (a member whose next groups are all of one
// worker; a job that ends), closes sockets that a slower member has not yet looked at: that
// member's connect fails with "Connection closed by peer" although everyone arrived, and the
// members of its next group wait for it until their connect timeout ("Socket Timeout"). Under
// load on two cores this happened to Collectives.SubgroupsOfAnySubset/n3, whose worker 1 ends
// right after the world is connected. So, as torch.distributed does in init_process_group and
// new_group (its store-based barrier), a worker leaves Group::create/subgroup only once every
// member has connected its own ends: each writes `<prefix>/connected/<rank>`, adds one to
// `<prefix>/connected`, and polls that counter until it reaches the group's size. Polling with
// add(key, 0) rather than Store::wait: c10d 1.13's TCPStore cannot cancel a wait that timed out,
// and its late answer would be read as the reply to the next request.

// Each member writes `<counter>/<rank>` and adds one to `<counter>`; returns once the counter holds
// every member (Note [Creating a group ends with a barrier]).
void wait_for_members(Group::State& state, const std::string& counter, const Deadline& deadline) {
  put(state.store, counter + "/" + std::to_string(state.rank), "1");
  Duration pause(1);
  Deadline liveness(kLivenessPeriod);
  for (int64_t arrived = state.store->add(counter, 1); arrived < state.size();
       arrived = state.store->add(counter, 0)) {
    if (liveness.expired()) {
      liveness = Deadline(kLivenessPeriod);
      std::string lost = state.lost_members();
      // A member ends only after the counter is full; read it again before blaming one.
      if (!lost.empty() && state.store->add(counter, 0) < state.size()) {
        throw CommError("connecting " + state.describe() + " failed after " +
                        format_duration(deadline.elapsed()) + ": lost " + lost);
      }
    }
    if (deadline.expired()) {
      std::vector<int> missing;
      for (int i = 0; i < state.size(); ++i) {
        if (!state.store->check({counter + "/" + std::to_string(i)})) {
          missing.push_back(state.members[i]);
        }
      }
      throw CommError("connecting " + state.describe() + " timed out after " +
                      format_duration(deadline.elapsed()) + " waiting for workers [" +
                      join(missing) + "] to connect");
    }
    std::this_thread::sleep_for(std::min(pause, deadline.remaining()));
    pause = std::min(pause * 2, Duration(20));
  }
}

namespace {

std::shared_ptr<Group::State> connect(StorePtr store, std::string prefix, int rank,
                                      std::vector<int> members, const GroupOptions& options) {
  auto state = std::make_shared<Group::State>();
  state->store = store;
  state->prefix = prefix;
  state->options = options;
  state->rank = rank;
  state->members = std::move(members);
  if (state->size() == 1) return state;

  ignore_broken_pipes();
  Deadline deadline(options.timeout);
  const bool gloo_only = requested_path() == Path::kTcp;
  try {
    if (!gloo_only) put(store, prefix + "/locality/" + std::to_string(rank), this_locality());
    auto backend_options = c10d::ProcessGroupGloo::Options::create(options.timeout);
    backend_options->threads = options.threads;
    backend_options->devices.push_back(
        options.interface.empty()
            ? c10d::ProcessGroupGloo::createDeviceForHostname(options.bind_address)
            : c10d::ProcessGroupGloo::createDeviceForInterface(options.interface));
    auto scoped = c10::make_intrusive<c10d::PrefixStore>(prefix, store);
    state->backend =
        c10::make_intrusive<c10d::ProcessGroupGloo>(scoped, rank, state->size(), backend_options);
    // See Note [Creating a group ends with a barrier]
    wait_for_members(*state, prefix + "/connected", deadline);
    if (!gloo_only) open_paths(*state, deadline, backend_options);
  } catch (const shoal::Error&) {
    throw;
  } catch (const std::exception& e) {
    std::string what = e.what();
    if (auto* c10_error = dynamic_cast<const c10::Error*>(&e))
      what = c10_error->what_without_backtrace();
    what = what.substr(0, what.find('\n'));
    throw CommError("connecting " + state->describe() + " failed after " +
                    format_duration(deadline.elapsed()) + ": " + what);
  }
  return state;
}

}  // namespace

Group Group::create(StorePtr store, int rank, int size, const GroupOptions& options) {
  if (size < 1 || rank < 0 || rank >= size) {
    throw UsageError("Group::create: rank " + std::to_string(rank) + " of " + std::to_string(size) +
                     " workers; expected 0 <= rank < size");
  }
  if (size > 1 && !store)
    throw UsageError("Group::create: a group of " + std::to_string(size) +
                     " workers needs a store");
  std::vector<int> members(size);
  std::iota(members.begin(), members.end(), 0);
  return Group(connect(std::move(store), options.store_prefix, rank, std::move(members), options));
}

Group Group::single() {
  auto state = std::make_shared<Group::State>();
  state->members = {0};
  return Group(state);
}

Group Group::subgroup(std::vector<int> ranks) const {
  SHOAL_CHECK(state_ != nullptr) << "subgroup() on an empty Group";
  std::set<int> seen;
  for (int r : ranks) {
    if (r < 0 || r >= size() || !seen.insert(r).second) {
      throw UsageError("subgroup([" + join(ranks) + "]): expected distinct ranks in [0, " +
                       std::to_string(size()) + ") of " + state_->describe());
    }
  }
  auto me = std::find(ranks.begin(), ranks.end(), rank());
  if (me == ranks.end()) {
    throw UsageError("subgroup([" + join(ranks) + "]) is called by worker " +
                     std::to_string(state_->members[rank()]) + ", which is not among its members");
  }
  std::vector<int> members;
  for (int r : ranks) members.push_back(state_->members[r]);
  // Members number their subgroups of the same set alike, since they create them in the same
  // order; non-members never see the key.
  int count;
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    count = state_->subgroup_counts[join(members)]++;
  }
  std::string prefix = state_->prefix + "/sub[" + join(members) + "]#" + std::to_string(count);
  auto child = connect(state_->store, prefix, static_cast<int>(me - ranks.begin()), members,
                       state_->options);
  child->job = state_->job.empty() ? state_->members : state_->job;
  return Group(std::move(child));
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

bool Group::on_shared_memory(const at::Tensor& tensor) const {
  return state_->shm && shm_dtype(tensor.scalar_type()).has_value();
}

void Group::submit(Work::State& work, std::function<void(shm::LocalGroup&, Duration)> operation) {
  // Work::wait runs it on the caller when no membership of the group's own must be asked between
  // slices (wait_shared_memory); only then may the lane be left asleep.
  const bool wake = !std::exchange(waited_at_once, false) || state_->options.lost_check;
  work.shm_task = state_->shm->submit(
      [operation = std::move(operation), deadline = work.deadline](shm::LocalGroup& group) {
        operation(group, deadline.remaining());
      },
      wake);
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
        const Hierarchy* hierarchy = state_->hierarchy.get();
        bool averaged = false;  // kAvg's division done by the path itself
        if (n > 1 && buffer.numel() > 0 && on_shared_memory(buffer)) {
          const auto dtype = *shm_dtype(buffer.scalar_type());
          submit(work, [buffer, dtype, op](shm::LocalGroup& group, Duration timeout) {
            group.all_reduce(buffer.data_ptr(), buffer.numel(), dtype, to_shm(op), timeout);
          });
          averaged = true;
          count_sent(2 * static_cast<int64_t>(buffer.nbytes()) * (n - 1) / n);
        } else if (hierarchy && buffer.numel() > 0 && shm_dtype(buffer.scalar_type()) &&
                   static_cast<int64_t>(buffer.nbytes()) >= hierarchy->flat_below) {
          // Note [Hierarchical all-reduce] (path.cpp).
          if (hierarchy->local) {
            const auto dtype = *shm_dtype(buffer.scalar_type());
            // The lane is the hierarchy's own, so the hierarchy outlives what runs on it.
            work.shm_task = hierarchy->local->submit(
                [hierarchy, buffer, dtype, op, deadline = work.deadline](shm::LocalGroup& group) {
                  hierarchical_all_reduce(*hierarchy, group, buffer, dtype, to_shm(op),
                                          to_backend(op), deadline.remaining());
                });
            averaged = true;
          } else {
            // Alone on its host: the step across hosts is all there is.
            std::vector<at::Tensor> tensors{buffer};
            c10d::AllreduceOptions backend_options;
            backend_options.reduceOp = to_backend(op);
            work.backend_work = hierarchy->across->allreduce(tensors, backend_options);
          }
          count_sent(2 * static_cast<int64_t>(buffer.nbytes()) * (n - 1) / n);
        } else if (n > 1 && buffer.numel() > 0) {
          std::vector<at::Tensor> tensors{buffer};
          c10d::AllreduceOptions backend_options;
          backend_options.reduceOp = to_backend(op);
          work.backend_work = state_->backend->allreduce(tensors, backend_options);
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
        if (size() > 1 && buffer.numel() > 0 && on_shared_memory(buffer)) {
          const auto dtype = *shm_dtype(buffer.scalar_type());
          const int root = options.root;
          submit(work, [buffer, dtype, root](shm::LocalGroup& group, Duration timeout) {
            group.broadcast(buffer.data_ptr(), buffer.numel(), dtype, root, timeout);
          });
          count_sent(static_cast<int64_t>(buffer.nbytes()) * (size() - 1) / size());
        } else if (size() > 1 && buffer.numel() > 0) {
          std::vector<at::Tensor> tensors{buffer};
          c10d::BroadcastOptions backend_options;
          backend_options.rootRank = options.root;
          work.backend_work = state_->backend->broadcast(tensors, backend_options);
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
  if (n > 1 && on_shared_memory(tensor)) {
    // Parts of any size, straight into the output: no padding.
    at::Tensor input = tensor.contiguous();
    at::Tensor output = at::empty(
        shape_with_rows(input, std::accumulate(sizes.begin(), sizes.end(), int64_t{0})),
        input.options());
    const auto dtype = *shm_dtype(input.scalar_type());
    const auto counts = element_counts(input, sizes);
    return launch(
        "all_gather",
        [&](Work::State& work) {
          submit(work, [input, output, counts, dtype](shm::LocalGroup& group, Duration timeout) {
            group.all_gather(input.data_ptr(), output.data_ptr(), counts, dtype, timeout);
          });
          // As Gloo would send it (padded to the largest part): see Note [Bytes sent].
          count_sent(bytes_of_rows(input, rows) * (n - 1));
          work.finish = [output](Work::State& done) { done.result = output; };
        },
        options.timeout, static_cast<int64_t>(tensor.nbytes()));
  }
  // Gloo's all-gather needs equal parts: pad each to the largest, cut on completion.
  at::Tensor input = tensor.contiguous();
  if (input.size(0) != rows) {
    at::Tensor padded = at::zeros(shape_with_rows(input, rows), input.options());
    padded.narrow(0, 0, input.size(0)).copy_(input);
    input = padded;
  }
  return launch(
      "all_gather",
      [&](Work::State& work) {
        std::vector<at::Tensor> parts;
        if (n == 1) {
          parts.push_back(input);
        } else if (rows > 0 && input.numel() > 0) {
          std::vector<std::vector<at::Tensor>> outputs(1);
          for (int i = 0; i < n; ++i) outputs[0].push_back(at::empty_like(input));
          std::vector<at::Tensor> inputs{input};
          work.backend_work = state_->backend->allgather(outputs, inputs);
          count_sent(static_cast<int64_t>(input.nbytes()) * (n - 1));
          parts = outputs[0];
        } else {
          for (int i = 0; i < n; ++i) parts.push_back(input);  // nothing to send: all empty
        }
        work.finish = [parts, sizes](Work::State& done) {
          std::vector<at::Tensor> pieces;
          for (size_t i = 0; i < parts.size(); ++i)
            pieces.push_back(parts[i].narrow(0, 0, sizes[i]));
          done.result = at::cat(pieces, 0);
        };
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
        // Every member takes part even when it sends and receives nothing: Gloo numbers its
        // collectives, and one member skipping would pair the others' next call with this one.
        if (n == 1) {
          output.copy_(input);
        } else if (on_shared_memory(input)) {
          count_sent(bytes_of_rows(input, input.size(0) - send[rank()]));
          const auto dtype = *shm_dtype(input.scalar_type());
          submit(work, [input, output, dtype, send_counts = element_counts(input, send),
                        recv_counts = element_counts(input, recv)](shm::LocalGroup& group,
                                                                   Duration timeout) {
            group.all_to_all(input.data_ptr(), send_counts, output.data_ptr(), recv_counts, dtype,
                             timeout);
          });
        } else {
          // Before the call: c10d moves the sizes away.
          const int64_t to_others = bytes_of_rows(input, input.size(0) - send[rank()]);
          work.backend_work = state_->backend->alltoall_base(output, input, recv, send);
          count_sent(to_others);
        }
        work.finish = [output](Work::State& done) { done.result = output; };
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
  if (n > 1 && on_shared_memory(input)) {
    // Reduced where it lies: each member sums its own part of every member's input.
    at::Tensor contiguous = input.contiguous();
    at::Tensor output = at::empty(shape_with_rows(contiguous, sizes[rank()]), contiguous.options());
    const auto dtype = *shm_dtype(contiguous.scalar_type());
    const ReduceOp op = options.op;
    return launch(
        "reduce_scatter",
        [&](Work::State& work) {
          count_sent(bytes_of_rows(contiguous, contiguous.size(0) - sizes[rank()]));
          submit(work, [contiguous, output, dtype, op, counts = element_counts(contiguous, sizes)](
                           shm::LocalGroup& group, Duration timeout) {
            group.reduce_scatter(contiguous.data_ptr(), output.data_ptr(), counts, dtype,
                                 to_shm(op), timeout);
          });
          work.finish = [output](Work::State& done) { done.result = output; };
        },
        options.timeout, static_cast<int64_t>(contiguous.nbytes()));
  }
  // An all-to-all moves the same bytes as a ring reduce-scatter ((n-1)/n of the input per
  // worker) and handles uneven parts and every op; the reduction then runs locally.
  AllToAllOptions exchange;
  exchange.send_sizes = sizes;
  exchange.recv_sizes.assign(n, sizes[rank()]);
  exchange.timeout = options.timeout;
  Work work = all_to_all_async(input, exchange);
  work.state_->op = "reduce_scatter";
  work.state_->slice.rename("reduce_scatter");
  auto mine = sizes[rank()];
  const ReduceOp op = options.op;
  auto inner = std::move(work.state_->finish);
  work.state_->finish = [inner, n, mine, op](Work::State& done) {
    inner(done);
    auto shape = done.result.sizes().vec();
    shape[0] = mine;
    shape.insert(shape.begin(), n);
    done.result = reduce_rows(done.result.view(shape), op);
  };
  return work;
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
        if (state_->shm) {
          work.shm_task = state_->shm->send(dst, static_cast<uint32_t>(options.tag),
                                            buffer.data_ptr(), buffer.nbytes(), work.deadline,
                                            std::make_shared<at::Tensor>(buffer));
        } else {
          std::vector<at::Tensor> tensors{buffer};
          work.backend_work = state_->backend->send(tensors, dst, options.tag);
        }
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
        if (state_->shm) {
          work.shm_task = state_->shm->recv(src, static_cast<uint32_t>(options.tag),
                                            buffer.data_ptr(), buffer.nbytes(), work.deadline,
                                            std::make_shared<at::Tensor>(buffer));
        } else {
          std::vector<at::Tensor> tensors{buffer};
          work.backend_work = state_->backend->recv(tensors, src, options.tag);
        }
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
  if (!state_ || size() == 1 || !state_->shm || numel == 0 || !shm_dtype(dtype))
    return at::empty({numel}, options);
  const auto bytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
  auto memory = std::make_shared<std::shared_ptr<unsigned char>>();
  launch_waited_at_once([&] {
    return launch(
        "empty_shared",
        [&](Work::State& work) {
          submit(work, [memory, bytes](shm::LocalGroup& group, Duration timeout) {
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
        if (size() > 1 && state_->shm) {
          submit(work, [](shm::LocalGroup& group, Duration timeout) { group.barrier(timeout); });
        } else if (size() > 1) {
          work.backend_work = state_->backend->barrier();
        }
      },
      options.timeout, 0);
}

void Group::barrier(const BarrierOptions& options) {
  launch_waited_at_once([&] { return barrier_async(options); }).wait();
}

}  // namespace shoal::comm
