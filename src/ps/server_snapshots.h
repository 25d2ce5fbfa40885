// A parameter server's snapshots (part of ServerCore, server_core.h, which calls it with its lock
// held; it takes no lock itself): its shards as bytes and back, a snapshot every snapshot_every
// steps, and a restarted server's reload from one, after which it adopts the workers' clocks
// (Note [Clocks after a reload]).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>

namespace shoal::ps::detail {

struct ServerCoreOptions;
class ServerMembership;
class ServerRegistry;

class ServerSnapshots {
 public:
  ServerSnapshots(const ServerCoreOptions& options, ServerRegistry& registry,
                  ServerMembership& membership);

  // One held shard as bytes, and back (ServerCore::save_shard and load_shard).
  std::string save_shard(int32_t shard) const;
  void load_shard(int32_t shard, const std::string& bytes);
  // A snapshot, when `step` is due one (see ServerCoreOptions::snapshot_every).
  void take_when_due(int64_t step);

  // Once the first registration has created the tables: loads the snapshot options.restore
  // answers, if any, and starts adopting the workers' clocks.
  void restore();
  // Note [Clocks after a reload]: takes worker w's clock from its first request after a reload;
  // once every live worker's is known, returns the lowest of them (the adopted step).
  std::optional<int64_t> adopt(int32_t w, int64_t clock);
  bool adopting() const { return adopting_; }  // the workers' clocks are not all known yet
  int64_t restored_step() const { return restored_step_; }
  // Whether worker w's push of step `clock` was lost with the server that died.
  bool lost_push(int32_t w, int64_t clock) const {
    auto it = adopted_.find(w);
    return it != adopted_.end() && clock < it->second;
  }

 private:
  const ServerCoreOptions& options_;
  ServerRegistry& registry_;
  ServerMembership& membership_;
  bool adopting_ = false;               // reloaded: the workers' clocks are not all known yet
  int64_t restored_step_ = -1;          // the snapshot's step
  std::map<int32_t, int64_t> adopted_;  // per worker: the clock it showed first after a reload
};

}  // namespace shoal::ps::detail
