// Pipeline schedules as data (docs/pipeline.md, "Schedules as data"), without workers: every
// generator's lists over a grid of p, v and m pass the validator and hold every computation
// once; the simulation gives the closed forms of the bubble and of the stashed micro-batches;
// hand-made broken lists fail with a UsageError naming the wrong action and what was expected.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <string>
#include <vector>

#include "shoal/core/error.h"
#include "shoal/pipeline/schedule.h"

namespace {

namespace pp = shoal::pipeline;
using pp::Action;
using pp::ActionKind;
using pp::ScheduleKind;

constexpr ScheduleKind kAllKinds[] = {ScheduleKind::kGPipe, ScheduleKind::k1F1B,
                                      ScheduleKind::kInterleaved1F1B, ScheduleKind::kZeroBubbleH1};

// Each schedule of the grid: p in 1..8, v in 1..4 for the interleaved one (1 for the others),
// m in 1..3p.
void for_each_schedule(const std::function<void(ScheduleKind, int, int, int)>& body) {
  for (ScheduleKind kind : kAllKinds) {
    const int max_v = kind == ScheduleKind::kInterleaved1F1B ? 4 : 1;
    for (int p = 1; p <= 8; ++p) {
      for (int v = 1; v <= max_v; ++v) {
        for (int m = 1; m <= 3 * p; ++m) body(kind, p, v, m);
      }
    }
  }
}

std::string label(ScheduleKind kind, int p, int v, int m) {
  return pp::schedule_kind_name(kind) + " p = " + std::to_string(p) + " v = " + std::to_string(v) +
         " m = " + std::to_string(m);
}

// The message of the UsageError `fn` raises ("" and a test failure when it raises none).
std::string usage_error(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const shoal::UsageError& e) {
    return e.what();
  }
  ADD_FAILURE() << "no UsageError";
  return "";
}

bool is_computation(ActionKind kind) {
  return kind == ActionKind::kForward || kind == ActionKind::kBackward ||
         kind == ActionKind::kBackwardInput || kind == ActionKind::kBackwardWeight;
}

// A worker's computations, without the transfers: "F0.0 F0.1 B0.0 ...".
std::string computations(const pp::Schedule& s, int worker) {
  std::string out;
  for (const Action& a : s.actions[static_cast<size_t>(worker)]) {
    if (is_computation(a.kind)) out += (out.empty() ? "" : " ") + a.short_name();
  }
  return out;
}

int index_of(const pp::Schedule& s, int worker, const Action& a) {
  const auto& list = s.actions[static_cast<size_t>(worker)];
  const auto it = std::find(list.begin(), list.end(), a);
  EXPECT_NE(it, list.end()) << a.describe();
  return static_cast<int>(it - list.begin());
}

pp::Costs unit_costs() {
  return pp::Costs{1, 2, 1, 1};
}

TEST(PipelineSchedule, EveryGeneratedListPassesTheValidatorAndRunsEveryComputationOnce) {
  int schedules = 0;
  for_each_schedule([&](ScheduleKind kind, int p, int v, int m) {
    SCOPED_TRACE(label(kind, p, v, m));
    const pp::Schedule s = pp::make_schedule(kind, p, v, m);
    ASSERT_NO_THROW(pp::validate(s));
    ASSERT_EQ(s.workers, p);
    ASSERT_EQ(s.stages, p * v);
    ASSERT_EQ(s.micro_batches, m);
    for (int st = 0; st < s.stages; ++st) ASSERT_EQ(s.worker_of(st), st % p);
    // Counted here, apart from the validator: one forward and one backward (B, or I and W) per
    // stage and micro-batch, on the stage's worker; 4 transfers per crossed boundary.
    std::vector<int> forwards(static_cast<size_t>(s.stages * m), 0);
    std::vector<int> backwards(static_cast<size_t>(s.stages * m), 0);
    int transfers = 0;
    for (int w = 0; w < p; ++w) {
      for (const Action& a : s.actions[static_cast<size_t>(w)]) {
        ASSERT_EQ(s.worker_of(a.stage), w) << a.describe();
        const auto slot = static_cast<size_t>(a.stage * m + a.micro_batch);
        if (a.kind == ActionKind::kForward) ++forwards[slot];
        if (a.kind == ActionKind::kBackward || a.kind == ActionKind::kBackwardWeight) {
          ++backwards[slot];
        }
        if (!is_computation(a.kind)) ++transfers;
      }
    }
    for (size_t i = 0; i < forwards.size(); ++i) {
      ASSERT_EQ(forwards[i], 1) << "stage " << i / m << " micro-batch " << i % m;
      ASSERT_EQ(backwards[i], 1) << "stage " << i / m << " micro-batch " << i % m;
    }
    ASSERT_EQ(transfers, p == 1 ? 0 : 4 * (s.stages - 1) * m);
    ASSERT_EQ(s.splits_backward(), kind == ScheduleKind::kZeroBubbleH1);
    ++schedules;
  });
  EXPECT_EQ(schedules, 7 * 108);  // 108 (p, m) pairs for each of 3 kinds, and 4 v interleaved
}

