#include "server_leases.h"

#include "server_core.h"
#include "server_membership.h"
#include "server_text.h"

namespace shoal::ps::detail {

ServerLeases::ServerLeases(const ServerCoreOptions& options, const ServerMembership& membership)
    : options_(options), membership_(membership) {}

LeaseReply ServerLeases::lease(const LeaseRequest& request) {
  const int32_t worker = request.worker;
  const Ledger::Options data{request.dataset_size, request.batch_size, request.drop_last};
  if (options_.snapshot_every > 0)
    bad("lease", "worker " + std::to_string(worker) +
                     " asked for a batch, but this server writes snapshots, which do not hold the "
                     "ledger yet (a restarted server would start the epoch again); expected a job "
                     "without --ps-snapshot-dir to lease batches");
  membership_.check_live("lease", worker);
  if (!ledger_) ledger_.emplace(data);
  const Ledger::Options& kept = ledger_->options();
  if (data.dataset_size != kept.dataset_size || data.batch_size != kept.batch_size ||
      data.drop_last != kept.drop_last) {
    bad("lease", "worker " + std::to_string(worker) + " names a data set of " +
                     std::to_string(data.dataset_size) + " samples in batches of " +
                     std::to_string(data.batch_size) + (data.drop_last ? " (drop_last)" : "") +
                     "; expected the ledger's " + std::to_string(kept.dataset_size) +
                     " in batches of " + std::to_string(kept.batch_size) +
                     (kept.drop_last ? " (drop_last)" : ""));
  }
  const Ledger::Lease lease = ledger_->lease(worker, request.epoch);
  return {static_cast<LeaseReply::Kind>(lease.kind), lease.epoch, lease.batch, lease.begin,
          lease.end};
}

void ServerLeases::check_push(const char* what, const PushRequest& push) const {
  const int32_t w = push.worker;
  if (ledger_ && push.batch >= 0 && !ledger_->is_out(w, push.epoch, push.batch))
    bad(what, "worker " + std::to_string(w) + " pushed the gradient of batch " +
                  std::to_string(push.batch) + " of epoch " + std::to_string(push.epoch) +
                  "; expected a batch leased to it and not yet trained");
}

std::optional<std::array<int64_t, 3>> ServerLeases::counts() const {
  if (!ledger_) return std::nullopt;
  return std::array<int64_t, 3>{ledger_->epoch(), ledger_->done_count(), ledger_->out_count()};
}

void ServerLeases::finish(int32_t worker, const PushRequest& push) {
  if (ledger_ && push.batch >= 0) ledger_->done(worker, push.epoch, push.batch);
}

void ServerLeases::finish(const std::map<int32_t, PushRequest>& pushes) {
  for (const auto& [worker, push] : pushes) finish(worker, push);
}

void ServerLeases::give_back(int32_t worker, const PushRequest& push) {
  if (ledger_ && push.batch >= 0) ledger_->give_back(worker, push.epoch, push.batch);
}

void ServerLeases::release(int32_t worker, const std::set<int64_t>& counted) {
  if (ledger_) ledger_->release(worker, counted);
}

}  // namespace shoal::ps::detail
