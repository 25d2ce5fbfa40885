// All-reduce bus bandwidth: shoal's Group::all_reduce beside c10d's ProcessGroupGloo called
// directly, in the same processes, over the same store, with the same device and threads.
//
//   shoal run -n N [--no-tag-output] allreduce [--min-bytes B] [--max-bytes B] [--factor F]
//                                [--reps R] [--bound-gbit G [--hosts H]] [--sliced [--slice-ms M]]
//                                [--split K] [--in-place] [--raw FILE]
//
// Sizes go from --min-bytes to --max-bytes of float32, multiplied by --factor each step. For each
// size the contenders take turns within each repetition, in column order on even repetitions and
// in reverse on odd ones, so that noise from the rest of the machine falls on all alike. A
// repetition's time is the slowest worker's; the table shows the median over --reps repetitions,
// and shoal/raw is the median of the repetitions' ratios raw time / shoal time (above 1: shoal was
// faster). Bus bandwidth = 2(N-1)/N * S / t, the bytes each worker's busiest link carries in a
// ring. With --bound-gbit G (a shaped link of G Gbit/s), the table adds the link's bound time
// 2(N-1)/N * S / B and the fraction of it achieved; with --hosts H > 1 (several workers per
// host), the bound of any all-reduce among H hosts, 2(H-1)/H * S / B: a flat ring over all
// workers crosses the link more often than that, a hierarchical all-reduce can reach it.
// With --sliced, two more columns time raw gloo waited on as shoal's Work::wait does (see the
// contenders "sliced" and "probed" below), to tell what in shoal's wrapper costs what; the
// slices last --slice-ms (default 250, as shoal's).
// With --split K, a column times raw gloo on the tensor cut into K parts all-reduced at once
// (the group's 2 threads run two at a time): what splitting large tensors could gain.
// With --in-place, a column times shoal on a part of one tensor of Group::empty_shared
// (docs/comm.md, "Shared buffers"), as DataParallel's buckets are, and the last column is raw
// gloo's time over it. With --raw FILE, the main worker appends every repetition's times to FILE,
// one line per size and repetition (the slowest worker's time per operation of each contender, and
// the order they ran in), from which the table's medians and ratios can be recomputed.

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/torch.h>

#include "job_store.h"
#include "memory_bound.h"
#include "shoal/shoal.h"

namespace {

using Clock = std::chrono::steady_clock;

struct BenchOptions {
  int64_t min_bytes = 4 << 10;
  int64_t max_bytes = 64 << 20;
  int factor = 4;
  int reps = 9;
  double bound_gbit = 0;  // 0: no shaped link to compare with
  int hosts = 1;          // hosts the workers are on (for the link's bound)
  bool sliced = false;
  int slice_ms = 250;  // shoal's kLivenessPeriod (src/comm/work.cpp)
  int split = 0;  // 0: no "split" column
  bool in_place = false;  // an "in place" column: shoal on a tensor of Group::empty_shared
  std::string raw;  // where to append the raw lines; empty: nowhere
};

// The flags, each checked by its validator; --max-bytes against --min-bytes in the final callback.
void add_flags(CLI::App& app, BenchOptions& o) {
  constexpr int64_t kMaxBytes = int64_t{1} << 40;
  app.add_option("--min-bytes", o.min_bytes, "Smallest size, in bytes (default 4096)")
      ->check(CLI::Range(int64_t{4}, kMaxBytes));
  app.add_option("--max-bytes", o.max_bytes, "Largest size, in bytes (default 64 MiB)")
      ->check(CLI::Range(int64_t{4}, kMaxBytes));
  app.add_option("--factor", o.factor, "Size step (default 4)")->check(CLI::Range(2, 1024));
  app.add_option("--reps", o.reps, "Repetitions per size (default 9)")->check(CLI::PositiveNumber);
  app.add_option("--bound-gbit", o.bound_gbit, "The shaped link's rate, Gbit/s (default: none)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--hosts", o.hosts, "Hosts the workers are on, for the link's bound (default 1)")
      ->check(CLI::PositiveNumber);
  app.add_flag("--sliced", o.sliced, "Also time raw gloo waited on as shoal's Work::wait does");
  app.add_option("--slice-ms", o.slice_ms, "Those waits' slices, ms (default 250)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--split", o.split, "Also time raw gloo on the tensor cut into K parts")
      ->check(CLI::NonNegativeNumber);
  app.add_flag("--in-place", o.in_place, "Also time shoal on a tensor of Group::empty_shared");
  app.add_option("--raw", o.raw, "Append every repetition's times to this file");
  app.callback([&o] {
    if (o.max_bytes < o.min_bytes) {
      throw CLI::ValidationError("--max-bytes", "expected at least --min-bytes " +
                                                    std::to_string(o.min_bytes) + ", got " +
                                                    std::to_string(o.max_bytes));
    }
  });
}

c10::intrusive_ptr<c10d::ProcessGroupGloo> make_raw_group(const shoal::comm::StorePtr& store,
                                                          const std::string& bind_address) {
  const auto& job = shoal::job();
  auto options = c10d::ProcessGroupGloo::Options::create(std::chrono::seconds(120));
  options->threads = 2;  // shoal's GroupOptions::threads default
  options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(bind_address));
  auto scoped = c10::make_intrusive<c10d::PrefixStore>("bench/raw_gloo", store);
  return c10::make_intrusive<c10d::ProcessGroupGloo>(scoped, job.rank, job.world_size, options);
}