TEST(PipelineSchedule, GPipeAnd1F1BBubbleIsTheClosedForm) {
  for (ScheduleKind kind : {ScheduleKind::kGPipe, ScheduleKind::k1F1B}) {
    for (int p = 1; p <= 8; ++p) {
      for (int m = 1; m <= 3 * p; ++m) {
        SCOPED_TRACE(label(kind, p, 1, m));
        const pp::Schedule s = pp::make_schedule(kind, p, 1, m);
        // (p - 1) / (m + p - 1) whatever the ratio of the backward to the forward.
        for (const pp::Costs& c : {pp::Costs{1, 2, 1, 1}, pp::Costs{1, 1, 1, 1}}) {
          const pp::Simulation sim = pp::simulate(s, c);
          EXPECT_EQ(sim.makespan, (m + p - 1) * (c.forward + c.backward));
          EXPECT_NEAR(sim.bubble, double(p - 1) / (m + p - 1), 1e-12);
        }
      }
    }
  }
}

TEST(PipelineSchedule, InterleavedBubbleIsTheClosedFormWhenMicroBatchesFillTheGroups) {
  for (int p = 1; p <= 8; ++p) {
    for (int v = 1; v <= 4; ++v) {
      for (int m = 1; m <= 3 * p; ++m) {
        SCOPED_TRACE(label(ScheduleKind::kInterleaved1F1B, p, v, m));
        const pp::Schedule s = pp::interleaved_one_f_one_b(p, v, m);
        for (const pp::Costs& c : {pp::Costs{1, 2, 1, 1}, pp::Costs{1, 1, 1, 1}}) {
          const pp::Simulation sim = pp::simulate(s, c);
          const double interleaved = double(p - 1) / (v * m + p - 1);
          const double one_f_one_b = double(p - 1) / (m + p - 1);
          if (m % p == 0) {
            // Megatron's (p - 1) / (v m + p - 1): each stage's actions cost what a whole
            // worker's do, so the step is v m + p - 1 forward-and-backward times.
            EXPECT_EQ(sim.makespan, (v * m + p - 1) * (c.forward + c.backward));
            EXPECT_NEAR(sim.bubble, interleaved, 1e-12);
          } else {
            // The last group is short: never better than the closed form, never worse than
            // 1F1B at the same m (measured over this grid).
            EXPECT_GE(sim.bubble, interleaved - 1e-12);
            EXPECT_LE(sim.bubble, one_f_one_b + 1e-12);
          }
        }
      }
    }
  }
}

TEST(PipelineSchedule, ZeroBubbleH1LeavesAThirdOf1F1BsIdleTime) {
  for (int p = 1; p <= 8; ++p) {
    for (int m = 1; m <= 3 * p; ++m) {
      SCOPED_TRACE(label(ScheduleKind::kZeroBubbleH1, p, 1, m));
      const pp::Simulation zb = pp::simulate(pp::zero_bubble_h1(p, m), unit_costs());
      const pp::Simulation ref = pp::simulate(pp::one_f_one_b(p, m), unit_costs());
      const double zb_idle = zb.bubble * zb.makespan * p;
      const double ref_idle = ref.bubble * ref.makespan * p;
      if (p == 1) {
        EXPECT_EQ(zb.bubble, 0);
        continue;
      }
      EXPECT_LT(zb.bubble, ref.bubble);
      if (m >= p) {
        // f = i = w = 1: 1F1B idles (p - 1)(f + i + w) per worker, ZB-H1 (p - 1)(f + i - w).
        EXPECT_EQ(zb.makespan, 3 * m + p - 1);
        EXPECT_NEAR(zb.bubble, double(p - 1) / (3 * m + p - 1), 1e-12);
        EXPECT_NEAR(zb_idle / ref_idle, 1.0 / 3, 1e-12);
      } else {
        // Fewer micro-batches than workers leave fewer Ws to fill the drain with (measured:
        // between 0.38 and 2/3 of 1F1B's idle time, 2/3 at m = 1).
        EXPECT_LE(zb_idle / ref_idle, 2.0 / 3 + 1e-12);
      }
    }
  }
}

