#include "server_membership.h"

#include <algorithm>
#include <cstdint>

#include "server_text.h"

namespace shoal::ps::detail {

ServerMembership::ServerMembership(const std::vector<int32_t>& workers) {
  for (int32_t w : workers) {
    live_.insert(w);
    sealed_[w] = 0;
    clock_[w] = 0;
  }
}

void ServerMembership::check_live(const char* what, int32_t w) const {
  if (gone_.count(w) != 0)
    bad(what, "worker " + std::to_string(w) +
                  " has left the job (its launcher saw it exit); expected a live worker");
  if (live_.count(w) == 0)
    bad(what, "worker " + std::to_string(w) + " is not live; expected one of " +
                  list_workers({live_.begin(), live_.end()}));
}

int64_t ServerMembership::clock_of(int32_t w) const {
  auto it = clock_.find(w);
  return it == clock_.end() ? 0 : it->second;
}

int64_t ServerMembership::slowest_clock(int64_t otherwise) const {
  int64_t slowest = INT64_MAX;
  for (int32_t w : live_) slowest = std::min(slowest, clock_.at(w));
  return live_.empty() ? otherwise : slowest;
}

int64_t ServerMembership::staleness() const {
  if (live_.empty()) return 0;
  int64_t fastest = 0;
  for (int32_t w : live_) fastest = std::max(fastest, clock_.at(w));
  return fastest - slowest_clock(0);
}

std::string ServerMembership::describe_staleness_wait(int64_t needed, int64_t bound) const {
  std::string waiting;
  for (int32_t w : live_)
    if (clock_.at(w) < needed)
      waiting += (waiting.empty() ? "" : ", ") + std::to_string(w) + " at clock " +
                 std::to_string(clock_.at(w));
  return "every live worker to reach clock " + std::to_string(needed) + " (staleness bound " +
         std::to_string(bound) + "; waiting for workers " + waiting + ")";
}

int64_t ServerMembership::sealed_clock(int32_t w) const {
  auto it = sealed_.find(w);
  return it == sealed_.end() ? 0 : it->second;
}

// Note [Sealed pushes]
// A worker pushes its step to every server, concurrently, and pulls only once every server has
// acknowledged its push. A pull at clock c therefore seals the worker's pushes of steps before c:
// each of them is held by every server. With sealed_pushes (elastic jobs) a push counts only once
// sealed: sync applies step c once every live worker has pushed it and sealed it, async and
// bounded staleness apply a push when its seal arrives. A worker that dies between its pushes to
// two servers has sealed that step nowhere, so no server applied it; one that dies after sealing
// it anywhere had pushed it everywhere. When it leaves, the highest clock it sealed on any server
// (sealed_clock, asked of every server) decides for all servers alike: its pushes before that
// clock count, the rest are dropped and their batches go back into the epoch's ledger. So a
// leaver's gradient counts or is discarded together with its samples, on every server.
bool ServerMembership::seal(int32_t w, int64_t clock) {
  int64_t& sealed = sealed_[w];
  if (clock <= sealed) return false;
  sealed = clock;
  return true;
}

const PushReply* ServerMembership::last_reply(int32_t w) const {
  auto it = last_reply_.find(w);
  return it == last_reply_.end() ? nullptr : &it->second;
}

void ServerMembership::start(int32_t w, int64_t clock) {
  clock_[w] = clock;
  sealed_[w] = clock;
  joined_at_[w] = clock;
  last_reply_.erase(w);  // a joiner's clock starts anew: no step of it was pushed yet
}

int64_t ServerMembership::slowest_staying(const std::set<int32_t>& next, int64_t otherwise) const {
  int64_t slowest = INT64_MAX;
  bool staying = false;
  for (int32_t w : live_) {
    if (next.count(w) == 0) continue;
    staying = true;
    slowest = std::min(slowest, clock_.at(w));
  }
  return staying ? slowest : otherwise;
}

// Note [Joins and leaves]
// An elastic job's worker joins each server by itself, once it is ready to train (a launcher
// that made it live at its start would stall sync steps for the seconds a program takes to load):
// join(w, 0) on every server answers the clock each makes it live from (its own step in sync, so
// that it blocks no step already open without it; its slowest worker's clock otherwise, so that
// it neither holds the others back nor lags), and the worker joins again on every server with the
// highest of them, C. A server that answered less raises the worker's clock to C and no longer
// waits for its pushes of steps before C, and no server can pass step C without its push of C
// once it is live there: after the second round every server has it live from C, and it pulls at
// C. A worker id is never live twice: a restarted worker joins under a new one.
//
// A worker is lost when its launcher sees its process exit. Requests of the dead process may
// still be in a server's threads, and a seal that arrived after its sealed clock was read would
// count a push on one server only; so the launcher first fences the worker off on every server
// (fence(): from then on the server takes no request of it, and answers its sealed clock, read
// under the same lock), and only then makes it leave everywhere with the highest sealed clock
// (leave(), Note [Sealed pushes]).
ServerMembership::Joined ServerMembership::join(int32_t w, int64_t clock, int64_t floor) {
  if (gone_.count(w) != 0)
    bad("join", "worker " + std::to_string(w) +
                    " has left the job; expected a new worker id for a worker that joins again");
  if (live_.count(w) == 0) {
    live_.insert(w);
    start(w, std::max(clock, floor));
    return Joined::kStarted;
  }
  if (clock > clock_[w] && clock_[w] == joined_at_[w]) {
    // Live here from an earlier clock than another server made it, and nothing pushed since.
    clock_[w] = clock;
    sealed_[w] = clock;
    joined_at_[w] = clock;
    return Joined::kRaised;
  }
  return Joined::kKept;
}

int64_t ServerMembership::fence(int32_t w) {
  gone_.insert(w);
  return sealed_clock(w);
}

void ServerMembership::check_leaving(int32_t w) const {
  if (live_.count(w) == 0)
    bad("leave", "worker " + std::to_string(w) + " is not live; expected one of " +
                     list_workers({live_.begin(), live_.end()}));
}

}  // namespace shoal::ps::detail
