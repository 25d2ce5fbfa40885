// A primary server's handler when its index has a backup (docs/ps.md, "Replicas and snapshots"):
// every Register and Push is applied to the primary's own core, then forwarded to the backup, and
// answered only when both hold it; pulls are the primary's alone. A backup that cannot be reached
// is dropped (one line on stderr) and the primary serves alone from then on.
#pragma once

#include <memory>
#include <mutex>
#include <string>

#include "handler.h"
#include "rpc.h"

namespace shoal::ps::detail {

class ReplicatedHandler : public Handler {
 public:
  // `local`: the primary's core, which outlives this handler. `backup`: a client of the backup.
  ReplicatedHandler(Handler& local, std::unique_ptr<RpcClient> backup);

  void register_tables(const RegisterRequest& request, const Deadline& deadline) override;
  PullReply pull(const PullRequest& request, const Deadline& deadline) override;
  void pull_into(const PullRequest& request, const Deadline& deadline, PullReply& reply,
                 DenseOut& out) override;
  PushReply push(const PushRequest& request, const Deadline& deadline) override;

  // Whether the backup still receives every update.
  bool has_backup() const;

 private:
  std::shared_ptr<RpcClient> backup() const;
  void lose_backup(const std::shared_ptr<RpcClient>& backup, const std::string& why);
  // The time a forward may take: half of what is left of the worker's call, so that a backup
  // that does not answer is dropped and the worker still gets its answer in time.
  static Duration forward_timeout(const Deadline& deadline);

  Handler& local_;
  mutable std::mutex mutex_;
  std::shared_ptr<RpcClient> backup_;  // null once lost
};

}  // namespace shoal::ps::detail
