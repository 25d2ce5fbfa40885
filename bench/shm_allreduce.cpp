// All-reduce bus bandwidth through shared memory (src/comm/shm) among co-located processes, beside
// a memory-bandwidth bound measured in the same run. No LibTorch, no launcher: it forks its own
// workers, one process per worker, member 0 handing the segment's handle to the others through a
// pipe (as the store will once it is wired into comm::Group).
//
//   shm_allreduce [--workers 2,4] [--min-bytes 4096] [--max-bytes 67108864] [--factor 4]
//                 [--reps 5] [--slot-bytes 1048576]
//
// For each size S of float32 (from --min-bytes to --max-bytes, times --factor each step) and each
// worker count N, the workers run --reps repetitions of enough all-reduces (sum) to move ~64 MiB,
// each repetition between barriers; a repetition's time per all-reduce is member 0's, which the
// barriers make the slowest member's. The table shows the median repetition. Bus bandwidth is
// 2(N-1)/N * S / t, as NCCL and bench/allreduce count it.
// The bound: one core copying the buffer once (memcpy of S bytes) and summing it once
// (a[i] += b[i] over S bytes), measured in this process before the workers start, median of 5;
// "t/bound" is the all-reduce's time over the bound's (below 1: faster than one core could even
// sum and copy the buffer alone, which several cores together can be).
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "comm/shm/local_group.h"
#include "memory_bound.h"

namespace {

using Clock = std::chrono::steady_clock;
using namespace shoal::comm::shm;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

std::vector<size_t> sizes_of(size_t min_bytes, size_t max_bytes, size_t factor) {
  std::vector<size_t> sizes;
  for (size_t s = min_bytes; s <= max_bytes; s *= factor) sizes.push_back(s);
  return sizes;
}

size_t iterations_for(size_t bytes) {
  return std::clamp<size_t>((size_t{64} << 20) / bytes, 3, 2000);
}


struct Row {
  size_t bytes;
  double seconds;
};

// Member `rank`'s part: the timed all-reduces of every size; member 0 returns the median times.
std::vector<Row> run_member(LocalGroup& group, const std::vector<size_t>& sizes, int reps) {
  std::vector<Row> rows;
  for (size_t bytes : sizes) {
    const size_t n = bytes / sizeof(float);
    std::vector<float> data(n, 1.0f);
    const size_t iters = iterations_for(bytes);
    group.all_reduce(data.data(), n, DType::kFloat32, ReduceOp::kSum);  // warm the pages
    std::vector<double> times;
    for (int rep = 0; rep < reps; ++rep) {
      group.barrier();
      const auto start = Clock::now();
      for (size_t it = 0; it < iters; ++it) {
        group.all_reduce(data.data(), n, DType::kFloat32, ReduceOp::kSum);
      }
      group.barrier();
      times.push_back(seconds_since(start) / static_cast<double>(iters));
    }
    rows.push_back({bytes, median(times)});
  }
  return rows;
}

// Forks `workers` processes; member 0 writes its rows (bytes seconds) to `out`.
void run_job(int workers, const std::vector<size_t>& sizes, int reps, size_t slot_bytes, int out) {
  int handles[2];
  if (::pipe(handles) != 0) throw std::runtime_error("pipe failed");
  std::vector<pid_t> pids;
  for (int rank = 0; rank < workers; ++rank) {
    const pid_t pid = ::fork();
    if (pid < 0) throw std::runtime_error("fork failed");
    if (pid > 0) {
      pids.push_back(pid);
      continue;
    }
    try {
      std::optional<Segment> segment;
      if (rank == 0) {
        SegmentSizes segment_sizes;
        segment_sizes.slot_bytes = slot_bytes;
        segment.emplace(Segment::create(workers, segment_sizes));
        char record[512] = {};
        std::snprintf(record, sizeof(record), "%s", segment->handle().c_str());
        for (int i = 1; i < workers; ++i) (void)!::write(handles[1], record, sizeof(record));
      } else {
        char record[512];
        if (::read(handles[0], record, sizeof(record)) != static_cast<ssize_t>(sizeof(record))) {
          throw std::runtime_error("no handle from member 0");
        }
        segment.emplace(
            Segment::open(std::string(record, strnlen(record, sizeof(record))), workers));
      }
      LocalGroup group(std::move(*segment), rank, std::chrono::seconds(60));
      const auto rows = run_member(group, sizes, reps);
      if (rank == 0) {
        for (auto& row : rows) {
          const std::string line =
              std::to_string(row.bytes) + " " + std::to_string(row.seconds) + "\n";
          (void)!::write(out, line.data(), line.size());
        }
      }
      ::_exit(0);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "shm_allreduce: worker %d of %d: %s\n", rank, workers, e.what());
      ::_exit(1);
    }
  }
  ::close(handles[0]);
  ::close(handles[1]);
  for (pid_t pid : pids) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      throw std::runtime_error("a worker of the run with " + std::to_string(workers) + " failed");
    }
  }
}