// Enough iterations per timed batch that small sizes are not all clock and barrier noise.
int iterations_for(int64_t bytes) {
  return static_cast<int>(std::clamp<int64_t>((8 << 20) / bytes, 1, 32));
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2;
}

std::string format_size(int64_t bytes) {
  if (bytes >= (1 << 20)) return std::to_string(bytes >> 20) + " MiB";
  if (bytes >= (1 << 10)) return std::to_string(bytes >> 10) + " KiB";
  return std::to_string(bytes) + " B";
}

struct Contender {
  const char* name;
  std::function<void(at::Tensor&)> all_reduce;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "All-reduce bus bandwidth: shoal's Group::all_reduce beside c10d's ProcessGroupGloo"};
  BenchOptions options;
  add_flags(app, options);
  CLI11_PARSE(app, argc, argv);
  shoal::init();
  auto& world = shoal::world();
  const int n = world.size();
  if (n < 2) {
    std::fprintf(stderr, "allreduce: run under `shoal run -n N` with N >= 2\n");
    return 2;
  }
  const auto& job = shoal::job();
  // Where shoal::init() binds its own group: the raw group must use the same interface to be a
  // fair reference.
  const std::string bind_address = shoal::comm::local_address_towards(job.master_addr, job.master_port);
  auto store = open_job_store();
  auto raw = make_raw_group(store, bind_address);
  // Synchronises the start of each timed batch; its own time is not measured.
  auto barrier = [&] { raw->barrier()->wait(std::chrono::seconds(120)); };

  std::vector<Contender> contenders{
      {"shoal", [&](at::Tensor& t) { world.all_reduce(t); }},
      {"raw gloo",
       [&](at::Tensor& t) {
         std::vector<at::Tensor> tensors{t};
         // The plain wait is the reference; the group's own 120 s timeout still bounds it.
         raw->allreduce(tensors)->wait();
       }},
  };
  int late_completions = 0;  // see sliced_wait
  if (options.sliced) {
    // Raw gloo waited on the way shoal's Work::wait waits (src/comm/work.cpp), to take shoal's
    // cost apart: "sliced" waits in 250 ms slices, each expired slice costing c10d's timeout
    // exception; "probed" also reads, after each expired slice, every other member's exit key
    // from the job's store, as shoal's liveness check does.
    auto sliced_wait = [&](at::Tensor& t, bool probe) {
      std::vector<at::Tensor> tensors{t};
      auto work = raw->allreduce(tensors);
      for (;;) {
        try {
          work->wait(std::chrono::milliseconds(options.slice_ms));
          return;
        } catch (const std::exception&) {
          // A slice can run out just before the operation completes, and building c10d's
          // timeout error (it captures a backtrace) takes long enough for the completion to
          // land before isCompleted() is asked: only a failed operation is a failure.
          if (work->isCompleted()) {
            if (work->isSuccess()) {
              ++late_completions;
              return;
            }
            throw;
          }
        }
        if (!probe) continue;
        for (int member = 0; member < n; ++member) {
          if (member != job.rank) (void)shoal::comm::try_get(store, shoal::comm::worker_exit_key(member));
        }
      }
    };
    // By value: sliced_wait ends with this block.
    contenders.push_back({"sliced", [sliced_wait](at::Tensor& t) { sliced_wait(t, false); }});
    contenders.push_back({"probed", [sliced_wait](at::Tensor& t) { sliced_wait(t, true); }});
  }
  if (options.split > 1) {
    contenders.push_back({"split", [&](at::Tensor& t) {
                            std::vector<c10::intrusive_ptr<c10d::Work>> works;
                            for (auto& part : t.chunk(options.split)) {
                              std::vector<at::Tensor> tensors{part};
                              works.push_back(raw->allreduce(tensors));
                            }
                            for (auto& work : works) work->wait();
                          }});
  }
  // shoal on the same sizes, in one tensor of Group::empty_shared made for the largest: on the
  // shared-memory path an all-reduce there reads and writes every member's memory in place
  // (docs/comm.md, "Shared buffers"). Only the correctness check below copies in and out.
  at::Tensor arena;
  bool checking = true;
  if (options.in_place) {
    arena = world.empty_shared(options.max_bytes / 4, torch::kFloat32).zero_();
    contenders.push_back({"in place", [&](at::Tensor& t) {
                            auto part = arena.narrow(0, 0, t.numel());
                            if (checking) part.copy_(t);
                            world.all_reduce(part);
                            if (checking) t.copy_(part);
                          }});
  }
  const int kinds = static_cast<int>(contenders.size());

  // Both implementations must compute the same sum before their speed means anything.
  for (auto& contender : contenders) {
    auto ones = torch::ones({std::min<int64_t>(1000, options.max_bytes / 4)});
    contender.all_reduce(ones);
    if (!ones.eq(static_cast<float>(n)).all().item<bool>()) {
      std::fprintf(stderr, "allreduce: %s computed a wrong sum\n", contender.name);
      return 1;
    }
  }
  checking = false;
  if (options.in_place) arena.zero_();

  const bool main_worker = shoal::is_main();
  std::FILE* raw_lines = nullptr;
  if (main_worker && !options.raw.empty()) {
    raw_lines = std::fopen(options.raw.c_str(), "a");
    if (!raw_lines) {
      std::fprintf(stderr, "allreduce: --raw %s: cannot open for appending: %s\n",
                   options.raw.c_str(), std::strerror(errno));
      return 2;
    }
  }
  const double bus_factor = 2.0 * (n - 1) / n;
  const double link_bytes_per_s = options.bound_gbit * 1e9 / 8;
  // What the link between hosts must carry each way at least: with H hosts, 2(H-1)/H of the
  // tensor (a reduce-scatter and an all-gather among the hosts); one worker per host, the ring's.
  const int hosts = std::max(options.hosts, 1);
  const double link_factor = hosts > 1 ? 2.0 * (hosts - 1) / hosts : bus_factor;
  if (main_worker) {
    std::printf("# all_reduce float32, %d workers on %d host(s), shoal's path: %s, bind %s, %d "
                "repetitions per size (median), contenders alternate\n",
                n, hosts, world.path().c_str(), bind_address.c_str(), options.reps);
    std::printf(
        "| size | shoal ms | raw ms |%s%s%s shoal GB/s | raw GB/s | shoal/raw |%s%s\n",
        options.sliced ? " sliced ms | probed ms |" : "",
        options.split > 1 ? (" split " + std::to_string(options.split) + " ms |").c_str() : "",
        options.in_place ? " in place ms |" : "",
        link_bytes_per_s > 0 ? " bound ms | shoal/bound | raw/bound |"
                             : " memory bound ms | shoal/memory bound |",
        options.in_place ? " in place/raw |" : "");
    std::printf("|---:|---:|---:|%s%s%s---:|---:|---:|%s%s\n", options.sliced ? "---:|---:|" : "",
                options.split > 1 ? "---:|" : "", options.in_place ? "---:|" : "",
                link_bytes_per_s > 0 ? "---:|---:|---:|" : "---:|---:|",
                options.in_place ? "---:|" : "");
    std::fflush(stdout);
  }

  for (int64_t bytes = options.min_bytes; bytes <= options.max_bytes; bytes *= options.factor) {
    // Zeros stay zeros under a sum, so repeated reductions never overflow into inf/NaN, whose
    // arithmetic could be slower than ordinary floats'.
    auto tensor = torch::zeros({bytes / 4});
    const int iterations = iterations_for(bytes);
    for (auto& contender : contenders) contender.all_reduce(tensor);  // warm up: buffers, pairs

    // seconds[k * reps + r]: contender k's time per operation in repetition r, on this worker.
    auto seconds = torch::zeros({kinds * options.reps}, torch::kFloat64);
    auto* out = seconds.data_ptr<double>();
    for (int r = 0; r < options.reps; ++r) {
      for (int j = 0; j < kinds; ++j) {
        const int k = (r % 2 == 0) ? j : kinds - 1 - j;
        barrier();
        const auto start = Clock::now();
        for (int i = 0; i < iterations; ++i) contenders[k].all_reduce(tensor);
        out[k * options.reps + r] =
            std::chrono::duration<double>(Clock::now() - start).count() / iterations;
      }
    }
    // A collective is as slow as its slowest member.
    std::vector<at::Tensor> slowest{seconds};
    c10d::AllreduceOptions max;
    max.reduceOp = c10d::ReduceOp::MAX;
    raw->allreduce(slowest, max)->wait(std::chrono::seconds(120));

    if (!main_worker) continue;
    for (int r = 0; raw_lines && r < options.reps; ++r) {
      std::fprintf(raw_lines, "allreduce workers=%d bytes=%lld rep=%d order=%s", n,
                   static_cast<long long>(bytes), r, r % 2 == 0 ? "forward" : "reverse");
      for (int k = 0; k < kinds; ++k) {
        std::string key = contenders[k].name;  // "raw gloo" -> raw_gloo_ms: one key=value token
        std::replace(key.begin(), key.end(), ' ', '_');
        std::fprintf(raw_lines, " %s_ms=%.4f", key.c_str(), out[k * options.reps + r] * 1e3);
      }
      std::fprintf(raw_lines, "\n");
    }
    if (raw_lines) std::fflush(raw_lines);
    std::vector<double> t(kinds);
    for (int k = 0; k < kinds; ++k) {
      t[k] = median(std::vector<double>(out + k * options.reps, out + (k + 1) * options.reps));
    }
    auto bus_gbps = [&](double s) { return bus_factor * bytes / s / 1e9; };
    std::printf("| %s | %.3f | %.3f |", format_size(bytes).c_str(), t[0] * 1e3, t[1] * 1e3);
    if (options.sliced) std::printf(" %.3f | %.3f |", t[2] * 1e3, t[3] * 1e3);
    if (options.split > 1) std::printf(" %.3f |", t[options.sliced ? 4 : 2] * 1e3);
    if (options.in_place) std::printf(" %.3f |", t[kinds - 1] * 1e3);
    // The ratio pairs each repetition's two measurements, taken back to back, before the median:
    // noise that comes and goes over seconds then cancels out instead of landing on one side.
    std::vector<double> ratios(options.reps);
    for (int r = 0; r < options.reps; ++r) ratios[r] = out[options.reps + r] / out[r];
    std::printf(" %.3f | %.3f | %.3f |", bus_gbps(t[0]), bus_gbps(t[1]), median(ratios));
    if (link_bytes_per_s > 0) {
      const double bound = link_factor * bytes / link_bytes_per_s;
      std::printf(" %.3f | %.1f%% | %.1f%% |", bound * 1e3, 100 * bound / t[0], 100 * bound / t[1]);
    } else {
      // On one host: the memory-bandwidth bound (memory_bound.h), measured here while the other
      // workers wait; shoal's time over it (the target: within 3x at 16 MiB).
      const double bound = shoal::bench::memory_bound_seconds(bytes);
      std::printf(" %.3f | %.2fx |", bound * 1e3, t[0] / bound);
    }
    if (options.in_place) {
      for (int r = 0; r < options.reps; ++r)
        ratios[r] = out[options.reps + r] / out[(kinds - 1) * options.reps + r];
      std::printf(" %.3f |", median(ratios));
    }
    std::printf("\n");
    std::fflush(stdout);
  }
  if (options.sliced) {
    std::printf("# worker %d: %d sliced waits saw their operation complete while c10d built the "
                "slice's timeout error\n", job.rank, late_completions);
  }
  if (raw_lines) std::fclose(raw_lines);
  barrier();
  return 0;
}
