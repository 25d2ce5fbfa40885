// Which path a connected group's data takes: Gloo, shared memory among members on one host, or the
// hierarchy of both for a group across hosts (docs/comm.md, "Shared memory among co-located
// workers" and "Across hosts: the hierarchical all-reduce").
#include <algorithm>
#include <map>
#include <optional>
#include <thread>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "comm/shm/locality.h"
#include "shoal/core/env.h"
#include "shoal/core/error.h"
#include "data_path.h"
#include "state.h"

namespace shoal::comm {

// Note [Choosing the shared-memory path]
// SHOAL_COMM says which path a group of several members takes: "auto" (the default) uses shared
// memory among the members that share a host, when there are any (same boot, network namespace,
// pid namespace and user: Note [Locality key] in shm/locality.h) and every segment can be made
// and opened, else Gloo; "tcp" always Gloo; "shm" shared memory or a CommError saying why not.
// All members on one host: every operation takes the host's segment. Members on several hosts,
// some sharing one: the all-reduce is hierarchical (Note [Hierarchical all-reduce]); the other
// operations take Gloo over all members. The members decide together, through the store, so
// that all take the same path: each writes its key before the connect barrier (so all keys are
// there after it); every member reads them all and numbers the hosts alike (in the order of
// their first member); on each host with several members its first member creates the segment
// and writes its handle, or why it could not; the others open it; every member writes "ok" or
// why not; after a second barrier every member reads the same answers. The creator holds its
// segment open until then, which /proc-opening needs (Note [Segment by /proc]). Gloo is
// connected either way: the dtypes shared memory does not reduce (bool, int16, complex) still
// take it. Send and recv move bytes and take shared memory whatever the dtype.
Path requested_path() {
  const auto value = env::get(env::current(), "SHOAL_COMM");
  if (!value || value->empty() || *value == "auto") return Path::kAuto;
  if (*value == "tcp") return Path::kTcp;
  if (*value == "shm") return Path::kShm;
  throw UsageError("SHOAL_COMM=" + *value + ": expected auto, tcp or shm");
}

std::string this_locality() {
  try {
    return shm::locality_key();
  } catch (const CommError& e) {
    return std::string("- ") + e.what();  // no key: never equal to another's
  }
}

namespace {

// Note [Hierarchical all-reduce]
// A group across hosts with several members on some host all-reduces in three steps:
//  1. inside each host, through its segment, a reduce-scatter hands slice j of the host's sum to
//     the host's member j, for j < S, S being the fewest members any host has (the others
//     hold an empty slice);
//  2. member j of every host all-reduces slice j with the other hosts' member j over Gloo: S
//     groups of one member per host, each moving 1/S of the data, side by side on the network;
//  3. inside each host an all-gather spreads the slices to every member.
// Steps 1 and 3 sum and copy at memory speed; only step 2 crosses the network, once per host
// rather than once per member as a flat ring over all members does. The result is the same on
// every member: each slice is summed in one fixed order inside the host (Note [Fixed summation
// order]) and then by Gloo, which gives every member of its group the same bits. All-reduces
// below SHOAL_COMM_FLAT_BELOW bytes take Gloo's flat ring over all members instead. Its default
// is 0, by measurement: on two hosts of two workers, over the 1 Gbit/s shaped link and over the
// bare veth pair, the hierarchy was faster at every size from 4 KiB to 64 MiB (1.3-2.2x the
// flat ring; bench/allreduce.sh, bench/RESULTS.md 2026-11-27): the flat ring's six steps cost
// more than the hierarchy's two memory steps even where latency dominates. The variable is there
// for networks where the crossing is measured elsewhere.
// The three steps run as one task on the collectives' lane of the host's executor, so the
// operation stays asynchronous; the Gloo step is waited for in slices (250 ms, as in Work::wait)
// that look at the lane's cancellation, so that a group broken by a failure elsewhere frees the
// lane within a slice.
constexpr int64_t kDefaultFlatBelow = 0;

int64_t flat_below() {
  const auto value = env::get(env::current(), "SHOAL_COMM_FLAT_BELOW");
  if (!value || value->empty()) return kDefaultFlatBelow;
  char* end = nullptr;
  const long long bytes = std::strtoll(value->c_str(), &end, 10);
  if (end == value->c_str() || *end != '\0' || bytes < 0)
    throw UsageError("SHOAL_COMM_FLAT_BELOW=" + *value +
                     ": expected a number of bytes >= 0 (all-reduces smaller than it take the "
                     "flat ring across hosts)");
  return bytes;
}

// Waits for `key` to be set, until the deadline, failing early when a member has ended (the one
// that was to set it, killed while the group connects); `what` names what the key holds.
std::string wait_for_key(Group::State& state, const std::string& key, const std::string& what,
                         const Deadline& deadline) {
  Duration pause(1);
  Deadline liveness(kLivenessPeriod);
  for (;;) {
    std::string value = try_get(state.store, key);
    if (!value.empty()) return value;
    if (liveness.expired()) {
      liveness = Deadline(kLivenessPeriod);
      const std::string lost = state.lost_members();
      if (!lost.empty() && try_get(state.store, key).empty()) {
        throw CommError("connecting " + state.describe() + " failed after " +
                        format_duration(deadline.elapsed()) + " waiting for " + what + ": lost " +
                        lost);
      }
    }
    if (deadline.expired()) {
      throw CommError("connecting " + state.describe() + " timed out after " +
                      format_duration(deadline.elapsed()) + " waiting for " + what);
    }
    std::this_thread::sleep_for(std::min(pause, deadline.remaining()));
    pause = std::min(pause * 2, Duration(20));
  }
}

// The members' hosts: host_of[i] for group rank i, hosts numbered in the order of their first
// member; a member without a key is a host of its own.
struct Hosts {
  std::vector<int> host_of;
  std::vector<std::vector<int>> members;  // group ranks, in order, of each host
};

Hosts read_hosts(Group::State& state) {
  Hosts hosts;
  std::map<std::string, int> index;
  for (int i = 0; i < state.size(); ++i) {
    const std::string key =
        try_get(state.store, state.prefix + "/locality/" + std::to_string(i));
    const bool shareable = !key.empty() && key[0] != '-';
    auto found = shareable ? index.find(key) : index.end();
    if (found == index.end()) {
      const int host = static_cast<int>(hosts.members.size());
      if (shareable) index[key] = host;
      hosts.members.emplace_back();
      hosts.host_of.push_back(host);
    } else {
      hosts.host_of.push_back(found->second);
    }
    hosts.members[hosts.host_of.back()].push_back(i);
  }
  return hosts;
}

// This member's segment among `local` (group ranks of its host, several), made by local[0] and
// opened by the others; or nullopt, with `status` saying why not.
std::optional<shm::Segment> make_segment(Group::State& state, const std::vector<int>& local,
                                         int host, const Deadline& deadline, std::string& status) {
  const std::string handle_key = state.prefix + "/shm/handle/" + std::to_string(host);
  const int size = static_cast<int>(local.size());
  if (state.rank == local[0]) {
    std::string handle;
    std::optional<shm::Segment> segment;
    try {
      segment.emplace(shm::Segment::create(size));
      handle = segment->handle();
    } catch (const CommError& e) {
      status = e.what();
      handle = "- " + status;
    }
    put(state.store, handle_key, handle);
    return segment;
  }
  const std::string creator = std::to_string(state.members[local[0]]);
  const std::string handle =
      wait_for_key(state, handle_key, "worker " + creator + "'s shared-memory segment", deadline);
  if (handle[0] == '-') {
    status = "worker " + creator + ": " + handle.substr(2);
    return std::nullopt;
  }
  try {
    return shm::Segment::open(handle, size);
  } catch (const CommError& e) {
    status = "worker " + std::to_string(state.members[state.rank]) + ": " + e.what();
    return std::nullopt;
  }
}

std::string join_members(const Group::State& state, const std::vector<int>& ranks) {
  std::string text;
  for (int r : ranks) text += (text.empty() ? "" : ", ") + std::to_string(state.members[r]);
  return text;
}

}  // namespace

void open_paths(Group::State& state, const Deadline& deadline,
                const c10::intrusive_ptr<c10d::ProcessGroupGloo::Options>& backend_options) {
  const Path path = requested_path();
  if (path == Path::kTcp) return;
  const Hosts hosts = read_hosts(state);
  const int host = hosts.host_of[state.rank];
  const std::vector<int>& local = hosts.members[host];
  size_t most = 0;
  for (const auto& members : hosts.members) most = std::max(most, members.size());
  if (most < 2) {
    if (path == Path::kShm) {
      throw CommError("SHOAL_COMM=shm, but " + state.describe() +
                      " cannot share memory: no two of them are on one host (locality keys "
                      "differ: Note [Locality key])");
    }
    return;
  }

  std::optional<shm::Segment> segment;
  std::string status = "ok";
  if (local.size() > 1) segment = make_segment(state, local, host, deadline, status);
  put(state.store, state.prefix + "/shm/status/" + std::to_string(state.rank), status);
  wait_for_members(state, state.prefix + "/shm/opened", deadline);
  for (int i = 0; i < state.size(); ++i) {
    const std::string answer =
        try_get(state.store, state.prefix + "/shm/status/" + std::to_string(i));
    if (answer == "ok") continue;
    if (path == Path::kShm) {
      throw CommError("SHOAL_COMM=shm, but " + state.describe() +
                      " cannot share memory: " + answer);
    }
    return;  // every member read the same answer: all take Gloo
  }

  const int local_rank =
      static_cast<int>(std::find(local.begin(), local.end(), state.rank) - local.begin());
  std::unique_ptr<shm::Executor> executor;
  if (segment) {
    auto group = std::make_unique<shm::LocalGroup>(std::move(*segment), local_rank,
                                                   std::max(deadline.remaining(), Duration(1)));
    executor = std::make_unique<shm::Executor>(std::move(group));
  }
  if (hosts.members.size() == 1) {
    state.shm = std::move(executor);
    return;
  }

  auto hierarchy = std::make_unique<Hierarchy>();
  hierarchy->local = std::move(executor);
  hierarchy->local_rank = local_rank;
  hierarchy->local_size = static_cast<int>(local.size());
  hierarchy->hosts = static_cast<int>(hosts.members.size());
  hierarchy->members = static_cast<int>(state.members.size());
  hierarchy->flat_below = flat_below();
  size_t fewest = local.size();
  for (const auto& members : hosts.members) fewest = std::min(fewest, members.size());
  hierarchy->slices = static_cast<int>(fewest);
  // Member j of every host, for j < slices, forms slice j's group across hosts; each connects
  // its own, under a prefix that names the members so that a retry never meets an old one.
  if (local_rank < hierarchy->slices) {
    std::vector<int> across;
    for (const auto& members : hosts.members) across.push_back(members[local_rank]);
    auto scoped = c10::make_intrusive<c10d::PrefixStore>(
        state.prefix + "/across[" + join_members(state, across) + "]", state.store);
    hierarchy->across = c10::make_intrusive<c10d::ProcessGroupGloo>(scoped, host,
                                                                     hierarchy->hosts,
                                                                     backend_options);
  }
  // Every group across hosts is connected before any member all-reduces: the same barrier as
  // the group's own (Note [Creating a group ends with a barrier]).
  wait_for_members(state, state.prefix + "/across/connected", deadline);
  state.hierarchy = std::move(hierarchy);
}

namespace {

// Note [Hierarchical all-reduce] as a data path (Note [Data paths]); the other operations take
// the flat path over all members.
class HierarchicalPath final : public DataPath {
 public:
  HierarchicalPath(const Hierarchy& hierarchy, DataPath& flat) : hierarchy_(hierarchy), flat_(flat) {}

