// The epoch's ledger on the parameter server that keeps it (part of ServerCore, server_core.h,
// which calls it with its lock held; it takes no lock itself): opened by the first lease, and
// told of the batches whose pushes were applied, dropped, or left with a worker that left.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <optional>
#include <set>

#include "ledger.h"
#include "messages.h"

namespace shoal::ps::detail {

struct ServerCoreOptions;
class ServerMembership;

class ServerLeases {
 public:
  ServerLeases(const ServerCoreOptions& options, const ServerMembership& membership);

  // A batch for a live worker (ServerCore::lease); the first lease opens the ledger.
  LeaseReply lease(const LeaseRequest& request);
  // UsageError when the push names a batch not leased to its worker, or one already trained.
  void check_push(const char* what, const PushRequest& push) const;

  bool open() const { return ledger_.has_value(); }
  int64_t epoch() const { return ledger_->epoch(); }  // when open
  // (epoch, batches done, batches out), or nullopt before the first lease.
  std::optional<std::array<int64_t, 3>> counts() const;

  // The batches of applied pushes are done.
  void finish(int32_t worker, const PushRequest& push);
  void finish(const std::map<int32_t, PushRequest>& pushes);
  // A dropped push's batch goes back into the epoch.
  void give_back(int32_t worker, const PushRequest& push);
  // A leaver's batches come back, but for those in `counted` (its pushes still counted).
  void release(int32_t worker, const std::set<int64_t>& counted);

 private:
  const ServerCoreOptions& options_;
  const ServerMembership& membership_;
  std::optional<Ledger> ledger_;
};

}  // namespace shoal::ps::detail
