// Forwarding worker output: whole lines only, optionally tagged with the worker's rank.
//
// Every worker writes into its own pipes and the launcher alone writes to its stdout and stderr,
// one whole line (or a batch of whole lines) per write. So lines of different workers never mix
// within a line, whatever the workers' own buffering, and stdout stays apart from stderr.
#pragma once

#include <cstddef>
#include <string>
#include <utility>

#include "proc/fd.h"

namespace shoal::launch {

// The launcher's stdout or stderr. When the reader goes away (EPIPE) output is dropped and the
// job goes on: a closed pager should not kill a training run.
class Sink {
 public:
  explicit Sink(int fd) : fd_(fd) {}
  void write(const std::string& text);

 private:
  int fd_;
  bool broken_ = false;
};

class LineForwarder {
 public:
  // A longer line is cut into pieces of this size, each written as a line: the launcher must
  // not hold unbounded memory for a worker that never writes a newline.
  static constexpr size_t kMaxLine = 64 * 1024;

  // prefix is written before each line ("[3] "), or empty.
  LineForwarder(std::string prefix, Sink& sink) : prefix_(std::move(prefix)), sink_(&sink) {}

  // Writes the complete lines of data; keeps an incomplete last line for the next call.
  void feed(const char* data, size_t size);
  // The worker's stream ended: writes a kept incomplete line, with a newline added.
  void finish();

 private:
  void append_line(const char* begin, size_t size);

  std::string prefix_;
  Sink* sink_;
  std::string partial_;
  std::string batch_;
};

// Reads what is available on a non-blocking pipe into forwarder, at most max_reads chunks so that
// one chatty worker cannot starve the others. Returns false at EOF (or on a read error).
bool pump(const proc::Fd& pipe, LineForwarder& forwarder, int max_reads);

}  // namespace shoal::launch