  bool all_reduce(Work::State& work, const at::Tensor& buffer, ReduceOp op) override {
    if (hierarchy_.local) {
      const auto dtype = *shm_dtype(buffer.scalar_type());
      // The lane is the hierarchy's own, so the hierarchy outlives what runs on it.
      work.shm_task = hierarchy_.local->submit(
          [hierarchy = &hierarchy_, buffer, dtype, op, deadline = work.deadline](shm::LocalGroup& group) {
            hierarchical_all_reduce(*hierarchy, group, buffer, dtype, to_shm(op), to_backend(op),
                                    deadline.remaining());
          });
      return true;
    }
    // Alone on its host: the step across hosts is all there is.
    std::vector<at::Tensor> tensors{buffer};
    c10d::AllreduceOptions options;
    options.reduceOp = to_backend(op);
    work.backend_work = hierarchy_.across->allreduce(tensors, options);
    return false;
  }
  void broadcast(Work::State& work, const at::Tensor& buffer, int root) override {
    flat_.broadcast(work, buffer, root);
  }
  void all_gather(Work::State& work, const at::Tensor& input, const Sizes& sizes,
                  int rank) override {
    flat_.all_gather(work, input, sizes, rank);
  }
  void all_to_all(Work::State& work, const at::Tensor& input, const at::Tensor& output,
                  const Sizes& send, const Sizes& recv) override {
    flat_.all_to_all(work, input, output, send, recv);
  }
  void reduce_scatter(Work::State& work, const at::Tensor& input, const Sizes& sizes, int rank,
                      ReduceOp op) override {
    flat_.reduce_scatter(work, input, sizes, rank, op);
  }
  void send(Work::State& work, const at::Tensor& buffer, int dst, int tag) override {
    flat_.send(work, buffer, dst, tag);
  }
  void recv(Work::State& work, const at::Tensor& buffer, int src, int tag) override {
    flat_.recv(work, buffer, src, tag);
  }
  void barrier(Work::State& work) override { flat_.barrier(work); }

