// The scheduler's public face: what a user submits (Submission) and the Scheduler object, whose
// work the scheduler_*.cpp files share (their list is in scheduler_impl.h).
#include "scheduler.h"

#include <sys/stat.h>
#include <unistd.h>

#include "scheduler_impl.h"
#include "shoal/core/error.h"

namespace shoal::queue {

using nlohmann::json;

namespace {

constexpr int kMaxPriority = 1000000;
// What one submission may hold (docs/queue.md, "Submitting"): every job is kept in the database
// and served to every client and dashboard refresh, so none may be large.
constexpr size_t kMaxName = 200;
constexpr size_t kMaxPath = 4096;
constexpr size_t kMaxArgvBytes = 128 * 1024;
constexpr size_t kMaxEnvBytes = 256 * 1024;

void check_size(const std::string& what, size_t size, size_t most, const std::string& unit) {
  if (size > most) {
    throw UsageError(what + " has " + std::to_string(size) + " " + unit + "; at most " +
                     std::to_string(most) + " are accepted");
  }
}

int int_field(const json& body, const char* name, int fallback, int low, int high) {
  if (!body.contains(name)) return fallback;
  const json& value = body.at(name);
  if (!value.is_number_integer()) {
    throw UsageError(std::string(name) + " must be an integer, not " + value.dump());
  }
  const int64_t number = value.get<int64_t>();
  if (number < low || number > high) {
    throw UsageError(std::string(name) + " must be between " + std::to_string(low) + " and " +
                     std::to_string(high) + ", not " + std::to_string(number));
  }
  return static_cast<int>(number);
}

}  // namespace

std::optional<int64_t> parse_integer(const std::string& text, int64_t low, int64_t high) {
  try {
    size_t used = 0;
    const long long value = std::stoll(text, &used);
    if (used == text.size() && value >= low && value <= high) return value;
  } catch (const std::exception&) {
  }
  return std::nullopt;
}

Submission Submission::from_json(const json& body) {
  if (!body.is_object()) throw UsageError("a job must be a JSON object");
  Submission spec;
  if (!body.contains("argv") || !body.at("argv").is_array() || body.at("argv").empty()) {
    throw UsageError("argv must be a non-empty array: the program and its arguments");
  }
  size_t argv_bytes = 0;
  for (const auto& arg : body.at("argv")) {
    if (!arg.is_string()) throw UsageError("argv must hold strings, not " + arg.dump());
    spec.argv.push_back(arg.get<std::string>());
    argv_bytes += spec.argv.back().size() + 1;
  }
  check_size("argv", argv_bytes, kMaxArgvBytes, "bytes");
  const std::string& program = spec.argv[0];
  if (program.empty() || program[0] != '/') {
    throw UsageError("the program must be an absolute path, not '" + program + "'");
  }
  struct stat info {};
  if (::stat(program.c_str(), &info) != 0) {
    throw UsageError("program '" + program + "' does not exist");
  }
  if (S_ISDIR(info.st_mode) || ::access(program.c_str(), X_OK) != 0) {
    throw UsageError("program '" + program + "' is not an executable file");
  }
  if (body.contains("name") && !body.at("name").is_string())
    throw UsageError("name must be a string, not " + body.at("name").dump());
  spec.name = body.value("name", std::string());
  check_size("the name", spec.name.size(), kMaxName, "bytes");
  if (body.contains("cwd") && !body.at("cwd").is_string())
    throw UsageError("cwd must be a string, not " + body.at("cwd").dump());
  spec.cwd = body.value("cwd", std::string("/"));
  check_size("cwd", spec.cwd.size(), kMaxPath, "bytes");
  if (body.contains("env")) {
    if (!body.at("env").is_object()) throw UsageError("env must be an object of strings");
    size_t env_bytes = 0;
    for (const auto& [key, value] : body.at("env").items()) {
      if (!value.is_string()) throw UsageError("env." + key + " must be a string");
      spec.env[key] = value.get<std::string>();
      env_bytes += key.size() + spec.env[key].size() + 2;
    }
    check_size("env", env_bytes, kMaxEnvBytes, "bytes");
  }
  if (body.contains("priority") && !body.at("priority").is_number_integer()) {
    throw UsageError("--priority must be an integer (higher runs first), not " +
                     body.at("priority").dump());
  }
  spec.priority = int_field(body, "priority", 0, -kMaxPriority, kMaxPriority);
  spec.min_workers = int_field(body, "min", 1, 1, 4096);
  spec.max_workers = int_field(body, "max", spec.min_workers, 1, 4096);
  if (spec.min_workers > spec.max_workers) {
    throw UsageError("--min " + std::to_string(spec.min_workers) + " is above --max " +
                     std::to_string(spec.max_workers) + "; expected --min <= --max");
  }
  if (body.contains("preemptible") && !body.at("preemptible").is_boolean()) {
    throw UsageError("preemptible must be true or false");
  }
  spec.preemptible = body.value("preemptible", false);
  spec.max_restarts = int_field(body, "max_restarts", 3, 0, 1000);
  spec.owner = body.value("owner", std::string("admin"));
  spec.run_as = body.value("run_as", std::string());
  return spec;
}

json Submission::to_json() const {
  return json{{"name", name},
              {"argv", argv},
              {"cwd", cwd},
              {"env", env},
              {"priority", priority},
              {"min", min_workers},
              {"max", max_workers},
              {"preemptible", preemptible},
              {"max_restarts", max_restarts},
              {"owner", owner},
              {"run_as", run_as}};
}

Scheduler::Scheduler(SchedulerOptions options)
    : impl_(std::make_unique<Impl>(std::move(options))) {}

Scheduler::~Scheduler() = default;

void Scheduler::tick() {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->tick();
}

std::set<std::string> Scheduler::take_news() {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  std::set<std::string> out;
  out.swap(impl_->news);
  return out;
}

}  // namespace shoal::queue
