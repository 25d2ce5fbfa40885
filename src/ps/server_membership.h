// A parameter server's workers (part of ServerCore, server_core.h, which calls it with its lock
// held; it takes no lock itself): which are live, each one's clock (the steps it pushed) and
// sealed clock (Note [Sealed pushes]), the step it joined at, the workers fenced off (Note [Joins
// and leaves]) and the reply to each one's last push (Note [Retried pushes] in server_core.h).
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "messages.h"

namespace shoal::ps::detail {

class ServerMembership {
 public:
  // `workers` (which ServerCore has checked) are live from clock 0.
  explicit ServerMembership(const std::vector<int32_t>& workers);

  const std::set<int32_t>& live() const { return live_; }
  bool is_live(int32_t w) const { return live_.count(w) != 0; }
  bool is_gone(int32_t w) const { return gone_.count(w) != 0; }
  // UsageError naming the live workers, when `w` is not one of them.
  void check_live(const char* what, int32_t w) const;

  // Clocks: pushes received, per worker ever live.
  int64_t clock(int32_t w) const { return clock_.at(w); }  // a live worker's
  int64_t clock_of(int32_t w) const;                       // 0 for one never live
  void set_clock(int32_t w, int64_t clock) { clock_[w] = clock; }
  // The slowest live worker's clock, or `otherwise` when none is live.
  int64_t slowest_clock(int64_t otherwise) const;
  // The fastest live worker's clock minus the slowest's (0 when none is live).
  int64_t staleness() const;
  // Whether worker w joined after step `clock` (its push of that step is not waited for).
  bool joined_after(int32_t w, int64_t clock) const {
    auto it = joined_at_.find(w);
    return it != joined_at_.end() && it->second > clock;
  }
  // "every live worker to reach clock N (...)": what a pull waiting for the slowest worker waits
  // for, under the staleness bound `bound`.
  std::string describe_staleness_wait(int64_t needed, int64_t bound) const;

  // Sealed clocks (Note [Sealed pushes]).
  int64_t sealed(int32_t w) const { return sealed_.at(w); }  // a live worker's
  int64_t sealed_clock(int32_t w) const;                     // 0 for one never live
  // Worker w's clock is sealed up to `clock`: false (and no change) unless that is higher.
  bool seal(int32_t w, int64_t clock);

  // Note [Retried pushes] (server_core.h): the reply to the worker's last push, or null.
  const PushReply* last_reply(int32_t w) const;
  void set_last_reply(int32_t w, const PushReply& reply) { last_reply_[w] = reply; }

  // Changes of the live set (Note [Joins and leaves]). A worker that starts (becomes live) at
  // `clock`: its clock, sealed clock and join step are `clock`, and it has pushed nothing yet.
  void start(int32_t w, int64_t clock);
  // The slowest clock of the live workers that are in `next` too, or `otherwise` if none is.
  int64_t slowest_staying(const std::set<int32_t>& next, int64_t otherwise) const;
  void set_live(const std::set<int32_t>& next) { live_ = next; }
  // join(): worker w asks to be live from `clock`, and `floor` is the lowest clock it may start
  // at (the step, or the slowest worker's clock). kStarted: it is live now, from max(clock,
  // floor); kRaised: it was live already and its clock was raised to `clock`; kKept: neither.
  // UsageError for a worker fenced off.
  enum class Joined { kStarted, kRaised, kKept };
  Joined join(int32_t w, int64_t clock, int64_t floor);
  // The worker is fenced off: no request of it is taken from now on. Returns its sealed clock.
  int64_t fence(int32_t w);
  // leave(): UsageError naming the live workers, when `w` is not one of them.
  void check_leaving(int32_t w) const;
  void remove(int32_t w) { live_.erase(w); }

 private:
  std::set<int32_t> live_;
  std::map<int32_t, int64_t> clock_;      // pushes received, per worker ever live
  std::map<int32_t, int64_t> sealed_;     // sealed_pushes: per worker, its sealed clock
  std::map<int32_t, int64_t> joined_at_;  // per worker: the step it joined at (0: from the start)
  std::set<int32_t> gone_;                // fenced off: no request of these is taken
  std::map<int32_t, PushReply> last_reply_;  // per worker: the reply to its last push
};

}  // namespace shoal::ps::detail
