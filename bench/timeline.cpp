// The cost of one timeline slice, off and on (docs/runtime.md, "Timeline"): a loop of empty
// scoped slices, first before the timeline starts, then recording into a file.
//
//   bench/timeline_slice [--slices N] [--file PATH]   (default 1000000,
//   /tmp/shoal-slice-bench.json)
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

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
  int64_t slices = 1000000;
  std::string path = "/tmp/shoal-slice-bench.json";
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--slices") {
      slices = std::atoll(argv[i + 1]);
    } else if (flag == "--file") {
      path = argv[i + 1];
    } else {
      std::fprintf(stderr,
                   "timeline_slice: unknown flag '%s'; expected --slices N or --file PATH\n",
                   flag.c_str());
      return 2;
    }
  }
  if (slices < 1) {
    std::fprintf(stderr, "timeline_slice: expected --slices >= 1\n");
    return 2;
  }
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
