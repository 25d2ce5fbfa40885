#include "durable.h"

#include <sys/stat.h>

#include <cerrno>
#include <string_view>
#include <vector>

#include "checkpoint/file.h"
#include "shoal/core/env.h"
#include "shoal/core/error.h"

namespace shoal::elastic {

DurableCommits::DurableCommits(std::string path, int64_t every) : path_(std::move(path)) {
  const env::Environment environment = env::current();
  if (path_.empty()) path_ = env::get(environment, "SHOAL_CHECKPOINT").value_or("");
  if (every < 0) {
    throw UsageError("elastic::StateOptions::checkpoint_every=" + std::to_string(every) +
                     ": expected a number of commits >= 1 (0: SHOAL_CHECKPOINT_EVERY or 100)");
  }
  if (every > 0) {
    every_ = every;
  } else if (auto from_env =
                 env::get_int(environment, "SHOAL_CHECKPOINT_EVERY", 1, int64_t{1} << 40)) {
    every_ = *from_env;
  }
}

DurableCommits::~DurableCommits() {
  if (writing_.valid()) writing_.wait();
}

void DurableCommits::write(int64_t version, std::string payload) {
  wait();
  written_ = version;
  // The payload is serialized by the caller at its commit (the next step changes the
  // parameters); only the disk's part runs beside the training.
  writing_ = std::async(std::launch::async, [path = path_, payload = std::move(payload)] {
    checkpoint::write_file(path, payload);
  });
}

void DurableCommits::wait() {
  if (writing_.valid()) writing_.get();
}

bool DurableCommits::exists() const {
  struct stat info {};
  return !(::stat(path_.c_str(), &info) != 0 && errno == ENOENT);
}

std::optional<std::string> DurableCommits::read() const {
  if (!exists()) return std::nullopt;
  return checkpoint::read_file(path_);
}

}  // namespace shoal::elastic
