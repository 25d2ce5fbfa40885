// The schedule generators (docs/pipeline.md, "Schedules as data"). Each writes the order of the
// computations on every worker; the transfers around them follow one rule (see `ListWriter`).
#include "shoal/pipeline/schedule.h"

#include <algorithm>
#include <cctype>
#include <deque>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "shoal/core/error.h"

namespace shoal::pipeline {

namespace {

const char* kind_letters(ActionKind kind) {
  switch (kind) {
    case ActionKind::kForward:
      return "F";
    case ActionKind::kBackward:
      return "B";
    case ActionKind::kBackwardInput:
      return "I";
    case ActionKind::kBackwardWeight:
      return "W";
    case ActionKind::kSendActivation:
      return "SA";
    case ActionKind::kRecvActivation:
      return "RA";
    case ActionKind::kSendGradient:
      return "SG";
    case ActionKind::kRecvGradient:
      return "RG";
  }
  return "?";
}

void require_positive(const char* generator, const char* argument, int value) {
  if (value < 1) {
    throw UsageError(std::string(generator) + ": " + argument + " = " + std::to_string(value) +
                     "; expected at least 1");
  }
}

// Writes the lists of a schedule whose stage s is on worker s % p. The generators give only
// the order of the computations; the transfers come from one rule, the runtime's: a receive
// right before the computation that needs it (the runtime waits for receives), a send right
// after the computation that produced its tensor (the runtime posts sends without waiting). No
// transfer between two stages of one worker: the tensor stays in memory.
class ListWriter {
 public:
  ListWriter(std::string name, int workers, int stages_per_worker, int micro_batches) {
    schedule_.name = std::move(name);
    schedule_.workers = workers;
    schedule_.stages = workers * stages_per_worker;
    schedule_.micro_batches = micro_batches;
    for (int s = 0; s < schedule_.stages; ++s) schedule_.stage_worker.push_back(s % workers);
    schedule_.actions.resize(static_cast<size_t>(workers));
  }

  void forward(int stage, int micro_batch) {
    if (crosses(stage - 1, stage)) add(ActionKind::kRecvActivation, stage, micro_batch);
    add(ActionKind::kForward, stage, micro_batch);
    if (crosses(stage, stage + 1)) add(ActionKind::kSendActivation, stage, micro_batch);
  }
  // The whole backward (B), or with `input_only` its input-gradient half (I).
  void backward(int stage, int micro_batch, bool input_only = false) {
    if (crosses(stage, stage + 1)) add(ActionKind::kRecvGradient, stage, micro_batch);
    add(input_only ? ActionKind::kBackwardInput : ActionKind::kBackward, stage, micro_batch);
    if (crosses(stage - 1, stage)) add(ActionKind::kSendGradient, stage, micro_batch);
  }
  void weight(int stage, int micro_batch) { add(ActionKind::kBackwardWeight, stage, micro_batch); }

  Schedule take() { return std::move(schedule_); }

 private:
  // Whether the boundary between stages `from` and `to` = from + 1 is crossed by a transfer.
  bool crosses(int from, int to) const {
    return from >= 0 && to < schedule_.stages &&
           schedule_.worker_of(from) != schedule_.worker_of(to);
  }
  void add(ActionKind kind, int stage, int micro_batch) {
    schedule_.actions[static_cast<size_t>(schedule_.worker_of(stage))].push_back(
        Action{kind, stage, micro_batch});
  }