TEST(PipelineSchedule, PeakInFlightIsWhatEachScheduleStashes) {
  for (int p = 1; p <= 8; ++p) {
    for (int m = 1; m <= 3 * p; ++m) {
      SCOPED_TRACE("p = " + std::to_string(p) + " m = " + std::to_string(m));
      const auto gpipe = pp::simulate(pp::gpipe(p, m)).peak_in_flight;
      const auto ofob = pp::simulate(pp::one_f_one_b(p, m)).peak_in_flight;
      const auto zb = pp::simulate(pp::zero_bubble_h1(p, m), unit_costs()).peak_in_flight;
      ASSERT_EQ(gpipe.size(), static_cast<size_t>(p));
      for (int w = 0; w < p; ++w) {
        EXPECT_EQ(gpipe[static_cast<size_t>(w)], m) << "worker " << w;
        EXPECT_EQ(ofob[static_cast<size_t>(w)], std::min(p - w, m)) << "worker " << w;
        // ZB-H1 keeps a micro-batch until its W: 1F1B's most, worker 0's, on every worker.
        EXPECT_EQ(zb[static_cast<size_t>(w)], std::min(p, m)) << "worker " << w;
      }
      for (int v = 2; v <= 4; ++v) {
        // Counted per stage: Megatron's warm-up, 2 (p - w - 1) + (v - 1) p, plus one; with a
        // short last group (p does not divide m), at most that.
        const auto il = pp::simulate(pp::interleaved_one_f_one_b(p, v, m)).peak_in_flight;
        for (int w = 0; w < p; ++w) {
          const int megatron = std::min(v * m, 2 * (p - w - 1) + (v - 1) * p + 1);
          if (m % p == 0) {
            EXPECT_EQ(il[static_cast<size_t>(w)], megatron) << "v = " << v << " worker " << w;
          } else {
            EXPECT_LE(il[static_cast<size_t>(w)], megatron) << "v = " << v << " worker " << w;
          }
        }
      }
    }
  }
}

TEST(PipelineSchedule, SimulationStartsEachActionAsEarlyAsItsWaitsAllow) {
  // 1F1B, p = 2, m = 2, f = 1, b = 2, worked by hand: a receive starts when its send has run
  // and takes no time.
  //   worker 0: F0.0 SA0.0 F0.1 SA0.1 RG0.0 B0.0 RG0.1 B0.1
  //   worker 1: RA1.0 F1.0 B1.0 SG1.0 RA1.1 F1.1 B1.1 SG1.1
  const pp::Simulation sim = pp::simulate(pp::one_f_one_b(2, 2), unit_costs());
  EXPECT_EQ(sim.start[0], (std::vector<double>{0, 1, 1, 2, 4, 4, 7, 7}));
  EXPECT_EQ(sim.start[1], (std::vector<double>{1, 1, 2, 4, 4, 4, 5, 7}));
  EXPECT_EQ(sim.makespan, 9);
  EXPECT_NEAR(sim.bubble, 1 - 12.0 / 18, 1e-12);
  EXPECT_EQ(sim.peak_in_flight, (std::vector<int>{2, 1}));
}

