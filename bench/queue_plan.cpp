// shoal::queue::plan() (src/queue/policy.h) as a filter, for simulators written in another
// language: one snapshot per line of JSON on stdin, one plan per line of JSON on stdout, until
// stdin ends. bench/pollux.py drives it from Pollux's cluster simulator; it is the very function
// the scheduler calls, not a copy.
//
//   in:  {"now": 120, "idle_since": 60 | null, "policy": "priority" | "goodput",
//         "options": {"cooldown": 30, "grow_idle": 5, "min_gain": 0.25, ...},   (all optional)
//         "hosts": [{"name": "h0", "capacity": 4}, ...],
//         "jobs": [{"id": 1, "priority": 0, "min": 1, "max": 8, "preemptible": true,
//                   "submitted": 0, "running": true, "last_resize": 60 | null, "resizes": 2,
//                   "workers": [{"id": 7, "host": "h0", "leaving": false}, ...],
//                   "throughput": {"1": 52.0, "4": 180.5}, "noise_scale": 0,
//                   "batch_per_worker": 0,
//                   "batch": {"base": 128, "max": 4096, "min_local": 16, "max_local": 256,
//                             "max_accumulation": 4},
//                   "steps": [[1, 128, 0.31], [4, 32, 0.12, 2]]}, ...]}  (the last two optional;
//                   a step: world, batch per backward, seconds, backward passes (default 1))
//   out: {"actions": [{"kind": "start", "job": 1, "hosts": ["h0"], "workers": [], "reason": "..."}],
//         "waiting": {"3": "..."}, "free_after": 2}
//
// A line may instead ask what batch a job whose batch follows its world by goodput picks
// (shoal::best_batch, shoal/dp/goodput.h, what elastic::BatchPolicy::goodput() calls):
//   in:  {"choose": {"world": 4, "batch": {...}, "steps": [...], "noise_scale": 900,
//                    "overhead_prior": 0.05}}
//   out: {"local_batch": 64, "accumulation": 1, "global_batch": 256, "throughput": 812.0,
//         "efficiency": 0.91, "goodput": 739.0}
//
// A line that is not such a snapshot ends the program with a one-line error naming what was wrong.
#include <cmath>
#include <cstdio>
#include <iostream>
#include <limits>
#include <string>

#include <nlohmann/json.hpp>

#include "queue/policy.h"

