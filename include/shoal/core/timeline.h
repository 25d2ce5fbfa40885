// The timeline: Chrome trace events of what each worker did, written when SHOAL_TIMELINE names a
// file (see docs/runtime.md, "Timeline (SHOAL_TIMELINE)"). It opens in ui.perfetto.dev or
// chrome://tracing: one process track per worker, named "worker R (pid P on HOST)".
//
// Contract: recording is off until shoal::init() calls start() with SHOAL_TIMELINE set; while
// off, Slice and AsyncSlice cost one relaxed atomic load and record nothing. Argument names
// (the `const char*` of Args and the category) must be string literals: they are kept, not copied.
// All functions are thread-safe.
#pragma once

#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "shoal/core/env.h"

namespace shoal::timeline {

namespace detail {
extern std::atomic<bool> recording;
}

// True while events are recorded.
inline bool enabled() {
  return detail::recording.load(std::memory_order_relaxed);
}

// Integer arguments of a slice, shown when it is selected: {{"stage", 2}, {"micro_batch", 5}}.
using Args = std::initializer_list<std::pair<const char*, int64_t>>;

// A slice from construction to destruction on the calling thread's track. Slices on one thread
// nest as the scopes that hold them do.
class Slice {
 public:
  Slice(std::string name, const char* category, Args args = {});
  ~Slice();
  Slice(const Slice&) = delete;
  Slice& operator=(const Slice&) = delete;

 private:
  int64_t start_ns_ = -1;  // -1: not recording
  std::string name_;
  const char* category_ = nullptr;
  std::vector<std::pair<const char*, int64_t>> args_;
};

// A slice whose end is known later, on any thread (an operation in flight, such as a Work of
// comm::Group). It is drawn on one of the worker's "comm" tracks, chosen so that slices on one
// track never overlap. end() closes it; the destructor closes it if end() was not called.
class AsyncSlice {
 public:
  AsyncSlice() = default;  // records nothing
  AsyncSlice(std::string name, const char* category, Args args = {});
  ~AsyncSlice();
  AsyncSlice(AsyncSlice&& other) noexcept;
  AsyncSlice& operator=(AsyncSlice&& other) noexcept;
  AsyncSlice(const AsyncSlice&) = delete;
  AsyncSlice& operator=(const AsyncSlice&) = delete;

  void rename(std::string name);
  void end();

 private:
  int64_t start_ns_ = -1;  // -1: not recording, or ended
  int lane_ = 0;
  std::string name_;
  const char* category_ = nullptr;
  std::vector<std::pair<const char*, int64_t>> args_;
};

// Appends the events recorded so far to the file. Called at exit, by std::terminate (an error
// that ends the program) and before an elastic worker leaves; programs that end with _exit call
// it first.
void flush();

}  // namespace shoal::timeline
