#include "replica.h"
#include "core/log.h"

#include <iostream>

namespace shoal::ps::detail {

ReplicatedHandler::ReplicatedHandler(Handler& local, std::unique_ptr<RpcClient> backup)
    : local_(local), backup_(std::move(backup)) {}

bool ReplicatedHandler::has_backup() const {
  return backup() != nullptr;
}

std::shared_ptr<RpcClient> ReplicatedHandler::backup() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return backup_;
}

void ReplicatedHandler::lose_backup(const std::shared_ptr<RpcClient>& backup,
                                    const std::string& why) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (backup_ != backup) return;  // another call lost it first
  backup_.reset();
  log::warn("lost the backup of parameter server " + std::to_string(backup->index()) + " (" +
            backup->address() + "); serving alone: " + why);
}

Duration ReplicatedHandler::forward_timeout(const Deadline& deadline) {
  return std::max(deadline.remaining() / 2, Duration(1));
}

// Note [Apply, then forward]: the primary applies an update before forwarding it, so that a
// request the core refuses (UsageError) is never forwarded, and forwards before answering, so
// that an acknowledged update is held by both. If the primary dies between the two, the worker
// had no answer and retries on the backup, which either lacks the update (and applies it) or
// holds it already (and answers as before, Note [Retried pushes] in server_core.h). A backup
// that refuses what the primary accepted would hold other values than the primary: that is a
// broken invariant, and the backup is dropped rather than trusted.
void ReplicatedHandler::register_tables(const RegisterRequest& request, const Deadline& deadline) {
  local_.register_tables(request, deadline);
  if (auto peer = backup()) {
    try {
      peer->register_tables(request, forward_timeout(deadline));
    } catch (const Error& e) {
      lose_backup(peer, e.what());
    }
  }
}

PullReply ReplicatedHandler::pull(const PullRequest& request, const Deadline& deadline) {
  return local_.pull(request, deadline);
}

void ReplicatedHandler::pull_into(const PullRequest& request, const Deadline& deadline,
                                  PullReply& reply, DenseOut& out) {
  local_.pull_into(request, deadline, reply, out);
}

PushReply ReplicatedHandler::push(const PushRequest& request, const Deadline& deadline) {
  const PushReply reply = local_.push(request, deadline);
  if (auto peer = backup()) {
    try {
      if (!reply.counted && request.verdict == PushRequest::Verdict::kDecide) {
        // Note [Server 0 decides] (server_steps.cpp): the backup drops what the primary dropped.
        PushRequest dropped{request.worker, request.clock, request.rows, {}, {},
                            request.epoch,  request.batch, PushRequest::Verdict::kDropped};
        peer->push(dropped, forward_timeout(deadline));
      } else {
        peer->push(request, forward_timeout(deadline));
      }
    } catch (const Error& e) {
      lose_backup(peer, e.what());
    }
  }
  return reply;
}

}  // namespace shoal::ps::detail