namespace {

namespace q = shoal::queue;
using nlohmann::json;

// null stands for an infinity: JSON has none.
double time_or(const json& value, double infinite) {
  return value.is_null() ? infinite : value.get<double>();
}

q::PolicyOptions options_of(const json& line) {
  q::PolicyOptions options;
  const std::string policy = line.value("policy", "priority");
  if (policy == "goodput") {
    options.kind = q::PolicyOptions::Kind::kGoodput;
  } else if (policy != "priority") {
    throw std::invalid_argument("\"policy\" is \"" + policy + "\"; expected priority or goodput");
  }
  const json given = line.value("options", json::object());
  options.cooldown = given.value("cooldown", options.cooldown);
  options.grow_idle = given.value("grow_idle", options.grow_idle);
  options.min_gain = given.value("min_gain", options.min_gain);
  options.fair_share = given.value("fair_share", options.fair_share);
  options.overhead_prior = given.value("overhead_prior", options.overhead_prior);
  options.resize_cost = given.value("resize_cost", options.resize_cost);
  return options;
}

shoal::BatchLimits limits_of(const json& given) {
  shoal::BatchLimits limits;
  limits.base_batch = given.at("base").get<int64_t>();
  limits.max_batch = given.at("max").get<int64_t>();
  limits.min_local = given.value("min_local", int64_t{1});
  limits.max_local = given.value("max_local", int64_t{0});
  limits.max_accumulation = given.value("max_accumulation", 1);
  limits.check("\"batch\"");
  return limits;
}

std::vector<shoal::StepSample> steps_of(const json& given) {
  std::vector<shoal::StepSample> steps;
  for (const auto& step : given) {
    steps.push_back({step.at(0).get<int>(), step.at(1).get<double>(), step.at(2).get<double>(),
                     step.size() > 3 ? step.at(3).get<int>() : 1});
  }
  return steps;
}

json choice_of(const json& given) {
  const auto model = shoal::StepTimeModel::fit(steps_of(given.value("steps", json::array())),
                                               given.value("overhead_prior", 0.05));
  const auto choice =
      shoal::best_batch(model, shoal::GradientNoise::of_scale(given.value("noise_scale", 0.0)),
                        given.at("world").get<int>(), limits_of(given.at("batch")));
  return {{"local_batch", choice.local_batch},   {"accumulation", choice.accumulation},
          {"global_batch", choice.global_batch}, {"throughput", choice.throughput},
          {"efficiency", choice.efficiency},     {"goodput", choice.goodput}};
}

q::Snapshot snapshot_of(const json& line) {
  constexpr double kInf = std::numeric_limits<double>::infinity();
  q::Snapshot snapshot;
  snapshot.now = line.at("now").get<double>();
  snapshot.idle_since = time_or(line.value("idle_since", json()), kInf);
  for (const auto& host : line.at("hosts")) {
    snapshot.hosts.push_back({host.at("name").get<std::string>(), host.at("capacity").get<int>(),
                              host.value("alive", true), host.value("held", 0)});
  }
  for (const auto& given : line.at("jobs")) {
    q::JobView job;
    job.id = given.at("id").get<int64_t>();
    job.priority = given.value("priority", 0);
    job.min_workers = given.at("min").get<int>();
    job.max_workers = given.at("max").get<int>();
    job.preemptible = given.value("preemptible", false);
    job.submitted = given.at("submitted").get<double>();
    job.running = given.at("running").get<bool>();
    job.last_resize = time_or(given.value("last_resize", json()), -kInf);
    job.resizes = given.value("resizes", 0);
    const json workers = given.value("workers", json::array());
    for (const auto& worker : workers) {
      job.workers.push_back({worker.at("id").get<int64_t>(), worker.at("host").get<std::string>(),
                             worker.value("leaving", false)});
    }
    const json throughput = given.value("throughput", json::object());
    for (const auto& [count, rate] : throughput.items()) {
      job.throughput[std::stoi(count)] = rate.get<double>();
    }
    job.noise_scale = given.value("noise_scale", 0.0);
    job.batch_per_worker = given.value("batch_per_worker", int64_t{0});
    if (given.contains("batch")) job.batch_limits = limits_of(given.at("batch"));
    job.steps = steps_of(given.value("steps", json::array()));
    snapshot.jobs.push_back(std::move(job));
  }
  return snapshot;
}

json json_of(const q::Plan& plan) {
  json actions = json::array();
  for (const auto& action : plan.actions) {
    actions.push_back({{"kind", q::to_string(action.kind)},
                       {"job", action.job},
                       {"hosts", action.hosts},
                       {"workers", action.workers},
                       {"reason", action.reason}});
  }
  json waiting = json::object();
  for (const auto& [job, why] : plan.waiting) waiting[std::to_string(job)] = why;
  return {{"actions", actions}, {"waiting", waiting}, {"free_after", plan.free_after}};
}

}  // namespace

int main() {
  std::ios::sync_with_stdio(false);
  std::string text;
  for (long number = 1; std::getline(std::cin, text); ++number) {
    try {
      const json line = json::parse(text);
      const json out = line.contains("choose")
                           ? choice_of(line.at("choose"))
                           : json_of(q::plan(snapshot_of(line), options_of(line)));
      std::cout << out.dump() << '\n' << std::flush;
    } catch (const std::exception& error) {
      std::fprintf(stderr, "queue_plan: line %ld is not a snapshot or a choice: %s\n", number,
                   error.what());
      return 2;
    }
  }
  return 0;
}