  Schedule schedule_;
};

}  // namespace

std::string Action::short_name() const {
  return kind_letters(kind) + std::to_string(stage) + "." + std::to_string(micro_batch);
}

std::string Action::describe() const {
  const std::string s = std::to_string(stage);
  const std::string mb = std::to_string(micro_batch);
  switch (kind) {
    case ActionKind::kForward:
      return "forward of stage " + s + ", micro-batch " + mb;
    case ActionKind::kBackward:
      return "backward of stage " + s + ", micro-batch " + mb;
    case ActionKind::kBackwardInput:
      return "input-gradient backward of stage " + s + ", micro-batch " + mb;
    case ActionKind::kBackwardWeight:
      return "weight-gradient backward of stage " + s + ", micro-batch " + mb;
    case ActionKind::kSendActivation:
      return "send of stage " + s + "'s activation for micro-batch " + mb;
    case ActionKind::kRecvActivation:
      return "receive of stage " + s + "'s input activation for micro-batch " + mb;
    case ActionKind::kSendGradient:
      return "send of stage " + s + "'s input gradient for micro-batch " + mb;
    case ActionKind::kRecvGradient:
      return "receive of stage " + s + "'s output gradient for micro-batch " + mb;
  }
  return "unknown action";
}

ScheduleKind parse_schedule_kind(const std::string& name) {
  std::string lower = name;
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  for (ScheduleKind kind : {ScheduleKind::kGPipe, ScheduleKind::k1F1B,
                            ScheduleKind::kInterleaved1F1B, ScheduleKind::kZeroBubbleH1}) {
    if (lower == schedule_kind_name(kind)) return kind;
  }
  throw UsageError("unknown pipeline schedule '" + name +
                   "'; expected one of gpipe, 1f1b, interleaved, zb");
}

std::string schedule_kind_name(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::kGPipe:
      return "gpipe";
    case ScheduleKind::k1F1B:
      return "1f1b";
    case ScheduleKind::kInterleaved1F1B:
      return "interleaved";
    case ScheduleKind::kZeroBubbleH1:
      return "zb";
  }
  return "unknown";
}

bool Schedule::splits_backward() const {
  for (const auto& list : actions) {
    for (const Action& a : list) {
      if (a.kind == ActionKind::kBackwardInput || a.kind == ActionKind::kBackwardWeight) {
        return true;
      }
    }
  }
  return false;
}

std::string Schedule::describe() const {
  std::ostringstream out;
  for (size_t w = 0; w < actions.size(); ++w) {
    out << "worker " << w << ":";
    for (const Action& a : actions[w]) out << " " << a.short_name();
    out << "\n";
  }
  return out.str();
}

Schedule gpipe(int workers, int micro_batches) {
  require_positive("gpipe", "workers", workers);
  require_positive("gpipe", "micro_batches", micro_batches);
  ListWriter lists("GPipe", workers, 1, micro_batches);
  for (int w = 0; w < workers; ++w) {
    for (int mb = 0; mb < micro_batches; ++mb) lists.forward(w, mb);
    for (int mb = micro_batches - 1; mb >= 0; --mb) lists.backward(w, mb);
  }
  return lists.take();
}

Schedule one_f_one_b(int workers, int micro_batches) {
  require_positive("one_f_one_b", "workers", workers);
  require_positive("one_f_one_b", "micro_batches", micro_batches);
  ListWriter lists("1F1B", workers, 1, micro_batches);
  for (int w = 0; w < workers; ++w) {
    // Warm-up: as many forwards as the workers after this one, so that the first gradient
    // comes back just as this worker would run out of forwards to do.
    const int warmup = std::min(workers - w - 1, micro_batches);
    int forwards = 0;
    int backwards = 0;
    while (forwards < warmup) lists.forward(w, forwards++);
    while (forwards < micro_batches) {
      lists.forward(w, forwards++);
      lists.backward(w, backwards++);
    }
    while (backwards < micro_batches) lists.backward(w, backwards++);
  }
  return lists.take();
}

