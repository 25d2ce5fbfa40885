// A pipeline schedule is data: for each worker, the list of actions it runs in one training
// step (forward, backward, the backward's two halves, and the point-to-point traffic between
// stages), for a stage and a micro-batch. Small generators make the lists of the known
// schedules; one runtime (pipeline.h) executes any list; validate() checks a list without
// running it. See docs/pipeline.md.
//
//   auto s = shoal::pipeline::one_f_one_b(/*workers=*/4, /*micro_batches=*/8);
//   shoal::pipeline::validate(s);              // UsageError naming the first wrong action
//   std::cout << s.describe();                 // one line per worker: "F0.0 SA0.0 F0.1 ..."
#pragma once

#include <string>
#include <vector>

namespace shoal::pipeline {

// What a worker does. Forward and the backwards are computations of one stage on one
// micro-batch; the four transfers move a stage boundary's tensor between the workers that hold
// the two stages (only when they are different workers: between two stages of one worker the
// tensor stays in memory and the list has no transfer).
enum class ActionKind {
  kForward,         // F: the stage's forward
  kBackward,        // B: the whole backward (input and weight gradients)
  kBackwardInput,   // I: the input-gradient half (zero-bubble schedules)
  kBackwardWeight,  // W: the weight-gradient half, any time after I
  kSendActivation,  // stage s sends its output for the micro-batch to stage s + 1
  kRecvActivation,  // stage s receives its input from stage s - 1
  kSendGradient,    // stage s sends its input's gradient to stage s - 1
  kRecvGradient,    // stage s receives its output's gradient from stage s + 1
};

struct Action {
  ActionKind kind = ActionKind::kForward;
  int stage = 0;  // the stage this worker acts for (the sender's or the receiver's own)
  int micro_batch = 0;

  // "F2.5" (kind, stage, micro-batch); transfers are SA, RA, SG, RG.
  std::string short_name() const;
  // "forward of stage 2, micro-batch 5", "send of stage 2's activation for micro-batch 5".
  std::string describe() const;

  bool operator==(const Action& other) const {
    return kind == other.kind && stage == other.stage && micro_batch == other.micro_batch;
  }
  bool operator!=(const Action& other) const { return !(*this == other); }
};

enum class ScheduleKind { kGPipe, k1F1B, kInterleaved1F1B, kZeroBubbleH1 };

// "gpipe", "1f1b", "interleaved", "zb" (as --schedule takes them). UsageError for another name,
// listing these.
ScheduleKind parse_schedule_kind(const std::string& name);
std::string schedule_kind_name(ScheduleKind kind);

struct Schedule {
  std::string name;       // "1F1B", "interleaved 1F1B (v = 2)", ...
  int workers = 1;        // p
  int stages = 1;         // p * v: every worker holds v stages
  int micro_batches = 1;  // m
  // stage_worker[s]: the worker (0 .. p - 1) that runs stage s. Megatron's interleaving:
  // s % p, so that worker w holds stages w, w + p, w + 2p, ...
  std::vector<int> stage_worker;
  // actions[w]: worker w's actions in the order it runs them.
  std::vector<std::vector<Action>> actions;

  int worker_of(int stage) const { return stage_worker.at(static_cast<size_t>(stage)); }
  // Whether the backward is split into I and W (zero-bubble schedules).
  bool splits_backward() const;
  // One line per worker: "worker 0: F0.0 SA0.0 F0.1 SA0.1 RG0.0 B0.0 ...".
  std::string describe() const;
};

// The generators. Each needs workers >= 1, micro_batches >= 1 (and stages_per_worker >= 1);
// any m works, also m < p (UsageError otherwise, naming the argument).
// GPipe: every forward, then every backward (in reverse micro-batch order).
Schedule gpipe(int workers, int micro_batches);
// 1F1B (PipeDream-flush): worker w runs p - w - 1 warm-up forwards, then alternates one forward
// and one backward, then drains; at most p - w micro-batches in flight.
Schedule one_f_one_b(int workers, int micro_batches);
// Megatron's interleaved 1F1B: v stages per worker, micro-batches in groups of p.
Schedule interleaved_one_f_one_b(int workers, int stages_per_worker, int micro_batches);
// Zero-bubble ZB-H1 (Qi et al. 2023): 1F1B's memory, backward split into I and W, the Ws moved
// to fill the drain's bubbles.
Schedule zero_bubble_h1(int workers, int micro_batches);
// The generator of `kind` (stages_per_worker is for interleaved only; others need 1).
Schedule make_schedule(ScheduleKind kind, int workers, int stages_per_worker, int micro_batches);

// Checks `schedule` without running it, and raises UsageError naming the first wrong action
// ("worker 1, action 7 (backward of stage 1, micro-batch 0): ..."):
//  - shape: p, v, m positive, stage_worker of size stages with stage s on a worker in 0..p-1,
//    each worker's actions only for the stages it holds, micro-batches in 0..m-1;
//  - completeness: for every stage and micro-batch exactly one F, and either exactly one B or
//    exactly one I and one W; no action twice; a transfer exactly where consecutive stages are
//    on different workers, every send with its receive;
//  - order on each worker: F after its input is there (RA, or the previous stage's F on this
//    worker), B or I after F and after its output's gradient is there (RG, or the next stage's
//    B or I on this worker; the last stage needs none), W after I, SA after F, SG after B or I;
//  - no deadlock: a simulation runs every worker's list in order, where a send never blocks
//    and a receive waits for its send; if no worker can go on, the error names what each
//    blocked worker waits for.
void validate(const Schedule& schedule);

// Runs the lists on a cost model (forward f, the whole backward b, or its halves i and w;
// transfers take no time) and reports what a perfect machine would see: for the benchmark's
// theory column and docs/pipeline.md's pictures. Needs a valid schedule.
struct Costs {
  double forward = 1;
  double backward = 2;         // B
  double backward_input = 1;   // I
  double backward_weight = 1;  // W
};
struct Simulation {
  double makespan = 0;                     // the step's length
  double bubble = 0;                       // 1 - busy / (p * makespan)
  std::vector<std::vector<double>> start;  // start[w][k]: when worker w's action k starts
  std::vector<int> peak_in_flight;         // per worker: most micro-batches forwarded and
                                           // not yet fully backwarded (stashed activations)
};
Simulation simulate(const Schedule& schedule, const Costs& costs = {});
// The same with each stage's own costs: costs[s] for stage s (one entry per stage, p * v), for
// pipelines whose stages are not equal (the first stage's backward computes no input gradient;
// the last carries the loss). Equal entries give exactly the result of the overload above.
// UsageError when the size is not the number of stages or a cost is negative or not finite.
Simulation simulate(const Schedule& schedule, const std::vector<Costs>& costs);

}  // namespace shoal::pipeline