std::string human(size_t bytes) {
  if (bytes >= (size_t{1} << 20)) return std::to_string(bytes >> 20) + " MiB";
  return std::to_string(bytes >> 10) + " KiB";
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("All-reduce bus bandwidth through shared memory beside the memory-bandwidth bound");
  std::vector<int> workers = {2, 4};
  size_t min_bytes = 4096, max_bytes = size_t{64} << 20, factor = 4, slot_bytes = size_t{1} << 20;
  int reps = 5;
  app.add_option("--workers", workers, "worker counts")->delimiter(',');
  app.add_option("--min-bytes", min_bytes, "smallest size");
  app.add_option("--max-bytes", max_bytes, "largest size");
  app.add_option("--factor", factor, "size step")->check(CLI::Range(2, 1024));
  app.add_option("--reps", reps, "repetitions per size (median shown)")->check(CLI::PositiveNumber);
  app.add_option("--slot-bytes", slot_bytes, "segment slot bytes (SegmentSizes::slot_bytes)");
  CLI11_PARSE(app, argc, argv);

  const auto sizes = sizes_of(min_bytes, max_bytes, factor);
  std::vector<double> bound;
  for (size_t bytes : sizes) bound.push_back(shoal::bench::memory_bound_seconds(bytes));
  double load[3] = {0, 0, 0};
  if (FILE* f = std::fopen("/proc/loadavg", "r")) {
    if (std::fscanf(f, "%lf %lf %lf", &load[0], &load[1], &load[2]) != 3) load[0] = -1;
    std::fclose(f);
  }
  std::printf(
      "shm_allreduce: %ld cores, load %.2f %.2f %.2f, float32 sum, slot %zu bytes, median of %d\n",
      sysconf(_SC_NPROCESSORS_ONLN), load[0], load[1], load[2], slot_bytes, reps);
  std::printf("| size | workers | shm, ms | shm bus GB/s | bound, ms | bound GB/s | t/bound |\n");
  std::printf("|---:|---:|---:|---:|---:|---:|---:|\n");
  for (int n : workers) {
    int out[2];
    if (::pipe(out) != 0) return 1;
    try {
      run_job(n, sizes, reps, slot_bytes, out[1]);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "shm_allreduce: %s\n", e.what());
      return 1;
    }
    ::close(out[1]);
    FILE* rows = ::fdopen(out[0], "r");
    size_t bytes = 0;
    double seconds = 0;
    for (size_t i = 0; std::fscanf(rows, "%zu %lf", &bytes, &seconds) == 2; ++i) {
      const double bus = 2.0 * (n - 1) / n * static_cast<double>(bytes) / seconds / 1e9;
      std::printf("| %s | %d | %.3f | %.2f | %.3f | %.2f | %.2f |\n", human(bytes).c_str(), n,
                  seconds * 1e3, bus, bound[i] * 1e3, static_cast<double>(bytes) / bound[i] / 1e9,
                  seconds / bound[i]);
    }
    std::fclose(rows);
  }
  return 0;
}
