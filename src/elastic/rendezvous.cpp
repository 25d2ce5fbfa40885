#include "rendezvous.h"

#include <algorithm>
#include <cstdlib>

#include "shoal/core/error.h"
#include "core/log.h"

namespace shoal::elastic {

std::string View::describe(int rank) const {
  const Peer& peer = members.at(rank);
  return "worker " + std::to_string(rank) + " (pid " + std::to_string(peer.pid) + " on " + peer.host + ")";
}

bool debugging() {
  return log::enabled(log::Level::kDebug);
}

void round_timed_out(int64_t round, Duration waited, const std::string& waiting_for) {
  throw CommError("elastic rendezvous: round " + std::to_string(round) + " did not close after " +
                  format_duration(waited) + "; it was waiting for " + waiting_for);
}

bool has_quorum(const RendezvousOptions& options, const Newest& newest, const std::vector<std::string>& ids) {
  if (!options.quorum || newest.members.empty()) return true;
  size_t present = 0;
  for (const auto& id : newest.members) present += std::count(ids.begin(), ids.end(), id) > 0 ? 1 : 0;
  return present * 2 > newest.members.size();
}

std::vector<std::string> ViewChooser::choose(const std::string& me, int64_t prev_round,
                                             std::vector<Candidate> candidates, const Newest& newest,
                                             std::string& waiting_for) {
  std::sort(candidates.begin(), candidates.end(), [](const Candidate& a, const Candidate& b) {
    if (a.prev_round != b.prev_round) return a.prev_round > b.prev_round;
    if (a.prev_rank != b.prev_rank) return a.prev_rank < b.prev_rank;
    return a.id < b.id;
  });
  std::vector<std::string> ids;
  bool survivors_only = prev_round >= 0;
  for (const auto& c : candidates) {
    ids.push_back(c.id);
    survivors_only = survivors_only && c.prev_round == prev_round;
  }
  std::vector<std::string> sorted = ids;
  std::sort(sorted.begin(), sorted.end());
  std::string key;
  for (const auto& id : sorted) key += id + ",";
  if (key != candidates_) {
    candidates_ = key;
    since_ = std::chrono::steady_clock::now();
  }

  const int n = static_cast<int>(ids.size());
  const bool settled = survivors_only || n >= options_.max_workers ||
                       std::chrono::steady_clock::now() - since_ >= options_.last_call;
  if (n < options_.min_workers) {
    waiting_for = "at least " + std::to_string(options_.min_workers) + " workers (--min); " + std::to_string(n) +
                  " are here";
  } else if (!has_quorum(options_, newest, ids)) {
    waiting_for = "a quorum (--quorum): more than half of the " + std::to_string(newest.members.size()) +
                  " workers of round " + std::to_string(newest.round) + "; " + std::to_string(n) +
                  " workers are here";
  } else if (!settled) {
    waiting_for = "the last call";
  } else {
    if (n > options_.max_workers) ids.resize(options_.max_workers);
    if (std::find(ids.begin(), ids.end(), me) != ids.end()) return ids;
    waiting_for = "room: the job has its --max of " + std::to_string(options_.max_workers) + " workers";
  }
  return {};
}

}  // namespace shoal::elastic
