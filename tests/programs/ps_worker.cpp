// A worker of `shoal run --servers S` for tests/ps_rpc_test.cpp and ps_replica_test.cpp: trains a
// dense table and a sparse one on the job's parameter servers in sync mode, routing each chunk and
// row to its server by the shard map, and checks that after every step the servers hold what one
// process applying the mean gradient of all workers' rows would hold (SGD with momentum for the
// dense table, plain SGD for the sparse one). Prints "ps ok" and exits 0, or says what differed
// and exits 1. Options:
//   --hold: prints "ps ready" after connecting and sleeps (the test then kills a server).
//   --steps N: trains N steps (default 4) and prints "ps step T at NS" once step T is checked and
//     pushed (NS: CLOCK_MONOTONIC in ns); --pause-ms P: then sleeps P ms; --wait-after T PATH:
//     after step T, waits until PATH exists. A test kills a server mid-training with these.
//   --dump-dense PATH: worker 0 writes the reference's dense values after the last step to PATH
//     (float32, native order).
//   --rollback PATH: a server restarted from its snapshot is expected; the first step whose values
//     differ from one process is no error: its pulled dense values go to PATH, "ps rolled back at
//     step T" is printed, and the steps after it are trained without checks.
#include <time.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <thread>

#include <torch/torch.h>

#include "ps/connect.h"
#include "ps/shard_map.h"
#include "comm/store.h"

using namespace shoal;
using namespace shoal::ps::detail;

namespace {

constexpr int64_t kDense = 2 * kChunkElements + 1000;  // three chunks, the last one short
constexpr int64_t kDim = 4;

// Worker r's gradient at step t: a function of (r, t) and of the values it pulled, as a real
// gradient is of the parameters; its loss is the mean over r + 1 rows.
torch::Tensor dense_gradient(int r, int t, const torch::Tensor& w) {
  return 0.1 * (r + 1) * w + 0.01 * (t + 1) * torch::arange(kDense, torch::kFloat).sin() - 0.05 * r;
}
std::vector<int64_t> rows_of(int r, int t) { return {r, 10, 1000 + t}; }
torch::Tensor row_gradient(int r, int t, int64_t id) {
  return torch::full({kDim}, 0.25f * (r + 1) - 0.1f * t + 0.001f * static_cast<float>(id)) +
         torch::arange(kDim, torch::kFloat);
}

// Which server holds each chunk of "w" and each row of "emb".
struct Route {
  explicit Route(int servers) : map(servers) {}
  int chunk(int64_t k) const { return map.owner(chunk_shard("w", k)); }
  int row(int64_t id) const { return map.owner(row_shard("emb", id)); }
  ShardMap map;
};

// The dense table's values of `server`'s chunks, in chunk order.
DenseSlice dense_slice(const Route& route, int server, const torch::Tensor& values) {
  DenseSlice slice{0, {}, {}};
  for (int64_t k = 0; k < chunk_count(kDense); ++k) {
    if (route.chunk(k) != server) continue;
    slice.chunks.push_back(k);
    if (values.defined()) {
      const float* p = values.data_ptr<float>() + chunk_begin(k);
      slice.values.insert(slice.values.end(), p, p + chunk_length(kDense, k));
    }
  }
  return slice;
}

}  // namespace

