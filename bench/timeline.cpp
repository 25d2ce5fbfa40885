// The cost of one timeline slice, off and on (docs/runtime.md, "Timeline"): a loop of empty
// scoped slices, first before the timeline starts, then recording into a file.
//
//   bench/timeline_slice [--slices N] [--file PATH]   (default 1000000,
//   /tmp/shoal-slice-bench.json)
#include <chrono>
#include <cstdio>
#include <string>

#include <CLI/CLI.hpp>

#include "core/timeline_start.h"
#include "shoal/core/timeline.h"

namespace {

double ns_per_slice(int64_t slices) {
  const auto start = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < slices; ++i) {
    shoal::timeline::Slice slice("step", "bench", {{"i", i}});
  }
  shoal::timeline::flush();  // the writes belong to the cost
  const auto end = std::chrono::steady_clock::now();
  return std::chrono::duration<double, std::nano>(end - start).count() /
         static_cast<double>(slices);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"The cost of one timeline slice, off and on"};
  int64_t slices = 1000000;
  std::string path = "/tmp/shoal-slice-bench.json";
  app.add_option("--slices", slices, "Slices timed each way (default 1000000)")
      ->check(CLI::PositiveNumber);
  app.add_option("--file", path, "The timeline's file (default /tmp/shoal-slice-bench.json)");
  CLI11_PARSE(app, argc, argv);
  const double off = ns_per_slice(slices);
  shoal::timeline::start(
      {{"SHOAL_TIMELINE", path}, {"SHOAL_TIMELINE_MAX_EVENTS", std::to_string(slices)}}, 0,
      std::string());
  const double on = ns_per_slice(slices);
  std::printf("timeline_slice slices=%lld off_ns=%.1f on_ns=%.1f\n", static_cast<long long>(slices),
              off, on);
  std::remove(path.c_str());
  return 0;
}
