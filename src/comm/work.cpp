#include "shoal/comm/work.h"

#include <thread>

#include <c10/util/Exception.h>

#include "core/error_text.h"
#include "shoal/core/error.h"
#include "state.h"

namespace shoal::comm {
namespace {

std::string others(const Group::State& group) {
  std::string text = "[";
  bool first = true;
  for (int i = 0; i < group.size(); ++i) {
    if (i == group.rank) continue;
    text += (first ? "" : ", ") + std::to_string(group.members[i]);
    first = false;
  }
  return text + "]";
}

[[noreturn]] void fail(Work::State& work, const std::string& what) {
  work.slice.end();
  const std::string message = work.op + " on " + work.group->describe() + " " + what;
  work.group->mark_broken(message);
  throw CommError(message);
}

// The path reported an error: usually a peer's socket closed (Gloo) or its process ended (shared
// memory). Its launcher's record of how it ended may lag by a few milliseconds, so give it a
// moment to name the lost worker. With no record (no launcher that keeps them, or not a lost peer
// at all) the path's words must do, and `member`, the group rank of a member the path saw end
// (-1: none), is named from them.
[[noreturn]] void fail_with_backend_error(Work::State& work, const std::exception& e,
                                          const char* path = "gloo", int member = -1) {
  const auto waited = work.deadline.elapsed();
  std::string lost = work.group->lost_members();
  // A membership (lost_check) learns of a death by probing, which the caller starts after this
  // error; waiting here would only delay it.
  const bool records = !work.group->options.lost_check;
  for (Deadline grace(std::chrono::seconds(1)); records && lost.empty() && !grace.expired();) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    lost = work.group->lost_members();
  }
  if (lost.empty() && member >= 0) {
    lost = "worker " + std::to_string(work.group->members[member]) + ", whose process ended";
  }
  fail(work, "failed after " + format_duration(waited) + ": " +
                 (lost.empty() ? "" : "lost " + lost + " ") + "(" + path + ": " + one_line(e) +
                 ")");
}

// Between two slices of a wait: fails the operation when its deadline has passed or a member is
// known to be gone.
void check_between_slices(Work::State& work, const Deadline& deadline) {
  if (deadline.expired()) {
    fail(work, "timed out after " + format_duration(work.deadline.elapsed()) +
                   " waiting for workers " + others(*work.group));
  }
  std::string lost = work.group->lost_members();
  if (!lost.empty()) {
    fail(work, "failed after " + format_duration(work.deadline.elapsed()) + ": lost " + lost);
  }
}

// Waits for an operation on the shared-memory path: in slices, asking between them who is gone,
// as for Gloo's collectives; the operation's own waits watch the members' processes and its
// deadline, so its end usually comes first.
//
// Note [Ending at the operation's own deadline]: the operation's deadline is the Work's, taken
// again on its lane (Deadline(remaining())), so up to a millisecond later. When the Work's passes,
// the operation is let end by its own, within kOwnDeadlineGrace, rather than abandoned: a timeout
// is written in the segment as a timeout, and the other members, whose deadlines come a moment
// later, report theirs as timeouts too. Abandoned, it read "member 1 failed first: ... its caller
// stopped waiting", and a member that had already exited after its own timeout was reported lost.
//
// A caller that waits for as long as the operation may take, in a group whose members' ends the
// operation's own waits see (all on this host, with no membership of its own to ask: lost_check
// polls what the segment cannot show), runs the operation itself when no lane thread has taken it
// yet (Note [Running on the waiter], executor.cpp): asking between slices would add nothing.
void wait_shared_memory(Work::State& work, const Deadline& deadline, bool whole) {
  constexpr Duration kOwnDeadlineGrace{1000};
  if (whole && work.group->shm && !work.group->options.lost_check) {
    work.group->shm->run_here(work.shm_task);
  }
  while (!work.shm_task->wait_for(std::min(kLivenessPeriod, deadline.remaining()))) {
    if (deadline.expired() && work.deadline.expired() && work.shm_task->wait_for(kOwnDeadlineGrace)) break;
    check_between_slices(work, deadline);
  }
  if (auto error = work.shm_task->error()) {
    try {
      std::rethrow_exception(error);
    } catch (const UsageError&) {
      work.slice.end();
      throw;  // the members disagreed on the call (all_to_all's counts); the group stays usable
    } catch (const shm::WaitFailed& e) {
      // A member that timed out first waited for the same late member as this one, which would
      // time out a moment later (their deadlines differ by how far apart they launched): it does
      // so at its own deadline, as over Gloo, so that every member's error says the same.
      if (e.kind == shm::FailureKind::kTimedOut || work.deadline.expired()) {
        std::this_thread::sleep_for(work.deadline.remaining());
        fail(work, "timed out after " + format_duration(work.deadline.elapsed()) +
                       " waiting for workers " + others(*work.group) + " (shared memory: " +
                       e.what() + ")");
      }
      fail_with_backend_error(work, e, "shared memory",
                              e.kind == shm::FailureKind::kLost ? e.member : -1);
    } catch (const NetworkFailed& e) {
      // The step across hosts of a hierarchical all-reduce (Note [Hierarchical all-reduce]).
      if (work.deadline.expired()) {
        fail(work, "timed out after " + format_duration(work.deadline.elapsed()) +
                       " waiting for workers " + others(*work.group) + " (gloo: " + e.what() +
                       ")");
      }
      fail_with_backend_error(work, e, "gloo");
    } catch (const std::exception& e) {
      fail_with_backend_error(work, e, "shared memory");
    }
  }
}

}  // namespace