TEST(PipelineSchedule, ListsAreTheKnownOrders) {
  const pp::Schedule ofob = pp::one_f_one_b(2, 2);
  EXPECT_EQ(ofob.describe(),
            "worker 0: F0.0 SA0.0 F0.1 SA0.1 RG0.0 B0.0 RG0.1 B0.1\n"
            "worker 1: RA1.0 F1.0 B1.0 SG1.0 RA1.1 F1.1 B1.1 SG1.1\n");
  const pp::Schedule gpipe = pp::gpipe(2, 3);
  EXPECT_EQ(computations(gpipe, 0), "F0.0 F0.1 F0.2 B0.2 B0.1 B0.0");
  // Megatron's interleaving, p = 2, v = 2, m = 4: groups of 2 micro-batches, chunk by chunk.
  // Worker 0 warms up with 2 (2 - 0 - 1) + (2 - 1) 2 = 4 forwards, worker 1 with 2.
  const pp::Schedule il = pp::interleaved_one_f_one_b(2, 2, 4);
  EXPECT_EQ(computations(il, 0),
            "F0.0 F0.1 F2.0 F2.1 F0.2 B2.0 F0.3 B2.1 F2.2 B0.0 F2.3 B0.1 B2.2 B2.3 B0.2 B0.3");
  EXPECT_EQ(computations(il, 1),
            "F1.0 F1.1 F3.0 B3.0 F3.1 B3.1 F1.2 B1.0 F1.3 B1.1 F3.2 B3.2 F3.3 B3.3 B1.2 B1.3");
  // ZB-H1, p = 3, m = 4: worker w holds back its first w Ws and runs them last.
  const pp::Schedule zb = pp::zero_bubble_h1(3, 4);
  EXPECT_EQ(computations(zb, 0), "F0.0 F0.1 F0.2 I0.0 W0.0 F0.3 I0.1 W0.1 I0.2 W0.2 I0.3 W0.3");
  EXPECT_EQ(computations(zb, 1), "F1.0 F1.1 I1.0 F1.2 I1.1 W1.0 F1.3 I1.2 W1.1 I1.3 W1.2 W1.3");
  EXPECT_EQ(computations(zb, 2), "F2.0 I2.0 F2.1 I2.1 F2.2 I2.2 W2.0 F2.3 I2.3 W2.1 W2.2 W2.3");
  // One worker: no transfers, also between the stages of the interleaved schedule.
  EXPECT_EQ(pp::interleaved_one_f_one_b(1, 2, 2).describe(),
            "worker 0: F0.0 F1.0 B1.0 F0.1 B0.0 F1.1 B1.1 B0.1\n");
}

TEST(PipelineSchedule, ActionsDescribeThemselves) {
  EXPECT_EQ((Action{ActionKind::kForward, 2, 5}).short_name(), "F2.5");
  EXPECT_EQ((Action{ActionKind::kRecvGradient, 0, 3}).short_name(), "RG0.3");
  EXPECT_EQ((Action{ActionKind::kForward, 2, 5}).describe(), "forward of stage 2, micro-batch 5");
  EXPECT_EQ((Action{ActionKind::kSendActivation, 2, 5}).describe(),
            "send of stage 2's activation for micro-batch 5");
  EXPECT_EQ((Action{ActionKind::kBackwardWeight, 1, 0}).describe(),
            "weight-gradient backward of stage 1, micro-batch 0");
}

// Hand-made broken lists.

TEST(PipelineScheduleValidate, BackwardBeforeItsForward) {
  pp::Schedule s = pp::gpipe(1, 1);
  std::swap(s.actions[0][0], s.actions[0][1]);  // B0.0 F0.0
  EXPECT_EQ(usage_error([&] { pp::validate(s); }),
            "invalid pipeline schedule 'GPipe': worker 0, action 0 (backward of stage 0, "
            "micro-batch 0): expected after the forward of stage 0, micro-batch 0, which is "
            "action 1");
}

TEST(PipelineScheduleValidate, ReceiveWithNoSend) {
  pp::Schedule s = pp::one_f_one_b(2, 1);
  auto& w0 = s.actions[0];
  w0.erase(w0.begin() + index_of(s, 0, {ActionKind::kSendActivation, 0, 0}));
  EXPECT_EQ(usage_error([&] { pp::validate(s); }),
            "invalid pipeline schedule '1F1B': worker 1, action 0 (receive of stage 1's input "
            "activation for micro-batch 0): worker 0 runs no send of stage 0's activation for "
            "micro-batch 0; expected a send for every receive");
}

