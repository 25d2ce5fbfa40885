#include "connect.h"

#include <mutex>
#include <thread>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "core/token.h"

namespace shoal::ps::detail {
namespace {

// A client connection to the job's store, opened on first use and shared by the clients.
class LazyStore {
 public:
  LazyStore(std::string host, int port) : host_(std::move(host)), port_(port) {}
  comm::StorePtr get() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!store_) {
      comm::StoreOptions options;
      options.host = host_;
      options.port = port_;
      options.timeout = std::chrono::seconds(10);
      store_ = comm::open_store(options);
    }
    return store_;
  }

 private:
  const std::string host_;
  const int port_;
  std::mutex mutex_;
  comm::StorePtr store_;
};

}  // namespace

std::string server_key(int index) {
  return "ps/server/" + std::to_string(index);
}

std::string backup_key(int index) {
  return server_key(index) + "/backup";
}

std::string lost_primary_key(int index) {
  return server_key(index) + "/lost";
}

std::string job_token(const env::Environment& env) {
  if (auto token = env::get(env, "SHOAL_JOB_TOKEN"); token && !token->empty()) return *token;
  if (auto path = env::get(env, "SHOAL_JOB_TOKEN_FILE"); path && !path->empty()) {
    return read_token_file(*path, "SHOAL_JOB_TOKEN_FILE");
  }
  throw UsageError(
      "the parameter servers need the job's token: set SHOAL_JOB_TOKEN or "
      "SHOAL_JOB_TOKEN_FILE (shoal run --servers does)");
}

int server_count(const env::Environment& env) {
  const auto count = env::get_int(env, "SHOAL_PS_SERVERS", 0, 1 << 16);
  return count ? static_cast<int>(*count) : 0;
}

std::vector<std::unique_ptr<RpcClient>> connect_servers(const comm::StorePtr& store, int count,
                                                        const std::string& token,
                                                        Duration timeout) {
  const Deadline deadline(timeout);
  std::vector<std::unique_ptr<RpcClient>> clients;
  // A server restarted by the launcher publishes its new address under the same key; the clients
  // read it through a connection of their own, opened when first needed, so that they do not
  // keep `store` alive (a store this process hosts must end with its owner).
  std::shared_ptr<LazyStore> resolver_store;
  if (auto* tcp = dynamic_cast<c10d::TCPStore*>(store.get())) {
    resolver_store = std::make_shared<LazyStore>(tcp->getHost(), tcp->getPort());
  }
  for (int i = 0; i < count; ++i) {
    const std::string key = server_key(i);
    std::string address;
    bool primary_lost = false;
    // The store's own wait would block past our deadline on a key that never comes: poll. A
    // primary that died before it published its address is replaced by its backup.
    while ((address = comm::try_get(store, key)).empty()) {
      if (!comm::try_get(store, lost_primary_key(i)).empty() &&
          !(address = comm::try_get(store, backup_key(i))).empty()) {
        primary_lost = true;
        break;
      }
      if (deadline.expired()) {
        throw CommError("parameter server " + std::to_string(i) + " did not publish its address (" +
                        key + " in the job's store) within " + format_duration(timeout) +
                        "; expected " + std::to_string(count) + " servers (SHOAL_PS_SERVERS)");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    // A primary publishes its address after its backup's (docs/ps.md, "Replicas and
    // snapshots"): once server_key(i) is there, so is backup_key(i) if the index has a backup.
    std::vector<std::string> addresses{address};
    if (std::string backup = comm::try_get(store, backup_key(i));
        !primary_lost && !backup.empty()) {
      addresses.push_back(backup);
    }
    clients.push_back(std::make_unique<RpcClient>(i, std::move(addresses), token));
    if (resolver_store)
      clients.back()->set_resolver(
          [resolver_store, key] { return comm::try_get(resolver_store->get(), key); });
  }
  for (auto& client : clients) {
    const int index = client->ping(std::max(deadline.remaining(), Duration(1)));
    if (index != client->index()) {
      throw UsageError("parameter server " + std::to_string(client->index()) + " (" +
                       client->address() + ") answers as server " + std::to_string(index) +
                       "; two jobs share a store?");
    }
  }
  return clients;
}

}  // namespace shoal::ps::detail