int main(int argc, char** argv) {
  bool hold = false;
  bool step_lines = false;
  int steps = 4;
  int pause_ms = 0;
  std::string dump;  // where worker 0 writes the reference's dense values at the end
  std::string rollback;  // where to write the values of the first step that differs
  bool rolled_back = false;
  int wait_after = -1;    // after pushing this step, wait until wait_file exists
  std::string wait_file;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--hold") == 0) {
      hold = true;
    } else if (std::strcmp(argv[i], "--steps") == 0 && i + 1 < argc) {
      steps = std::atoi(argv[++i]);
      step_lines = true;
    } else if (std::strcmp(argv[i], "--wait-after") == 0 && i + 2 < argc) {
      wait_after = std::atoi(argv[++i]);
      wait_file = argv[++i];
    } else if (std::strcmp(argv[i], "--rollback") == 0 && i + 1 < argc) {
      rollback = argv[++i];
    } else if (std::strcmp(argv[i], "--dump-dense") == 0 && i + 1 < argc) {
      dump = argv[++i];
    } else if (std::strcmp(argv[i], "--pause-ms") == 0 && i + 1 < argc) {
      pause_ms = std::atoi(argv[++i]);
    } else {
      std::cout << "error: unknown argument " << argv[i]
                << "; expected --hold, --steps N, --pause-ms P, --wait-after T PATH, --dump-dense "
                   "PATH or --rollback PATH"
                << std::endl;
      return 2;
    }
  }
  try {
    const env::Environment env = env::current();
    const int rank = static_cast<int>(*env::get_int(env, "SHOAL_RANK"));
    const int world = static_cast<int>(*env::get_int(env, "SHOAL_WORLD_SIZE"));
    comm::StoreOptions options;
    options.host = *env::get(env, "SHOAL_MASTER_ADDR");
    options.port = static_cast<int>(*env::get_int(env, "SHOAL_MASTER_PORT"));
    const comm::StorePtr store = comm::open_store(options);
    const auto servers =
        connect_servers(store, server_count(env), job_token(env), std::chrono::seconds(60));
    if (rank == 0) {  // where the servers run (tests/multihost_test.cpp)
      std::cout << "ps servers at";
      for (const auto& server : servers) std::cout << " " << server->address();
      std::cout << std::endl;
    }
    if (hold) {
      std::cout << "ps ready" << std::endl;
      std::this_thread::sleep_for(std::chrono::seconds(60));
      return 3;
    }
    const Duration timeout = std::chrono::seconds(30);
    const Route route(static_cast<int>(servers.size()));
    TableSpec dense{"w", false, {kDense}, {}, {}, 0};
    dense.optimizer.lr = 0.5;
    dense.optimizer.momentum = 0.9;
    TableSpec sparse{"emb", true, {0, kDim}, {}, {}, 11};
    sparse.optimizer.lr = 0.25;
    sparse.init = {InitSpec::Kind::kNormal, 0, 1};
    const torch::Tensor first = torch::linspace(-1, 1, kDense);
    for (const auto& server : servers) {
      RegisterRequest registration{rank, {dense, sparse}, {}, ""};
      // The first worker creates the tables, with the dense one's first values.
      if (rank == 0) registration.initial = {dense_slice(route, server->index(), first)};
      server->register_tables(registration, timeout);
    }

    // The one-process reference: torch's SGD on the mean of every worker's gradient.
    torch::Tensor w = first.clone().requires_grad_(false);
    torch::optim::SGD reference({w}, torch::optim::SGDOptions(0.5).momentum(0.9));
    std::map<int64_t, torch::Tensor> rows;  // the reference's rows, from their first pull

    for (int t = 0; t <= steps; ++t) {
      // Pull the values of step t: every chunk, and the rows any worker touches in it.
      torch::Tensor pulled = torch::empty({kDense});
      std::vector<int64_t> ids;
      for (int r = 0; r < world; ++r)
        for (int64_t id : rows_of(r, t)) ids.push_back(id);
      std::sort(ids.begin(), ids.end());
      ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
      std::map<int64_t, torch::Tensor> pulled_rows;
      for (const auto& server : servers) {
        PullRequest pull{rank, t, {dense_slice(route, server->index(), {})}, {}};
        SparseSlice want{1, {}, {}};
        for (int64_t id : ids)
          if (route.row(id) == server->index()) want.ids.push_back(id);
        pull.sparse.push_back(want);
        const PullReply reply = server->pull(pull, timeout);
        size_t at = 0;
        for (int64_t k : reply.dense.at(0).chunks) {
          std::copy_n(reply.dense[0].values.begin() + at, chunk_length(kDense, k),
                      pulled.data_ptr<float>() + chunk_begin(k));
          at += chunk_length(kDense, k);
        }
        const SparseSlice& got = reply.sparse.at(0);
        for (size_t i = 0; i < got.ids.size(); ++i)
          pulled_rows[got.ids[i]] = torch::tensor(std::vector<float>(
              got.values.begin() + i * kDim, got.values.begin() + (i + 1) * kDim));
      }
      // The servers hold what the reference holds.
      const double dense_error = ((pulled - w).abs().max() / w.abs().max()).item<double>();
      if (!(dense_error < 1e-5) && !rollback.empty() && !rolled_back) {
        // A server restarted from its snapshot: from here its values are the snapshot's.
        std::ofstream out(rollback, std::ios::binary);
        out.write(reinterpret_cast<const char*>(pulled.data_ptr<float>()),
                  static_cast<std::streamsize>(pulled.numel() * sizeof(float)));
        std::cout << "ps rolled back at step " << t << std::endl;
        rolled_back = true;
      }
      if (rolled_back) {
        w.copy_(pulled);  // no more checks: the reference's optimizer state is not the servers'
      } else if (!(dense_error < 1e-5)) {
        std::cout << "step " << t << ": dense values off by " << dense_error << " (relative)"
                  << std::endl;
        return 1;
      }
      for (const auto& [id, value] : pulled_rows) {
        auto known = rows.find(id);
        if (known == rows.end()) {
          rows[id] = value.clone();  // first seen: its initial value
        } else if (!rolled_back && !torch::allclose(value, known->second, 1e-5, 1e-6)) {
          std::cout << "step " << t << ": row " << id << " is " << value << ", expected "
                    << known->second << std::endl;
          return 1;
        }
      }
      if (t == steps) break;

      // Push this worker's gradient of step t, computed from what it pulled.
      const torch::Tensor g = dense_gradient(rank, t, pulled);
      for (const auto& server : servers) {
        PushRequest push{rank, t, rank + 1, {dense_slice(route, server->index(), g)}, {}};
        SparseSlice grads{1, {}, {}};
        for (int64_t id : rows_of(rank, t)) {
          if (route.row(id) != server->index()) continue;
          grads.ids.push_back(id);
          const torch::Tensor gr = row_gradient(rank, t, id);
          grads.values.insert(grads.values.end(), gr.data_ptr<float>(), gr.data_ptr<float>() + kDim);
        }
        push.sparse.push_back(grads);
        server->push(push, timeout);
      }

      // Pushed: a server killed now has this worker's push of step t (or its snapshot).
      if (step_lines) {
        timespec now{};
        ::clock_gettime(CLOCK_MONOTONIC, &now);
        std::cout << "ps step " << t << " at " << now.tv_sec * 1000000000LL + now.tv_nsec
                  << std::endl;
      }
      if (pause_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(pause_ms));
      if (t == wait_after) {
        const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
        while (::access(wait_file.c_str(), F_OK) != 0) {
          if (std::chrono::steady_clock::now() > until) {
            std::cout << "error: " << wait_file << " did not appear within 60 s" << std::endl;
            return 1;
          }
          std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
      }

      // The reference's step: the rows-weighted mean of every worker's gradient, in worker order.
      double total = 0;
      for (int r = 0; r < world; ++r) total += r + 1;
      torch::Tensor mean = torch::zeros({kDense}, torch::kDouble);
      std::map<int64_t, torch::Tensor> row_mean;
      for (int r = 0; r < world; ++r) {
        const double share = (r + 1) / total;
        mean += share * dense_gradient(r, t, w).to(torch::kDouble);
        for (int64_t id : rows_of(r, t)) {
          auto& m = row_mean[id];
          if (!m.defined()) m = torch::zeros({kDim}, torch::kDouble);
          m += share * row_gradient(r, t, id).to(torch::kDouble);
        }
      }
      w.mutable_grad() = mean.to(torch::kFloat);
      reference.step();
      for (const auto& [id, m] : row_mean) rows[id] -= 0.25 * m.to(torch::kFloat);
    }
    if (!dump.empty() && rank == 0) {
      std::ofstream out(dump, std::ios::binary);
      out.write(reinterpret_cast<const char*>(w.data_ptr<float>()),
                static_cast<std::streamsize>(w.numel() * sizeof(float)));
    }
    std::cout << "ps ok " << servers.size() << " servers, " << steps << " sync steps" << std::endl;
    return 0;
  } catch (const std::exception& e) {
    std::cout << "error: " << e.what() << std::endl;
    return 1;
  }
}