// Megatron-LM's interleaved 1F1B. Worker w holds the v "model chunks" c = 0 .. v-1, chunk c
// being stage c * p + w. Micro-batches go in groups of p: each chunk runs the whole group before
// the next chunk starts, so that the group's forwards flow around the ring of workers v times;
// the backwards go in the same groups with the chunks in reverse order. Each worker warms up with
// 2 (p - w - 1) + (v - 1) p forwards, then alternates one forward and one backward, then drains.
// With v = 1 this is 1F1B, with 1F1B's warm-up of p - w - 1 (Megatron's formula would stash
// p - w - 1 more).
//
// Megatron requires m % p == 0. Here the lists are written for m rounded up to a multiple of p
// and the micro-batches past m are left out: the last group is short. Leaving actions out of
// deadlock-free lists cannot make them deadlock (every wait that remains was a wait before, or
// follows from a chain of them), whereas keeping the order but counting the warm-up in real
// micro-batches does (p = 4, v = 3, m = 5 would).
Schedule interleaved_one_f_one_b(int workers, int stages_per_worker, int micro_batches) {
  require_positive("interleaved_one_f_one_b", "workers", workers);
  require_positive("interleaved_one_f_one_b", "stages_per_worker", stages_per_worker);
  require_positive("interleaved_one_f_one_b", "micro_batches", micro_batches);
  const int v = stages_per_worker;
  const int padded = (micro_batches + workers - 1) / workers * workers;
  ListWriter lists("interleaved 1F1B (v = " + std::to_string(v) + ")", workers, v, micro_batches);
  // (chunk, micro-batch) in the order of the forwards, and of the backwards.
  std::vector<std::pair<int, int>> forward_order;
  std::vector<std::pair<int, int>> backward_order;
  for (int first = 0; first < padded; first += workers) {
    for (int c = 0; c < v; ++c) {
      for (int mb = first; mb < first + workers; ++mb) {
        forward_order.emplace_back(c, mb);
        backward_order.emplace_back(v - 1 - c, mb);
      }
    }
  }
  const auto total = forward_order.size();
  for (int w = 0; w < workers; ++w) {
    const auto warmup = std::min(
        static_cast<size_t>(v == 1 ? workers - w - 1 : 2 * (workers - w - 1) + (v - 1) * workers),
        total);
    auto forward = [&](size_t k) {
      const auto [chunk, mb] = forward_order[k];
      if (mb < micro_batches) lists.forward(chunk * workers + w, mb);
    };
    auto backward = [&](size_t k) {
      const auto [chunk, mb] = backward_order[k];
      if (mb < micro_batches) lists.backward(chunk * workers + w, mb);
    };
    size_t forwards = 0;
    size_t backwards = 0;
    while (forwards < warmup) forward(forwards++);
    while (forwards < total) {
      forward(forwards++);
      backward(backwards++);
    }
    while (backwards < total) backward(backwards++);
  }
  return lists.take();
}

// ZB-H1 (Qi et al. 2023, figure 3; the shape of the authors' DeepSpeed version): 1F1B's warm-up,
// then worker w runs its first w steady steps as F, I (its Ws wait), then F, I, W of the oldest
// waiting micro-batch, then I, W in the drain, and last the w Ws still waiting. The Ws that
// worker w holds back fill the time that 1F1B spends waiting for gradients in the drain; a
// micro-batch stays stashed until its W, so worker w holds at most p, 1F1B's most (worker 0's).
Schedule zero_bubble_h1(int workers, int micro_batches) {
  require_positive("zero_bubble_h1", "workers", workers);
  require_positive("zero_bubble_h1", "micro_batches", micro_batches);
  ListWriter lists("ZB-H1", workers, 1, micro_batches);
  for (int w = 0; w < workers; ++w) {
    const int warmup = std::min(workers - w - 1, micro_batches);
    int forwards = 0;
    int backwards = 0;
    std::deque<int> waiting;  // micro-batches whose I ran and whose W has not
    auto input = [&] {
      lists.backward(w, backwards, /*input_only=*/true);
      waiting.push_back(backwards++);
    };
    auto weight = [&] {
      lists.weight(w, waiting.front());
      waiting.pop_front();
    };
    while (forwards < warmup) lists.forward(w, forwards++);
    for (int held = 0; held < w && forwards < micro_batches; ++held) {
      lists.forward(w, forwards++);
      input();
    }
    while (forwards < micro_batches) {
      lists.forward(w, forwards++);
      input();
      weight();
    }
    while (backwards < micro_batches) {
      input();
      weight();
    }
    while (!waiting.empty()) weight();
  }
  return lists.take();
}

Schedule make_schedule(ScheduleKind kind, int workers, int stages_per_worker, int micro_batches) {
  if (kind != ScheduleKind::kInterleaved1F1B && stages_per_worker != 1) {
    throw UsageError(
        "pipeline schedule " + schedule_kind_name(kind) +
        ": stages_per_worker = " + std::to_string(stages_per_worker) +
        "; expected 1 (only the interleaved schedule holds several stages per worker)");
  }
  switch (kind) {
    case ScheduleKind::kGPipe:
      return gpipe(workers, micro_batches);
    case ScheduleKind::k1F1B:
      return one_f_one_b(workers, micro_batches);
    case ScheduleKind::kInterleaved1F1B:
      return interleaved_one_f_one_b(workers, stages_per_worker, micro_batches);
    case ScheduleKind::kZeroBubbleH1:
      return zero_bubble_h1(workers, micro_batches);
  }
  throw UsageError("make_schedule: unknown schedule kind " +
                   std::to_string(static_cast<int>(kind)));
}

}  // namespace shoal::pipeline
