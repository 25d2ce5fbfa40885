// The `shoal run` command from the outside, for tests: the real binary (shoal_bin()) in a child
// process, its stdout and stderr captured apart, every wait with a deadline.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <string>
#include <vector>

namespace shoal::testing {

std::vector<std::string> split_lines(const std::string& text);

struct RunResult {
  int exit_code = -1;  // 128 + signal when killed
  bool timed_out = false;
  std::string out;
  std::string err;
  double seconds = 0;
};

// One `shoal run ARGS...` process. The destructor SIGKILLs it if it was not waited for.
class ShoalRun {
 public:
  explicit ShoalRun(const std::vector<std::string>& args);
  // The same inside the network namespace `netns` (ip netns exec).
  ShoalRun(const std::vector<std::string>& args, const std::string& netns);
  ~ShoalRun();
  ShoalRun(const ShoalRun&) = delete;
  ShoalRun& operator=(const ShoalRun&) = delete;

  pid_t pid() const { return pid_; }

  // Reads output until stdout contains `text`. False when the timeout passes first, or stdout
  // closes without it. What was read is kept for wait().
  bool wait_for_output(const std::string& text, std::chrono::milliseconds timeout);
  // Reads output until `ready` holds for what was read so far (both streams). False when the
  // timeout passes first, or both streams close before.
  bool wait_until(const std::function<bool(const RunResult&)>& ready,
                  std::chrono::milliseconds timeout);
  // What was read so far.
  const RunResult& so_far() const { return result_; }

  // Collects output until the launcher has exited and both streams are closed. Past the
  // timeout, SIGKILLs the launcher and reports timed_out.
  RunResult wait(std::chrono::milliseconds timeout = std::chrono::seconds(30));

 private:
  // Reads what is there within `poll_ms` and reaps the launcher if it has exited.
  void pump(int poll_ms);

  std::chrono::steady_clock::time_point start_;
  pid_t pid_ = -1;
  int out_ = -1;
  int err_ = -1;
  bool reaped_ = false;
  RunResult result_;
};

// The pid of a child of `parent` (a launcher) whose command line, its arguments joined by NUL
// bytes, contains `part`; -1 when none does.
pid_t find_child(pid_t parent, const std::string& part);

RunResult run_shoal(const std::vector<std::string>& args,
                    std::chrono::milliseconds timeout = std::chrono::seconds(30));

}  // namespace shoal::testing
