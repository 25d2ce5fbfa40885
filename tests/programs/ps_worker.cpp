// A worker of `shoal run --servers S` for tests/ps_rpc_test.cpp: connects to every server through
// the job's store, registers a dense and a sparse table on each, pushes values that are a
// function of (rank, server), waits until every worker's push has arrived, pulls, and checks
// that each server holds exactly the sum over the workers. Prints "ps ok" and exits 0, or says
// what differed and exits 1. With --hold it prints "ps ready" after connecting and sleeps (the
// test then kills a server).
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <iostream>
#include <thread>

#include "ps/connect.h"
#include "shoal/comm/store.h"

using namespace shoal;
using namespace shoal::ps::detail;

namespace {

constexpr int64_t kDense = 3000;  // three chunks of the server's 1024
constexpr int64_t kDim = 4;

float dense_value(int rank, int server, int64_t i) {
  return 0.25f * (rank + 1) + server + 0.001f * i;
}
float row_value(int rank, int server, int64_t id, int64_t j) {
  return 0.5f * (rank + 1) - server + 0.01f * (id * kDim + j);
}

}  // namespace

int main(int argc, char** argv) {
  const bool hold = argc > 1 && std::strcmp(argv[1], "--hold") == 0;
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
    if (hold) {
      std::cout << "ps ready" << std::endl;
      std::this_thread::sleep_for(std::chrono::seconds(60));
      return 3;
    }
    const Duration timeout = std::chrono::seconds(30);
    RegisterRequest registration;
    registration.worker = rank;
    registration.tables = {TableSpec{"w", false, {kDense}, {}, {}, 0},
                           TableSpec{"emb", true, {0, kDim}, {}, {}, 0}};
    // Every worker pushes to rows {rank, 10}: row 10 is shared, the others are the worker's own.
    const std::vector<int64_t> ids{rank, 10};
    for (const auto& server : servers) {
      const int s = server->index();
      server->register_tables(registration, timeout);
      PushRequest push;
      push.worker = rank;
      push.rows = 1;
      DenseSlice dense{0, {0, 1, 2}, {}};
      for (int64_t i = 0; i < kDense; ++i) dense.values.push_back(dense_value(rank, s, i));
      SparseSlice sparse{1, ids, {}};
      for (int64_t id : ids)
        for (int64_t j = 0; j < kDim; ++j) sparse.values.push_back(row_value(rank, s, id, j));
      push.dense.push_back(dense);
      push.sparse.push_back(sparse);
      server->push(push, timeout);
    }
    for (const auto& server : servers) {
      const int s = server->index();
      PullRequest pull;
      pull.worker = rank;
      pull.dense.push_back(DenseSlice{0, {0, 1, 2}, {}});
      std::vector<int64_t> all_ids;
      for (int r = 0; r < world; ++r) all_ids.push_back(r);
      all_ids.push_back(10);
      pull.sparse.push_back(SparseSlice{1, all_ids, {}});
      PullReply reply;
      const Deadline deadline(timeout);
      // The store-and-sum handler's clock counts pushes: all workers' are in at `world`.
      while ((reply = server->pull(pull, timeout)).clock < world) {
        if (deadline.expired())
          throw CommError("server " + std::to_string(s) + " saw " + std::to_string(reply.clock) +
                          " pushes");
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
      for (int64_t i = 0; i < kDense; ++i) {
        float sum = 0;
        for (int r = 0; r < world; ++r) sum += dense_value(r, s, i);
        if (reply.dense.at(0).values.at(i) != sum) {
          std::cout << "server " << s << " dense[" << i << "] = " << reply.dense[0].values[i]
                    << ", expected " << sum << std::endl;
          return 1;
        }
      }
      const auto& rows = reply.sparse.at(0).values;
      for (size_t k = 0; k < all_ids.size(); ++k) {
        for (int64_t j = 0; j < kDim; ++j) {
          const int64_t id = all_ids[k];
          float sum = 0;
          for (int r = 0; r < world; ++r)
            if (id == r || id == 10) sum += row_value(r, s, id, j);
          if (rows.at(k * kDim + j) != sum) {
            std::cout << "server " << s << " row " << id << "[" << j << "] = " << rows[k * kDim + j]
                      << ", expected " << sum << std::endl;
            return 1;
          }
        }
      }
    }
    std::cout << "ps ok " << servers.size() << " servers" << std::endl;
    return 0;
  } catch (const std::exception& e) {
    std::cout << "error: " << e.what() << std::endl;
    return 1;
  }
}
