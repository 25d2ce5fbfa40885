#include "heartbeat.h"

#include <limits>
#include <utility>

#include "shoal/core/error.h"

namespace shoal::queue {
// Reading a report's fields; a named namespace, not an anonymous one, so that no helper meets a
// namesake in shoal_queue's unity batches (server.cpp has its own job_id).
namespace heartbeat_fields {

using nlohmann::json;

// What a refused field is: "a string", "an array", ..., or a number's own text ("2.5").
std::string kind_of(const json& value) {
  switch (value.type()) {
    case json::value_t::null: return "null";
    case json::value_t::object: return "an object";
    case json::value_t::array: return "an array";
    case json::value_t::string: return "a string";
    case json::value_t::boolean: return "a boolean";
    default: return value.dump();
  }
}

[[noreturn]] void refuse(const std::string& field, const std::string& is,
                                const std::string& expected) {
  throw UsageError("heartbeat: field '" + field + "' " + is + "; expected " + expected);
}

// The member `name` of `object` (itself at `path`: "" or "workers[2].").
const json& at(const json& object, const std::string& path, const char* name,
                      const std::string& expected) {
  auto it = object.find(name);
  if (it == object.end()) refuse(path + name, "is missing", expected);
  return *it;
}

template <typename Int>
Int integer(const json& value, const std::string& field, const std::string& expected) {
  if (value.is_number_unsigned()) {
    const auto number = value.get<uint64_t>();
    if (number <= static_cast<uint64_t>(std::numeric_limits<Int>::max()))
      return static_cast<Int>(number);
  } else if (value.is_number_integer()) {
    const auto number = value.get<int64_t>();
    if (number >= std::numeric_limits<Int>::min() && number <= std::numeric_limits<Int>::max())
      return static_cast<Int>(number);
  }
  refuse(field, "is " + kind_of(value) + (value.is_number_integer() ? ", out of range" : ""),
         expected);
}

template <typename Int>
Int integer_at(const json& object, const std::string& path, const char* name,
               const std::string& expected) {
  return integer<Int>(at(object, path, name, expected), path + name, expected);
}

bool boolean_at(const json& object, const std::string& path, const char* name) {
  const json& value = at(object, path, name, "true or false");
  if (!value.is_boolean()) refuse(path + name, "is " + kind_of(value), "true or false");
  return value.get<bool>();
}

std::string string_at(const json& object, const std::string& path, const char* name,
                             const std::string& expected) {
  const json& value = at(object, path, name, expected);
  if (!value.is_string()) refuse(path + name, "is " + kind_of(value), expected);
  return value.get<std::string>();
}

void expect_object(const json& value, const std::string& field,
                          const std::string& expected) {
  if (!value.is_object()) refuse(field, "is " + kind_of(value), expected);
}

// A job's id as a key of `members`: the digits std::to_string writes, positive.
std::optional<int64_t> job_id(const std::string& key) {
  if (key.empty() || key.size() > 18 || key[0] == '0') return std::nullopt;
  int64_t id = 0;
  for (const char c : key) {
    if (c < '0' || c > '9') return std::nullopt;
    id = id * 10 + (c - '0');
  }
  return id;
}

// `progress` at `path` ("workers[0].progress.").
HeartbeatReport::Progress progress(const json& in, const std::string& path) {
  HeartbeatReport::Progress p;
  p.time_ms = integer_at<int64_t>(in, path, "time_ms", "wall-clock milliseconds, an integer");
  p.samples = integer_at<int64_t>(in, path, "samples", "a count of samples, an integer");
  p.world = integer_at<int>(in, path, "world", "a count of workers, an integer");
  // Written by workers that measure the gradient noise; absent from those of before.
  if (in.contains("noise_scale")) {
    const json& value = in.at("noise_scale");
    if (!value.is_number() || !(value.get<double>() >= 0))
      refuse(path + "noise_scale", "is " + kind_of(value), "a noise scale in samples, a number >= 0");
    p.noise_scale = value.get<double>();
  }
  if (in.contains("batch_per_worker")) {
    p.batch_per_worker =
        integer_at<int64_t>(in, path, "batch_per_worker", "each worker's batch, an integer (0: the global batch stays)");
  }
  // Written by workers under BatchPolicy::goodput() only.
  if (in.contains("batch")) {
    const json& batch = in.at("batch");
    const std::string at = path + "batch.";
    if (!batch.is_object())
      refuse(path + "batch", "is " + kind_of(batch), "the batch's limits, an object");
    p.batch_limits.base_batch =
        integer_at<int64_t>(batch, at, "base", "the base global batch, an integer");
    p.batch_limits.max_batch =
        integer_at<int64_t>(batch, at, "max", "the largest global batch, an integer");
    p.batch_limits.min_local =
        integer_at<int64_t>(batch, at, "min_local", "a worker's smallest batch, an integer");
    p.batch_limits.max_local =
        integer_at<int64_t>(batch, at, "max_local", "a worker's largest batch, an integer");
    p.batch_limits.max_accumulation =
        integer_at<int>(batch, at, "max_accumulation", "backward passes a step, an integer");
    p.batch_limits.check(("heartbeat: field '" + path + "batch'").c_str());
    const json steps = in.value("steps", json::array());
    if (!steps.is_array())
      refuse(path + "steps", "is " + kind_of(steps), "the step times, an array");
    for (size_t i = 0; i < steps.size(); ++i) {
      const json& step = steps[i];
      const bool valid = step.is_array() && step.size() == 4 && step[0].is_number_integer() &&
                         step[1].is_number() && step[2].is_number() &&
                         step[3].is_number_integer() && step[0].get<int>() >= 1 &&
                         step[1].get<double>() > 0 && step[2].get<double>() > 0 &&
                         step[3].get<int>() >= 1;
      if (!valid) {
        refuse(path + "steps[" + std::to_string(i) + "]", "is " + step.dump(),
               "[workers >= 1, batch per backward > 0, seconds > 0, backward passes >= 1]");
      }
      p.steps.push_back(
          {step[0].get<int>(), step[1].get<double>(), step[2].get<double>(), step[3].get<int>()});
    }
  }
  return p;
}

}  // namespace heartbeat_fields

using heartbeat_fields::json;

void to_json(nlohmann::json& out, const HeartbeatReport::Progress& p) {
  out = nlohmann::json{{"time_ms", p.time_ms},
                       {"samples", p.samples},
                       {"world", p.world},
                       {"noise_scale", p.noise_scale},
                       {"batch_per_worker", p.batch_per_worker}};
  if (const BatchLimits& limits = p.batch_limits; limits.base_batch > 0) {
    out["batch"] = {{"base", limits.base_batch},
                    {"max", limits.max_batch},
                    {"min_local", limits.min_local},
                    {"max_local", limits.max_local},
                    {"max_accumulation", limits.max_accumulation}};
    nlohmann::json steps = nlohmann::json::array();
    for (const auto& step : p.steps)
      steps.push_back({step.world, step.local_batch, step.seconds, step.accumulation});
    out["steps"] = steps;
  }
}

void from_json(const nlohmann::json& in, HeartbeatReport::Progress& p) {
  heartbeat_fields::expect_object(in, "progress", "the job's progress, an object");
  p = heartbeat_fields::progress(in, "progress.");
}

void to_json(nlohmann::json& out, const HeartbeatReport& report) {
  nlohmann::json workers = nlohmann::json::array();
  for (const auto& w : report.workers) {
    nlohmann::json entry = {{"id", w.id},
                            {"job", w.job},
                            {"pid", w.pid},
                            {"running", w.running},
                            {"started_ms", w.started_ms},
                            {"exit", w.exit},
                            {"success", w.success}};
    if (w.progress) entry["progress"] = *w.progress;
    workers.push_back(std::move(entry));
  }
  nlohmann::json members = nlohmann::json::object();
  for (const auto& [job, address] : report.members) members[std::to_string(job)] = address;
  out = nlohmann::json{{"host", report.host},
                       {"cores", report.cores},
                       {"slots", report.slots},
                       {"pid", report.pid},
                       {"nudge_port", report.nudge_port},
                       {"stopping", report.stopping},
                       {"workers", std::move(workers)},
                       {"members", std::move(members)}};
}

void from_json(const nlohmann::json& in, HeartbeatReport& report) {
  using namespace heartbeat_fields;
  if (!in.is_object())
    throw UsageError("heartbeat: the report is " + kind_of(in) + "; expected an object");
  HeartbeatReport r;
  r.host = string_at(in, "", "host", "the host's name, a string");
  if (r.host.empty()) refuse("host", "is empty", "the host's name");
  r.cores = integer_at<int>(in, "", "cores", "the host's cores, an integer");
  r.slots = integer_at<int>(in, "", "slots", "the host's slots, an integer (0: from its cores)");
  r.pid = integer_at<int64_t>(in, "", "pid", "the agent's pid, an integer");
  r.nudge_port =
      integer_at<int>(in, "", "nudge_port", "the agent's UDP port for nudges, an integer (0: none)");
  if (in.contains("stopping")) r.stopping = boolean_at(in, "", "stopping");

  const json& workers = at(in, "", "workers", "an array of workers");
  if (!workers.is_array()) refuse("workers", "is " + kind_of(workers), "an array of workers");
  for (size_t i = 0; i < workers.size(); ++i) {
    const std::string path = "workers[" + std::to_string(i) + "]";
    const json& entry = workers[i];
    expect_object(entry, path, "a worker, an object");
    const std::string in_entry = path + ".";
    HeartbeatReport::Worker w;
    w.id = integer_at<int64_t>(entry, in_entry, "id", "a worker's id, an integer");
    w.job = integer_at<int64_t>(entry, in_entry, "job", "a job's id, an integer");
    w.pid = integer_at<int64_t>(entry, in_entry, "pid", "a pid, an integer (0: none yet)");
    w.running = boolean_at(entry, in_entry, "running");
    w.started_ms = integer_at<int64_t>(entry, in_entry, "started_ms",
                                       "wall-clock milliseconds, an integer");
    w.exit = string_at(entry, in_entry, "exit", "how the worker ended, a string");
    w.success = boolean_at(entry, in_entry, "success");
    if (entry.contains("progress")) {
      const json& p = entry.at("progress");
      expect_object(p, in_entry + "progress", "the job's progress, an object");
      w.progress = progress(p, in_entry + "progress.");
    }
    r.workers.push_back(std::move(w));
  }

  const std::string address_map = "an object from job ids to membership addresses";
  const json& members = at(in, "", "members", address_map);
  expect_object(members, "members", address_map);
  for (const auto& [key, address] : members.items()) {
    const std::optional<int64_t> job = job_id(key);
    if (!job) refuse("members", "has the key '" + key + "'", "job ids (positive integers) as keys");
    if (!address.is_string())
      refuse("members." + key, "is " + kind_of(address), "a membership address, a string");
    r.members[*job] = address.get<std::string>();
  }
  report = std::move(r);
}

}  // namespace shoal::queue
