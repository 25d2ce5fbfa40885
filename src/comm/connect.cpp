// Creating groups (Group::create, Group::subgroup: connecting their members over the job's
// store, then choosing their data paths) and the state they share with their Work handles.
#include <algorithm>
#include <numeric>
#include <set>
#include <thread>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "data_path.h"
#include "shoal/core/error.h"
#include "state.h"

namespace shoal::comm {

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
    state->gloo_path = gloo_path(state->backend);
    if (state->shm) state->shm_path = std::make_unique<ShmPath>(*state);
    if (state->hierarchy)
      state->hierarchical_path = hierarchical_path(*state->hierarchy, *state->gloo_path);
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

}  // namespace shoal::comm