 private:
  const Hierarchy& hierarchy_;
  DataPath& flat_;
};

}  // namespace

std::unique_ptr<DataPath> hierarchical_path(const Hierarchy& hierarchy, DataPath& flat) {
  return std::make_unique<HierarchicalPath>(hierarchy, flat);
}

void hierarchical_all_reduce(const Hierarchy& hierarchy, shm::LocalGroup& local,
                             const at::Tensor& buffer, shm::DType dtype, shm::ReduceOp op,
                             c10d::ReduceOp backend_op, Duration timeout) {
  Deadline deadline(timeout);
  const int64_t count = buffer.numel();
  const Sizes slices = split_sizes(count, hierarchy.slices);
  std::vector<size_t> counts(hierarchy.local_size, 0);
  for (int j = 0; j < hierarchy.slices; ++j) counts[j] = static_cast<size_t>(slices[j]);
  int64_t offset = 0;
  for (int j = 0; j < hierarchy.local_rank; ++j) offset += static_cast<int64_t>(counts[j]);
  const int64_t mine = static_cast<int64_t>(counts[hierarchy.local_rank]);
  auto* data = static_cast<unsigned char*>(buffer.data_ptr());
  unsigned char* part = data + offset * buffer.element_size();

  // Step 1 (Note [Hierarchical all-reduce]); a host of one member holds its own sum already. An
  // average is a sum until its slice is divided, after step 2.
  const bool average = op == shm::ReduceOp::kAvg;
  const shm::ReduceOp local_op = average ? shm::ReduceOp::kSum : op;
  if (hierarchy.local_size > 1) {
    local.reduce_scatter(data, part, counts, dtype, local_op, deadline.remaining());
  }
  // Step 2: slice `local_rank`, across hosts.
  if (hierarchy.across && mine > 0) {
    std::vector<at::Tensor> tensors{buffer.view({-1}).narrow(0, offset, mine)};
    c10d::AllreduceOptions options;
    options.reduceOp = backend_op;
    auto work = hierarchy.across->allreduce(tensors, options);
    // As Work::wait's: each slice that runs out costs c10d a timeout error with a backtrace, so
    // not shorter; a broken group's cancellation is seen within one.
    constexpr Duration kSlice{250};
    for (;;) {
      try {
        work->wait(std::min(kSlice, std::max(deadline.remaining(), Duration(1))));
        break;
      } catch (const std::exception& e) {
        if (work->isCompleted()) {
          if (work->isSuccess()) break;
          try {
            std::rethrow_exception(work->exception());
          } catch (const c10::Error& failure) {
            throw NetworkFailed(failure.what_without_backtrace());
          } catch (const std::exception& failure) {
            throw NetworkFailed(failure.what());
          }
        }
      }
      if (local.cancelled()) throw CommError("cancelled: the group is broken");
      if (deadline.expired()) {
        throw NetworkFailed("the all-reduce across hosts of slice " +
                            std::to_string(hierarchy.local_rank) + " timed out");
      }
    }
  }
  if (average && mine > 0) buffer.view({-1}).narrow(0, offset, mine).div_(hierarchy.members);
  // Step 3.
  if (hierarchy.local_size > 1) local.all_gather(part, data, counts, dtype, deadline.remaining());
}

}  // namespace shoal::comm