TEST(PipelineScheduleValidate, BackwardWithoutItsGradient) {
  pp::Schedule s = pp::gpipe(2, 1);
  auto& w0 = s.actions[0];
  w0.erase(w0.begin() + index_of(s, 0, {ActionKind::kRecvGradient, 0, 0}));
  EXPECT_EQ(usage_error([&] { pp::validate(s); }),
            "invalid pipeline schedule 'GPipe': worker 0, action 2 (backward of stage 0, "
            "micro-batch 0): expected after the receive of stage 0's output gradient for "
            "micro-batch 0, which worker 0 does not run");
}

TEST(PipelineScheduleValidate, MicroBatchTwice) {
  pp::Schedule s = pp::gpipe(1, 2);
  s.actions[0][1] = Action{ActionKind::kForward, 0, 0};  // F0.0 F0.0 B0.1 B0.0
  EXPECT_EQ(usage_error([&] { pp::validate(s); }),
            "invalid pipeline schedule 'GPipe': worker 0, action 1 (forward of stage 0, "
            "micro-batch 0): the same action as action 0; expected each action once");
}

TEST(PipelineScheduleValidate, MissingWeightGradient) {
  pp::Schedule s = pp::zero_bubble_h1(2, 2);
  auto& w1 = s.actions[1];
  w1.erase(w1.begin() + index_of(s, 1, {ActionKind::kBackwardWeight, 1, 1}));
  const int i = index_of(s, 1, {ActionKind::kBackwardInput, 1, 1});
  EXPECT_EQ(usage_error([&] { pp::validate(s); }),
            "invalid pipeline schedule 'ZB-H1': worker 1, action " + std::to_string(i) +
                " (input-gradient backward of stage 1, micro-batch 1): no weight-gradient "
                "backward of stage 1, micro-batch 1; expected one W after every I");
}

TEST(PipelineScheduleValidate, MissingBackward) {
  pp::Schedule s = pp::gpipe(1, 2);
  s.actions[0].pop_back();  // B0.0
  EXPECT_EQ(usage_error([&] { pp::validate(s); }),
            "invalid pipeline schedule 'GPipe': worker 0, action 0 (forward of stage 0, "
            "micro-batch 0): no backward of it; expected one B, or one I and one W, for every "
            "forward");
}

TEST(PipelineScheduleValidate, ActionForAStageTheWorkerDoesNotHold) {
  pp::Schedule s = pp::interleaved_one_f_one_b(2, 2, 2);
  s.actions[0].insert(s.actions[0].begin(), Action{ActionKind::kForward, 1, 0});
  EXPECT_EQ(usage_error([&] { pp::validate(s); }),
            "invalid pipeline schedule 'interleaved 1F1B (v = 2)': worker 0, action 0 (forward "
            "of stage 1, micro-batch 0): stage 1 is on worker 1; expected only this worker's "
            "stages (0, 2)");
}

TEST(PipelineScheduleValidate, TransferBetweenStagesOfOneWorker) {
  pp::Schedule s = pp::interleaved_one_f_one_b(1, 2, 1);  // F0.0 F1.0 B1.0 B0.0
  s.actions[0].insert(s.actions[0].begin() + 1, Action{ActionKind::kSendActivation, 0, 0});
  EXPECT_EQ(usage_error([&] { pp::validate(s); }),
            "invalid pipeline schedule 'interleaved 1F1B (v = 2)': worker 0, action 1 (send of "
            "stage 0's activation for micro-batch 0): stages 0 and 1 are both on worker 0; "
            "expected no transfer between two stages of one worker");
}

TEST(PipelineScheduleValidate, MicroBatchOutOfRange) {
  pp::Schedule s = pp::gpipe(1, 2);
  s.actions[0][0].micro_batch = 2;
  EXPECT_EQ(usage_error([&] { pp::validate(s); }),
            "invalid pipeline schedule 'GPipe': worker 0, action 0 (forward of stage 0, "
            "micro-batch 2): micro-batch 2 does not exist; expected 0..1");
}

