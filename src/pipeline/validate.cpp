// validate() and simulate(): a schedule's lists checked and timed without running them
// (docs/pipeline.md, "Schedules as data"). Both replay the lists as the runtime runs them: each
// worker in its order, a send never blocks, a receive waits until its send has run.
#include <algorithm>
#include <cmath>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "shoal/core/error.h"
#include "shoal/pipeline/schedule.h"

namespace shoal::pipeline {

namespace {

constexpr int kKinds = 8;

bool is_receive(ActionKind kind) {
  return kind == ActionKind::kRecvActivation || kind == ActionKind::kRecvGradient;
}
bool is_transfer(ActionKind kind) {
  return kind == ActionKind::kSendActivation || kind == ActionKind::kRecvActivation ||
         kind == ActionKind::kSendGradient || kind == ActionKind::kRecvGradient;
}

// The stage at the other end of a transfer.
int peer_stage(const Action& a) {
  return a.kind == ActionKind::kSendActivation || a.kind == ActionKind::kRecvGradient ? a.stage + 1
                                                                                      : a.stage - 1;
}

// The action at the other end of a transfer: SA of stage s pairs with RA of s + 1, SG of stage
// s with RG of s - 1.
Action partner(const Action& a) {
  switch (a.kind) {
    case ActionKind::kSendActivation:
      return {ActionKind::kRecvActivation, a.stage + 1, a.micro_batch};
    case ActionKind::kRecvActivation:
      return {ActionKind::kSendActivation, a.stage - 1, a.micro_batch};
    case ActionKind::kSendGradient:
      return {ActionKind::kRecvGradient, a.stage - 1, a.micro_batch};
    case ActionKind::kRecvGradient:
      return {ActionKind::kSendGradient, a.stage + 1, a.micro_batch};
    default:
      return a;
  }
}

// Where each action is in its worker's list. Every action of stage s is on the worker that holds
// s (validate checks that first), so (kind, stage, micro-batch) names one place.
class ActionIndex {
 public:
  explicit ActionIndex(const Schedule& schedule)
      : stages_(schedule.stages),
        micro_batches_(schedule.micro_batches),
        at_(static_cast<size_t>(kKinds) * static_cast<size_t>(stages_) *
                static_cast<size_t>(micro_batches_),
            -1) {}

  // The action's index in its worker's list, or -1 when the list does not have it.
  int find(const Action& a) const {
    if (a.stage < 0 || a.stage >= stages_ || a.micro_batch < 0 || a.micro_batch >= micro_batches_) {
      return -1;
    }
    return at_[slot(a)];
  }
  int& operator[](const Action& a) { return at_[slot(a)]; }

 private:
  size_t slot(const Action& a) const {
    return (static_cast<size_t>(a.kind) * static_cast<size_t>(stages_) +
            static_cast<size_t>(a.stage)) *
               static_cast<size_t>(micro_batches_) +
           static_cast<size_t>(a.micro_batch);
  }

  int stages_;
  int micro_batches_;
  std::vector<int> at_;
};

class Checker {
 public:
  explicit Checker(const Schedule& schedule) : schedule_(schedule) {}

  [[noreturn]] void fail(const std::string& what) const {
    std::string prefix = "invalid pipeline schedule";
    if (!schedule_.name.empty()) prefix += " '" + schedule_.name + "'";
    throw UsageError(prefix + ": " + what);
  }
  std::string where(int worker, int index) const {
    const Action& a = schedule_.actions[static_cast<size_t>(worker)][static_cast<size_t>(index)];
    return "worker " + std::to_string(worker) + ", action " + std::to_string(index) + " (" +
           a.describe() + ")";
  }
  // "worker 1, action 7 (...)" for an action of the list, by its identity.
  std::string where(const Action& a, int index) const {
    return where(schedule_.worker_of(a.stage), index);
  }

