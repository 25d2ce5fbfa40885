#include "rendezvous.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <utility>

#include <nlohmann/json.hpp>

#include "shoal/core/error.h"
#include "core/log.h"

namespace shoal::elastic::gossip {
namespace {

using Ids = std::vector<std::string>;

// What a worker says about itself in its membership metadata. See Note [Rendezvous rounds].
struct Meta {
  std::string role;  // "worker", or "agent" for a launcher (never in a round)
  std::string host;
  int pid = 0;
  std::string store;
  std::string phase;  // "wait", "ready" (agrees to `view` for `round`), "train" (in `view`)
  int64_t round = 0;
  Ids view;
  int64_t prev_round = -1;  // the last round it trained in, -1 for none
  int prev_rank = -1;
  int64_t committed = 0;  // Note [The job's recorded commits]
};

Meta parse(const std::string& text) {
  Meta meta;
  try {
    auto j = nlohmann::json::parse(text);
    meta.role = j.value("role", "");
    meta.host = j.value("host", "");
    meta.pid = j.value("pid", 0);
    meta.store = j.value("store", "");
    meta.phase = j.value("phase", "");
    meta.round = j.value("round", int64_t{0});
    meta.view = j.value("view", Ids{});
    meta.prev_round = j.value("prev_round", int64_t{-1});
    meta.prev_rank = j.value("prev_rank", -1);
    meta.committed = j.value("committed", int64_t{0});
  } catch (const std::exception&) {
    meta.role.clear();  // not a worker's metadata
  }
  return meta;
}

struct Worker {
  Member member;
  Meta meta;
  bool live() const { return member.status == Status::kAlive || member.status == Status::kSuspect; }
  bool agrees_to(int64_t round) const { return (meta.phase == "ready" || meta.phase == "train") && meta.round == round; }
};

std::vector<Worker> workers_of(const Gossip& gossip) {
  std::vector<Worker> workers;
  for (auto& member : gossip.members()) {
    Meta meta = parse(member.meta);
    if (meta.role == "worker") workers.push_back({std::move(member), std::move(meta)});
  }
  return workers;
}

const Worker* find(const std::vector<Worker>& workers, const std::string& id) {
  for (const auto& w : workers) {
    if (w.member.id == id) return &w;
  }
  return nullptr;
}

bool contains(const Ids& ids, const std::string& id) { return std::find(ids.begin(), ids.end(), id) != ids.end(); }

std::string who(const Worker& w) { return "pid " + std::to_string(w.meta.pid) + " on " + w.meta.host; }

}  // namespace

// Note [Rendezvous rounds]
// Each worker publishes its phase in its gossip metadata. A round r closes in two steps:
//  1. Waiting workers (phase "wait", round r) watch the candidates: the live workers waiting
//     for r. Once no live worker is still behind (training in an older round, or waiting for an
//     older one), the candidates have not changed for the last call (or are exactly the previous
//     round's survivors), they are at least --min and (with --quorum) more than half of the newest
//     round known, a worker proposes them, ordered survivors first (by previous rank), then
//     newcomers (by id), cut at --max: phase "ready" with that view.
//  2. A waiting worker in a proposed view adopts it ("ready" too). A worker closes the round
//     when every member of its view is "ready" or "train" with the same view, and turns "train".
// A worker never changes its "ready" view within a round; it gives the round up (waits for r+1)
// when a member of its view dies or leaves, moves to a later round, or is ready with another
// view (two proposals crossed: nobody can have closed either). Workers not in a closed round
// (too many, or too late) wait for the next one, which the trainers start at a commit
// (pending_change). Ranks are positions in the agreed view, so every member gets the same.

GossipRendezvous::GossipRendezvous(Options membership, Peer self, RendezvousOptions options)
    : membership_options_(std::move(membership)), self_(std::move(self)), options_(options) {
  membership_options_.meta = nlohmann::json{{"role", "worker"}, {"host", self_.host}, {"pid", self_.pid},
                                            {"store", self_.store}, {"phase", "wait"}, {"round", 0}}
                                 .dump();
  gossip_ = Gossip::start(membership_options_);
  self_.id = gossip_->id();
}

GossipRendezvous::~GossipRendezvous() = default;

void GossipRendezvous::publish(const std::string& phase, int64_t round, const std::vector<std::string>& view) {
  if (debugging()) {
    std::string seen;
    for (const auto& w : workers_of(*gossip_)) {
      seen += " [" + std::to_string(w.meta.pid) + " " + to_string(w.member.status) + " " + w.meta.phase + " " +
              std::to_string(w.meta.round) + " view " + std::to_string(w.meta.view.size()) + "]";
    }
    log::debug("shoal elastic debug: pid " + std::to_string(self_.pid) + ": " + phase + " round " +
               std::to_string(round) + ", view of " + std::to_string(view.size()) + "; sees" +
               seen);
  }
  phase_ = phase;
  round_ = round;
  view_ = view;
  gossip_->set_meta(nlohmann::json{{"role", "worker"},
                                   {"host", self_.host},
                                   {"pid", self_.pid},
                                   {"store", self_.store},
                                   {"phase", phase},
                                   {"round", round},
                                   {"view", view},
                                   {"prev_round", prev_round_},
                                   {"prev_rank", prev_rank_},
                                   {"committed", committed_}}
                        .dump());
}

void GossipRendezvous::rejoin_if_declared_dead() {
  if (gossip_->self_status() != Status::kDead) return;
  log::warn("shoal elastic: the job declared this worker (pid " + std::to_string(self_.pid) +
            ") dead after it was silent; it joins again as a new worker");
  gossip_.reset();
  prev_round_ = -1;
  prev_rank_ = -1;
  prev_view_.clear();
  gossip_ = Gossip::start(membership_options_);
  self_.id = gossip_->id();
  rejoined_ = true;
}

View GossipRendezvous::next(const View* previous, Duration timeout) {
  Deadline deadline(timeout);
  if (previous != nullptr) {
    prev_round_ = previous->round;
    prev_rank_ = previous->rank;
    prev_view_.clear();
    for (const auto& p : previous->members) prev_view_.push_back(p.id);
  }
  int64_t round = previous != nullptr ? previous->round + 1 : 1;
  Ids proposal;
  ViewChooser chooser(options_);
  std::string waiting_for = "the other workers";
  rejoin_if_declared_dead();
  publish("wait", round, {});

  auto give_up = [&](int64_t next_round) {
    round = std::max(round + 1, next_round);
    proposal.clear();
    chooser.restart();
    publish("wait", round, {});
  };

  for (;;) {
    if (gossip_->self_status() == Status::kDead) {
      rejoin_if_declared_dead();
      give_up(round);
      continue;
    }
    const uint64_t seen = gossip_->version();
    const auto workers = workers_of(*gossip_);
    const std::string& me = gossip_->id();

    // The newest round anyone here knows of: what --quorum counts a majority of.
    Newest newest{prev_view_.empty() ? -1 : prev_round_, prev_view_};
    for (const auto& w : workers) {
      if (w.meta.phase == "train" && w.meta.round > newest.round) newest = {w.meta.round, w.meta.view};
    }
    auto all_live = [&](const Ids& ids) {
      for (const auto& id : ids) {
        const Worker* w = find(workers, id);
        if (id != me && (w == nullptr || !w->live())) return false;
      }
      return true;
    };

    if (!proposal.empty()) {
      bool agreed = true;
      bool abandon = false;
      int64_t moved_to = round;
      for (const auto& id : proposal) {
        if (id == me) continue;
        const Worker* w = find(workers, id);
        if (w == nullptr || !w->live()) {
          abandon = true;
          break;
        }
        if (w->agrees_to(round)) {
          if (w->meta.view == proposal) continue;
          abandon = true;  // crossed proposals
          break;
        }
        if (w->meta.round > round) {
          abandon = true;
          moved_to = w->meta.round;
          break;
        }
        agreed = false;
        waiting_for = "worker " + who(*w) + " to agree to round " + std::to_string(round);
      }
      if (abandon) {
        give_up(moved_to);
        continue;
      }
      if (agreed) {
        publish("train", round, proposal);
        View view;
        view.round = round;
        for (size_t i = 0; i < proposal.size(); ++i) {
          if (proposal[i] == me) {
            view.rank = static_cast<int>(i);
            view.members.push_back(self_);
            continue;
          }
          const Worker* w = find(workers, proposal[i]);
          view.members.push_back({w->member.id, w->meta.host, w->meta.pid, w->meta.store});
        }
        return view;
      }
    } else {
      // A proposal that includes this worker: agree to it.
      const Worker* offer = nullptr;
      for (const auto& w : workers) {
        if (w.member.id != me && w.live() && w.agrees_to(round) && contains(w.meta.view, me) &&
            all_live(w.meta.view) && has_quorum(options_, newest, w.meta.view)) {
          offer = &w;
          break;
        }
      }
      if (offer != nullptr) {
        proposal = offer->meta.view;
        publish("ready", round, proposal);
        continue;
      }
      // Follow the job to a later round: one that trains already (this worker is new to it),
      // one whose view leaves this worker out, or one others wait for.
      int64_t later = round;
      for (const auto& w : workers) {
        if (w.member.id == me || !w.live()) continue;
        int64_t r = w.meta.phase == "train" ? w.meta.round + 1 : w.meta.round;
        if (w.meta.phase == "ready" && w.meta.round == round && !contains(w.meta.view, me)) r = round + 1;
        later = std::max(later, r);
      }
      if (later > round) {
        round = later;
        chooser.restart();
        publish("wait", round, {});
        continue;
      }
      // Propose, once nobody live is behind and the candidates are settled.
      std::vector<Candidate> candidates{{me, prev_round_, prev_rank_}};
      const Worker* behind = nullptr;
      for (const auto& w : workers) {
        if (w.member.id == me || !w.live()) continue;
        if (w.meta.phase == "wait" && w.meta.round == round) {
          candidates.push_back({w.member.id, w.meta.prev_round, w.meta.prev_rank});
        } else if (w.meta.round < round || w.meta.phase == "train") {
          behind = &w;
        }
      }
      if (behind != nullptr) {
        waiting_for = "worker " + who(*behind) + " to leave round " + std::to_string(behind->meta.round);
      } else {
        Ids ids = chooser.choose(me, prev_round_, std::move(candidates), newest, waiting_for);
        if (!ids.empty()) {
          proposal = ids;
          publish("ready", round, proposal);
          continue;
        }
      }
    }
    if (deadline.expired()) round_timed_out(round, deadline.elapsed(), waiting_for);
    gossip_->wait_change(seen, std::min(Duration(50), std::max(deadline.remaining(), Duration(1))));
  }
}

std::string GossipRendezvous::pending_change(const View& current) {
  if (current.size() >= options_.max_workers) return "";
  for (const auto& w : workers_of(*gossip_)) {
    if (!w.live() || w.meta.phase != "wait") continue;
    bool member = false;
    for (const auto& p : current.members) member = member || p.id == w.member.id;
    if (!member) return "worker " + who(w) + " waits to join";
  }
  return "";
}

std::string GossipRendezvous::lost(const View& current) {
  if (gossip_->self_status() == Status::kDead) {
    return current.describe(current.rank) + " itself, which the job's membership declared dead (it was silent)";
  }
  std::string text;
  const auto members = gossip_->members();
  for (int r = 0; r < current.size(); ++r) {
    if (r == current.rank) continue;
    for (const auto& m : members) {
      if (m.id != current.members[r].id) continue;
      const char* how = m.status == Status::kDead ? "which the job's membership declared dead"
                        : m.status == Status::kLeft ? "which left the job"
                                                    : nullptr;
      if (how != nullptr) text += (text.empty() ? "" : "; ") + current.describe(r) + ", " + how;
    }
  }
  return text;
}

void GossipRendezvous::record_commit(int64_t version) {
  if (version <= committed_) return;
  committed_ = version;
  const std::vector<std::string> view = view_;
  publish(phase_, round_, view);
}

int64_t GossipRendezvous::recorded_commit() {
  int64_t newest = committed_;
  for (const auto& w : workers_of(*gossip_)) newest = std::max(newest, w.meta.committed);
  return newest;
}

bool GossipRendezvous::take_rejoined() { return std::exchange(rejoined_, false); }

void GossipRendezvous::check(const View& current) {
  std::vector<std::string> ids;
  for (int r = 0; r < current.size(); ++r) {
    if (r != current.rank) ids.push_back(current.members[r].id);
  }
  gossip_->probe_now(ids);
}

void GossipRendezvous::leave() { gossip_->leave(); }

}  // namespace shoal::elastic::gossip