TEST(PipelineScheduleValidate, DeadlockOfTwoWorkersEachReceivingFirst) {
  pp::Schedule s;
  s.name = "hand-made";
  s.workers = 2;
  s.stages = 2;
  s.micro_batches = 1;
  s.stage_worker = {0, 1};
  s.actions = {
      {{ActionKind::kRecvGradient, 0, 0},
       {ActionKind::kForward, 0, 0},
       {ActionKind::kSendActivation, 0, 0},
       {ActionKind::kBackward, 0, 0}},
      {{ActionKind::kRecvActivation, 1, 0},
       {ActionKind::kForward, 1, 0},
       {ActionKind::kBackward, 1, 0},
       {ActionKind::kSendGradient, 1, 0}},
  };
  EXPECT_EQ(usage_error([&] { pp::validate(s); }),
            "invalid pipeline schedule 'hand-made': deadlock, no worker can go on: worker 0, "
            "action 0 (receive of stage 0's output gradient for micro-batch 0) waits for worker "
            "1, action 3 (send of stage 1's input gradient for micro-batch 0); worker 1, action 0 "
            "(receive of stage 1's input activation for micro-batch 0) waits for worker 0, "
            "action 2 (send of stage 0's activation for micro-batch 0); expected every "
            "receive's send to be able to run before it");
  // Moved after the forward, worker 0's receive lets both go on.
  std::rotate(s.actions[0].begin(), s.actions[0].begin() + 1, s.actions[0].begin() + 3);
  EXPECT_NO_THROW(pp::validate(s));
}

TEST(PipelineScheduleValidate, Shape) {
  pp::Schedule s = pp::one_f_one_b(2, 2);
  s.stage_worker[1] = 2;
  EXPECT_EQ(usage_error([&] { pp::validate(s); }),
            "invalid pipeline schedule '1F1B': stage 1 is on worker 2; expected a worker in 0..1");
  s = pp::one_f_one_b(2, 2);
  s.stages = 3;
  EXPECT_EQ(usage_error([&] { pp::validate(s); }),
            "invalid pipeline schedule '1F1B': stages = 3 on 2 workers; expected a positive "
            "multiple of the workers (v stages on each)");
  s = pp::one_f_one_b(2, 2);
  s.actions.pop_back();
  EXPECT_EQ(usage_error([&] { pp::validate(s); }),
            "invalid pipeline schedule '1F1B': actions has 1 lists; expected one per worker (2)");
}

TEST(PipelineSchedule, PerStageCostsThatAreEqualGiveTheSharedCostsResult) {
  for (const pp::Costs& c : {pp::Costs{1, 2, 1, 1}, pp::Costs{0.7, 1.3, 0.4, 0.9}}) {
    for (int p = 1; p <= 4; ++p) {
      for (int m = 1; m <= 2 * p; ++m) {
        for (int v = 1; v <= 2; ++v) {
          for (ScheduleKind kind : kAllKinds) {
            if (v > 1 && kind != ScheduleKind::kInterleaved1F1B) continue;
            SCOPED_TRACE(label(kind, p, v, m));
            const pp::Schedule s = pp::make_schedule(kind, p, v, m);
            const pp::Simulation shared = pp::simulate(s, c);
            const pp::Simulation each =
                pp::simulate(s, std::vector<pp::Costs>(static_cast<size_t>(s.stages), c));
            EXPECT_EQ(each.makespan, shared.makespan);
            EXPECT_EQ(each.bubble, shared.bubble);
            EXPECT_EQ(each.start, shared.start);
            EXPECT_EQ(each.peak_in_flight, shared.peak_in_flight);
          }
        }
      }
    }
  }
}