 private:
  const Schedule& schedule_;
};

void check_shape(const Schedule& s, const Checker& check) {
  if (s.workers < 1) check.fail("workers = " + std::to_string(s.workers) + "; expected at least 1");
  if (s.stages < 1 || s.stages % s.workers != 0) {
    check.fail("stages = " + std::to_string(s.stages) + " on " + std::to_string(s.workers) +
               " workers; expected a positive multiple of the workers (v stages on each)");
  }
  if (s.micro_batches < 1) {
    check.fail("micro_batches = " + std::to_string(s.micro_batches) + "; expected at least 1");
  }
  if (s.stage_worker.size() != static_cast<size_t>(s.stages)) {
    check.fail("stage_worker has " + std::to_string(s.stage_worker.size()) +
               " entries; expected one per stage (" + std::to_string(s.stages) + ")");
  }
  for (int stage = 0; stage < s.stages; ++stage) {
    const int w = s.worker_of(stage);
    if (w < 0 || w >= s.workers) {
      check.fail("stage " + std::to_string(stage) + " is on worker " + std::to_string(w) +
                 "; expected a worker in 0.." + std::to_string(s.workers - 1));
    }
  }
  if (s.actions.size() != static_cast<size_t>(s.workers)) {
    check.fail("actions has " + std::to_string(s.actions.size()) +
               " lists; expected one per worker (" + std::to_string(s.workers) + ")");
  }
}

std::string stages_of(const Schedule& s, int worker) {
  std::string out;
  for (int stage = 0; stage < s.stages; ++stage) {
    if (s.worker_of(stage) != worker) continue;
    out += (out.empty() ? "" : ", ") + std::to_string(stage);
  }
  return out;
}

// Each action on its own: a stage of this worker, a micro-batch that exists, a transfer only
// across a boundary between two workers, nothing twice. Fills `index`.
void check_actions(const Schedule& s, const Checker& check, ActionIndex& index) {
  for (int w = 0; w < s.workers; ++w) {
    const auto& list = s.actions[static_cast<size_t>(w)];
    for (int k = 0; k < static_cast<int>(list.size()); ++k) {
      const Action& a = list[static_cast<size_t>(k)];
      const std::string at = check.where(w, k);
      if (static_cast<int>(a.kind) < 0 || static_cast<int>(a.kind) >= kKinds) {
        check.fail(at + ": unknown action kind " + std::to_string(static_cast<int>(a.kind)));
      }
      if (a.stage < 0 || a.stage >= s.stages) {
        check.fail(at + ": stage " + std::to_string(a.stage) + " does not exist; expected 0.." +
                   std::to_string(s.stages - 1));
      }
      if (a.micro_batch < 0 || a.micro_batch >= s.micro_batches) {
        check.fail(at + ": micro-batch " + std::to_string(a.micro_batch) +
                   " does not exist; expected 0.." + std::to_string(s.micro_batches - 1));
      }
      if (s.worker_of(a.stage) != w) {
        check.fail(at + ": stage " + std::to_string(a.stage) + " is on worker " +
                   std::to_string(s.worker_of(a.stage)) + "; expected only this worker's stages (" +
                   stages_of(s, w) + ")");
      }
      if (is_transfer(a.kind)) {
        const int peer = peer_stage(a);
        if (peer < 0 || peer >= s.stages) {
          check.fail(at + ": stage " + std::to_string(a.stage) + " has no " +
                     (peer < 0 ? "previous" : "next") + " stage; expected no transfer there");
        }
        if (s.worker_of(peer) == w) {
          check.fail(at + ": stages " + std::to_string(std::min(a.stage, peer)) + " and " +
                     std::to_string(std::max(a.stage, peer)) + " are both on worker " +
                     std::to_string(w) + "; expected no transfer between two stages of one worker");
        }
      }
      int& slot = index[a];
      if (slot >= 0) {
        check.fail(at + ": the same action as action " + std::to_string(slot) +
                   "; expected each action once");
      }
      slot = k;
    }
  }
}

// Order on each worker: every action after what it needs, on the same worker.
void check_order(const Schedule& s, const Checker& check, const ActionIndex& index) {
  for (int w = 0; w < s.workers; ++w) {
    const auto& list = s.actions[static_cast<size_t>(w)];
    for (int k = 0; k < static_cast<int>(list.size()); ++k) {
      const Action& a = list[static_cast<size_t>(k)];
      auto after = [&](const Action& need) {
        const int j = index.find(need);
        if (j < 0) {
          check.fail(check.where(w, k) + ": expected after the " + need.describe() +
                     ", which worker " + std::to_string(w) + " does not run");
        }
        if (j > k) {
          check.fail(check.where(w, k) + ": expected after the " + need.describe() +
                     ", which is action " + std::to_string(j));
        }
      };
      const int st = a.stage;
      const int mb = a.micro_batch;
      switch (a.kind) {
        case ActionKind::kForward:
          if (st > 0) {
            after(s.worker_of(st - 1) != w ? Action{ActionKind::kRecvActivation, st, mb}
                                           : Action{ActionKind::kForward, st - 1, mb});
          }
          break;
        case ActionKind::kBackward:
        case ActionKind::kBackwardInput:
          after({ActionKind::kForward, st, mb});
          if (st + 1 < s.stages) {
            if (s.worker_of(st + 1) != w) {
              after({ActionKind::kRecvGradient, st, mb});
            } else {
              const Action whole{ActionKind::kBackward, st + 1, mb};
              const Action input{ActionKind::kBackwardInput, st + 1, mb};
              after(index.find(whole) >= 0 ? whole : input);
            }
          }
          break;
        case ActionKind::kBackwardWeight:
          after({ActionKind::kBackwardInput, st, mb});
          break;
        case ActionKind::kSendActivation:
          after({ActionKind::kForward, st, mb});
          break;
        case ActionKind::kSendGradient: {
          const Action whole{ActionKind::kBackward, st, mb};
          after(index.find(whole) >= 0 ? whole : Action{ActionKind::kBackwardInput, st, mb});
          break;
        }
        case ActionKind::kRecvActivation:
        case ActionKind::kRecvGradient:
          break;
      }
    }
  }
}

// Completeness: every transfer with its partner, every stage and micro-batch with one forward,
// one backward (B, or I and W) and the sends its boundaries need.
void check_complete(const Schedule& s, const Checker& check, const ActionIndex& index) {
  for (bool receives : {true, false}) {
    for (int w = 0; w < s.workers; ++w) {
      const auto& list = s.actions[static_cast<size_t>(w)];
      for (int k = 0; k < static_cast<int>(list.size()); ++k) {
        const Action& a = list[static_cast<size_t>(k)];
        if (!is_transfer(a.kind) || is_receive(a.kind) != receives) continue;
        const Action other = partner(a);
        if (index.find(other) < 0) {
          check.fail(check.where(w, k) + ": worker " + std::to_string(s.worker_of(other.stage)) +
                     " runs no " + other.describe() + "; expected a " +
                     (receives ? "send for every receive" : "receive for every send"));
        }
      }
    }
  }
  for (int st = 0; st < s.stages; ++st) {
    const int w = s.worker_of(st);
    for (int mb = 0; mb < s.micro_batches; ++mb) {
      const Action forward{ActionKind::kForward, st, mb};
      const int f = index.find(forward);
      if (f < 0) {
        check.fail("worker " + std::to_string(w) + " runs no " + forward.describe() +
                   "; expected one forward for every stage and micro-batch");
      }
      const int b = index.find({ActionKind::kBackward, st, mb});
      const int i = index.find({ActionKind::kBackwardInput, st, mb});
      if (b >= 0 && i >= 0) {
        check.fail(check.where(w, i) + ": the stage also runs the whole backward (action " +
                   std::to_string(b) + "); expected either B, or I and W");
      }
      if (b < 0 && i < 0) {
        check.fail(check.where(w, f) +
                   ": no backward of it; expected one B, or one I and one W, for every forward");
      }
      if (i >= 0 && index.find({ActionKind::kBackwardWeight, st, mb}) < 0) {
        check.fail(check.where(w, i) + ": no weight-gradient backward of stage " +
                   std::to_string(st) + ", micro-batch " + std::to_string(mb) +
                   "; expected one W after every I");
      }
      if (st + 1 < s.stages && s.worker_of(st + 1) != w &&
          index.find({ActionKind::kSendActivation, st, mb}) < 0) {
        check.fail(check.where(w, f) + ": its activation is never sent to stage " +
                   std::to_string(st + 1) + " on worker " + std::to_string(s.worker_of(st + 1)) +
                   "; expected a send after it");
      }
      if (st > 0 && s.worker_of(st - 1) != w &&
          index.find({ActionKind::kSendGradient, st, mb}) < 0) {
        check.fail(check.where(w, b >= 0 ? b : i) + ": its input gradient is never sent to stage " +
                   std::to_string(st - 1) + " on worker " + std::to_string(s.worker_of(st - 1)) +
                   "; expected a send after it");
      }
    }
  }
}

double cost_of(ActionKind kind, const Costs& costs) {
  switch (kind) {
    case ActionKind::kForward:
      return costs.forward;
    case ActionKind::kBackward:
      return costs.backward;
    case ActionKind::kBackwardInput:
      return costs.backward_input;
    case ActionKind::kBackwardWeight:
      return costs.backward_weight;
    default:
      return 0;
  }
}

// The lists run as the runtime runs them: each worker in its order, a send never blocks, a
// receive waits until its send has run; an action starts when the one before it on its worker
// has ended and, for a receive, when its send has. Stops when every list has ended or no worker
// can go on; `next` then says where each worker stopped.
struct Replay {
  std::vector<size_t> next;
  std::vector<std::vector<double>> start;
  std::vector<std::vector<double>> end;
};

// costs[stage]; empty for validate()'s replay, where only the order matters.
Replay replay(const Schedule& s, const ActionIndex& index, const std::vector<Costs>& costs) {
  Replay r;
  r.next.assign(static_cast<size_t>(s.workers), 0);
  for (const auto& list : s.actions) {
    r.start.emplace_back(list.size(), 0.0);
    r.end.emplace_back(list.size(), 0.0);
  }
  for (bool progress = true; progress;) {
    progress = false;
    for (size_t w = 0; w < s.actions.size(); ++w) {
      const auto& list = s.actions[w];
      for (size_t& k = r.next[w]; k < list.size(); ++k) {
        const Action& a = list[k];
        double ready = k == 0 ? 0.0 : r.end[w][k - 1];
        if (is_receive(a.kind)) {
          const Action send = partner(a);
          const auto sender = static_cast<size_t>(s.worker_of(send.stage));
          const auto j = static_cast<size_t>(index.find(send));
          if (r.next[sender] <= j) break;  // the send has not run yet
          ready = std::max(ready, r.end[sender][j]);
        }
        r.start[w][k] = ready;
        r.end[w][k] =
            ready + (costs.empty() ? 0.0 : cost_of(a.kind, costs[static_cast<size_t>(a.stage)]));
        progress = true;
      }
    }
  }
  return r;
}

void check_deadlock(const Schedule& s, const Checker& check, const ActionIndex& index) {
  const Replay r = replay(s, index, {});
  std::string blocked;
  for (int w = 0; w < s.workers; ++w) {
    const auto k = r.next[static_cast<size_t>(w)];
    if (k == s.actions[static_cast<size_t>(w)].size()) continue;
    const Action send = partner(s.actions[static_cast<size_t>(w)][k]);
    blocked += (blocked.empty() ? "" : "; ") + check.where(w, static_cast<int>(k)) + " waits for " +
               check.where(send, index.find(send));
  }
  if (!blocked.empty()) {
    check.fail("deadlock, no worker can go on: " + blocked +
               "; expected every receive's send to be able to run before it");
  }
}

}  // namespace

void validate(const Schedule& schedule) {
  const Checker check(schedule);
  check_shape(schedule, check);
  ActionIndex index(schedule);
  check_actions(schedule, check, index);
  check_order(schedule, check, index);
  check_complete(schedule, check, index);
  check_deadlock(schedule, check, index);
}

namespace {

// UsageError naming the cost ("costs.backward", "costs[1].forward") unless it is finite and >= 0.
void check_costs(const Costs& c, const std::string& name) {
  const std::pair<const char*, double> named[] = {{"forward", c.forward},
                                                  {"backward", c.backward},
                                                  {"backward_input", c.backward_input},
                                                  {"backward_weight", c.backward_weight}};
  for (const auto& [field, cost] : named) {
    if (!(cost >= 0) || std::isinf(cost)) {
      std::ostringstream what;
      what << "simulate: " << name << "." << field << " = " << cost
           << "; expected a finite cost of at least 0";
      throw UsageError(what.str());
    }
  }
}

}  // namespace

Simulation simulate(const Schedule& schedule, const Costs& costs) {
  check_costs(costs, "costs");
  const size_t stages = schedule.stages > 0 ? static_cast<size_t>(schedule.stages) : 0;
  return simulate(schedule, std::vector<Costs>(stages, costs));
}

Simulation simulate(const Schedule& schedule, const std::vector<Costs>& costs) {
  for (size_t stage = 0; stage < costs.size(); ++stage) {
    check_costs(costs[stage], "costs[" + std::to_string(stage) + "]");
  }
  validate(schedule);
  if (costs.size() != static_cast<size_t>(schedule.stages)) {
    throw UsageError("simulate: " + std::to_string(costs.size()) + " per-stage costs for " +
                     std::to_string(schedule.stages) + " stages; expected one Costs per stage");
  }
  ActionIndex index(schedule);
  for (const auto& list : schedule.actions) {
    for (int k = 0; k < static_cast<int>(list.size()); ++k) index[list[static_cast<size_t>(k)]] = k;
  }
  Replay r = replay(schedule, index, costs);

  Simulation sim;
  double busy = 0;
  for (size_t w = 0; w < schedule.actions.size(); ++w) {
    const auto& list = schedule.actions[w];
    int in_flight = 0;
    int peak = 0;
    for (size_t k = 0; k < list.size(); ++k) {
      sim.makespan = std::max(sim.makespan, r.end[w][k]);
      busy += r.end[w][k] - r.start[w][k];
      // A stage's stashed activations live from its forward until the backward that last
      // needs them: B, or W (I leaves them for W).
      if (list[k].kind == ActionKind::kForward) peak = std::max(peak, ++in_flight);
      if (list[k].kind == ActionKind::kBackward || list[k].kind == ActionKind::kBackwardWeight) {
        --in_flight;
      }
    }
    sim.peak_in_flight.push_back(peak);
  }
  sim.bubble = sim.makespan > 0 ? 1 - busy / (schedule.workers * sim.makespan) : 0;
  sim.start = std::move(r.start);
  return sim;
}

}  // namespace shoal::pipeline