void Work::wait(Duration timeout) {
  SHOAL_CHECK(state_ != nullptr) << "wait() on an empty Work";
  State& work = *state_;
  if (work.done) return;
  if (work.shm_task) {
    const bool whole = timeout == kUnsetTimeout || timeout >= work.deadline.remaining();
    wait_shared_memory(work, Deadline(whole ? work.deadline.remaining() : timeout), whole);
  } else if (work.backend_work) {
    const Duration limit = timeout == kUnsetTimeout ? work.deadline.remaining()
                                                    : std::min(timeout, work.deadline.remaining());
    Deadline deadline(limit);
    if (work.point_to_point) {
      // A Gloo send/recv can only be waited on once; wait for the whole time.
      try {
        work.backend_work->wait(std::max(deadline.remaining(), Duration(1)));
      } catch (const std::exception& e) {
        if (work.deadline.expired() || deadline.expired()) {
          fail(work, "timed out after " + format_duration(work.deadline.elapsed()) +
                         " waiting for workers " + others(*work.group));
        }
        fail_with_backend_error(work, e);
      }
    } else {
      for (;;) {
        try {
          work.backend_work->wait(std::min(kLivenessPeriod, deadline.remaining()));
          break;
        } catch (const std::exception&) {
          // c10d's wait(timeout) throws both when the slice runs out and when the operation
          // failed. An operation that completed between the two is judged by its own status.
          if (work.backend_work->isCompleted()) {
            if (work.backend_work->isSuccess()) break;
            try {
              std::rethrow_exception(work.backend_work->exception());
            } catch (const std::exception& failure) {
              fail_with_backend_error(work, failure);
            }
          }
        }
        check_between_slices(work, deadline);
      }
    }
  }
  if (work.finish) work.finish(work);
  work.done = true;
  work.slice.end();
}

Work& Work::then(std::function<void(const at::Tensor&)> next) {
  SHOAL_CHECK(state_ != nullptr) << "then() on an empty Work";
  if (state_->done) {
    next(state_->result);
    return *this;
  }
  auto before = std::move(state_->finish);
  state_->finish = [before = std::move(before), next = std::move(next)](State& work) {
    if (before) before(work);
    next(work.result);
  };
  return *this;
}

bool Work::is_completed() const {
  SHOAL_CHECK(state_ != nullptr) << "is_completed() on an empty Work";
  if (state_->done) return true;
  if (state_->shm_task) return state_->shm_task->done();
  return !state_->backend_work || state_->backend_work->isCompleted();
}

const at::Tensor& Work::result() const {
  SHOAL_CHECK(state_ != nullptr) << "result() on an empty Work";
  if (!state_->done) throw UsageError(state_->op + ": result() called before wait()");
  return state_->result;
}

}  // namespace shoal::comm