TEST(PipelineSchedule, PerStageCostsWithASlowerLastStage) {
  // p = 2, stage 0: f0 = 1, b0 = 2; stage 1 (the loss): f1 = 2, b1 = 3. Stage 1 is the
  // bottleneck and never waits after its first input: GPipe and 1F1B both take
  // f0 + m (f1 + b1) + b0 (stage 0's first forward, stage 1's work, stage 0's last backward).
  const std::vector<pp::Costs> costs = {pp::Costs{1, 2, 1, 1}, pp::Costs{2, 3, 1, 1}};
  for (ScheduleKind kind : {ScheduleKind::kGPipe, ScheduleKind::k1F1B}) {
    for (int m = 1; m <= 6; ++m) {
      SCOPED_TRACE(label(kind, 2, 1, m));
      const pp::Simulation sim = pp::simulate(pp::make_schedule(kind, 2, 1, m), costs);
      EXPECT_EQ(sim.makespan, 1 + m * (2 + 3) + 2);
      EXPECT_NEAR(sim.bubble, 1 - m * (1 + 2 + 2 + 3) / (2.0 * sim.makespan), 1e-12);
    }
  }
  // 1F1B, m = 2, worked by hand (the lists as in SimulationStartsEachActionAsEarlyAsItsWaitsAllow):
  //   worker 0: F0.0 SA0.0 F0.1 SA0.1 RG0.0 B0.0 RG0.1 B0.1
  //   worker 1: RA1.0 F1.0 B1.0 SG1.0 RA1.1 F1.1 B1.1 SG1.1
  const pp::Simulation sim = pp::simulate(pp::one_f_one_b(2, 2), costs);
  EXPECT_EQ(sim.start[0], (std::vector<double>{0, 1, 1, 2, 6, 6, 11, 11}));
  EXPECT_EQ(sim.start[1], (std::vector<double>{1, 1, 3, 6, 6, 6, 8, 11}));
  EXPECT_EQ(sim.makespan, 13);
  EXPECT_NEAR(sim.bubble, 1 - 16.0 / 26, 1e-12);
  EXPECT_EQ(sim.peak_in_flight, (std::vector<int>{2, 1}));
}

TEST(PipelineSchedule, PerStageCostsNeedOnePerStage) {
  EXPECT_EQ(usage_error([] { pp::simulate(pp::one_f_one_b(2, 2), std::vector<pp::Costs>(1)); }),
            "simulate: 1 per-stage costs for 2 stages; expected one Costs per stage");
  EXPECT_EQ(usage_error([] {
              pp::simulate(pp::interleaved_one_f_one_b(2, 2, 2), std::vector<pp::Costs>(2));
            }),
            "simulate: 2 per-stage costs for 4 stages; expected one Costs per stage");
  EXPECT_EQ(usage_error([] {
              pp::simulate(pp::one_f_one_b(2, 2), {pp::Costs{}, pp::Costs{1, 2, -1, 1}});
            }),
            "simulate: costs[1].backward_input = -1; expected a finite cost of at least 0");
}

TEST(PipelineSchedule, SimulateNeedsAValidScheduleAndCosts) {
  pp::Schedule s = pp::gpipe(1, 1);
  std::swap(s.actions[0][0], s.actions[0][1]);
  EXPECT_NE(usage_error([&] { pp::simulate(s); }).find("expected after the forward"),
            std::string::npos);
  EXPECT_EQ(usage_error([&] {
              pp::simulate(pp::gpipe(1, 1), pp::Costs{1, -2, 1, 1});
            }),
            "simulate: costs.backward = -2; expected a finite cost of at least 0");
}

TEST(PipelineSchedule, GeneratorArguments) {
  EXPECT_EQ(usage_error([] { pp::gpipe(0, 4); }), "gpipe: workers = 0; expected at least 1");
  EXPECT_EQ(usage_error([] { pp::one_f_one_b(2, 0); }),
            "one_f_one_b: micro_batches = 0; expected at least 1");
  EXPECT_EQ(usage_error([] { pp::interleaved_one_f_one_b(2, 0, 4); }),
            "interleaved_one_f_one_b: stages_per_worker = 0; expected at least 1");
  EXPECT_EQ(usage_error([] { pp::make_schedule(ScheduleKind::kZeroBubbleH1, 2, 2, 4); }),
            "pipeline schedule zb: stages_per_worker = 2; expected 1 (only the interleaved "
            "schedule holds several stages per worker)");
}

TEST(PipelineSchedule, ParseScheduleKind) {
  for (ScheduleKind kind : kAllKinds) {
    EXPECT_EQ(pp::parse_schedule_kind(pp::schedule_kind_name(kind)), kind);
  }
  EXPECT_EQ(pp::parse_schedule_kind("1F1B"), ScheduleKind::k1F1B);
  EXPECT_EQ(pp::schedule_kind_name(ScheduleKind::kZeroBubbleH1), "zb");
  EXPECT_EQ(usage_error([] { pp::parse_schedule_kind("pipedream"); }),
            "unknown pipeline schedule 'pipedream'; expected one of gpipe, 1f1b, interleaved, zb");
  EXPECT_EQ(usage_error([] { pp::parse_schedule_kind(""); }),
            "unknown pipeline schedule ''; expected one of gpipe, 1f1b, interleaved, zb");
}

}  // namespace
