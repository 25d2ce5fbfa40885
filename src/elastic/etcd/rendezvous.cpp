#include "rendezvous.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <optional>
#include <random>
#include <thread>
#include <utility>

#include <nlohmann/json.hpp>

#include "probe.h"
#include "session.h"
#include "shoal/core/error.h"
#include "core/log.h"

namespace shoal::elastic::etcd {

// Note [Rounds in etcd]
// Keys, under the job's prefix:
//   workers/<id>  this worker's JSON: host, pid, store, phase ("wait" for `round`, or "train"
//                 in `round`), round, prev_round and prev_rank (its last round and rank there).
//                 Under its lease: it goes when the worker leaves, dies or stops for a TTL.
//   rounds/<r>    a closed round: its members in rank order (id, host, pid, store). No lease: a
//                 closed round stays closed. The proposer of round r deletes those before r-1.
//   commits/<id>  the newest commit this worker recorded (Note [The job's recorded commits] in
//                 ../rendezvous.h). No lease: it outlives the worker, so that a newcomer finds
//                 the job's history when every worker holding it is gone.
// A round r closes in one step, where gossip needs two (propose, then agree):
//  1. Waiting workers read the candidates, the workers waiting for r, from their copy of the
//     keys. Once no worker is behind (training an older round, or waiting for one) and it is
//     time (Note [Choosing a round's view] in ../rendezvous.h), a worker in the view proposes
//     it: a transaction creates rounds/<r> if it does not exist yet.
//  2. The first transaction wins; whoever sees rounds/<r> (from the watch, which delivers it
//     after every key written before it, so the members' keys are there too) closes the round
//     with it if it is in it, and otherwise waits for r+1.
// A worker also moves on to R+1 when it sees rounds/<R> for a later round, or a worker training
// in R. It never checks that the view's members are still there when it closes: all members of
// a round close it alike, and one that died makes the group's connection fail (lost() names it),
// after which the survivors form r+1 together, as survivors, without waiting for the last call.
// A worker whose key etcd dropped (its lease expired while it was stopped, or check() found its
// store closed) registers again under a new id and lease, as a newcomer.

namespace {

using Ids = std::vector<std::string>;
using Json = nlohmann::json;

// What a worker says about itself in its key. See Note [Rounds in etcd].
struct Meta {
  std::string host;
  int pid = 0;
  std::string store;
  std::string phase;
  int64_t round = 0;
  int64_t prev_round = -1;
  int prev_rank = -1;
};

Json to_json(const Peer& peer) {
  return {{"id", peer.id}, {"host", peer.host}, {"pid", peer.pid}, {"store", peer.store}};
}

std::string round_name(int64_t round) {
  char text[32];
  std::snprintf(text, sizeof(text), "rounds/%020" PRId64, round);  // sorts as numbers do
  return text;
}

bool contains(const std::vector<Peer>& peers, const std::string& id) {
  return std::any_of(peers.begin(), peers.end(), [&](const Peer& p) { return p.id == id; });
}

std::string who(const Meta& w) { return "pid " + std::to_string(w.pid) + " on " + w.host; }

std::string new_id(const Peer& self) {
  static std::mt19937_64 random{std::random_device()()};
  char suffix[20];
  std::snprintf(suffix, sizeof(suffix), "%016" PRIx64, random());
  return self.host + "-" + std::to_string(self.pid) + "-" + suffix;
}

}  // namespace

struct EtcdRendezvous::Table {
  std::map<std::string, Meta> workers;          // by id
  std::map<int64_t, std::vector<Peer>> rounds;  // closed rounds, members in rank order
};

EtcdRendezvous::EtcdRendezvous(EtcdOptions options, Peer self, RendezvousOptions rendezvous)
    : options_(std::move(options)), rendezvous_(rendezvous), self_(std::move(self)) {
  if (options_.prefix.empty()) throw UsageError("elastic rendezvous: the etcd prefix is empty; give the job one of its own");
  self_.id = new_id(self_);
  session_ = std::make_shared<Session>(options_, options_.prefix + "workers/" + self_.id,
                                       Json{{"host", self_.host}, {"pid", self_.pid}, {"store", self_.store},
                                            {"phase", "wait"}, {"round", 0}}
                                           .dump());
}

EtcdRendezvous::~EtcdRendezvous() = default;

std::string EtcdRendezvous::id() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return self_.id;
}

std::shared_ptr<Session> EtcdRendezvous::session() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return session_;
}

std::shared_ptr<const EtcdRendezvous::Table> EtcdRendezvous::table() const {
  std::unique_lock<std::mutex> lock(mutex_);
  const auto session = session_;
  const uint64_t generation = generation_;
  lock.unlock();
  // Read the version first: the keys read after it are at least as new.
  const uint64_t version = session->version();
  lock.lock();
  if (table_ != nullptr && table_generation_ == generation && table_version_ == version) return table_;
  lock.unlock();

  auto table = std::make_shared<Table>();
  const std::string workers = options_.prefix + "workers/";
  const std::string rounds = options_.prefix + "rounds/";
  const auto keys = session->keys();  // held: the thread may replace it meanwhile
  for (const auto& [key, value] : *keys) {
    try {
      const Json j = Json::parse(value);
      if (key.compare(0, workers.size(), workers) == 0) {
        Meta& w = table->workers[key.substr(workers.size())];
        w.host = j.value("host", "");
        w.pid = j.value("pid", 0);
        w.store = j.value("store", "");
        w.phase = j.value("phase", "");
        w.round = j.value("round", int64_t{0});
        w.prev_round = j.value("prev_round", int64_t{-1});
        w.prev_rank = j.value("prev_rank", -1);
      } else if (key.compare(0, rounds.size(), rounds) == 0) {
        auto& members = table->rounds[std::stoll(key.substr(rounds.size()))];
        for (const auto& m : j.at("members")) {
          members.push_back({m.value("id", ""), m.value("host", ""), m.value("pid", 0), m.value("store", "")});
        }
      }
    } catch (const std::exception&) {
      // not ours: ignored
    }
  }
  lock.lock();
  table_ = table;
  table_generation_ = generation;
  table_version_ = version;
  return table;
}

void EtcdRendezvous::publish(const std::string& phase, int64_t round) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (debugging()) {
    log::debug("shoal elastic debug: pid " + std::to_string(self_.pid) + " (" + self_.id +
               "): " + phase + " round " + std::to_string(round));
  }
  session_->publish(Json{{"host", self_.host},
                         {"pid", self_.pid},
                         {"store", self_.store},
                         {"phase", phase},
                         {"round", round},
                         {"prev_round", prev_round_},
                         {"prev_rank", prev_rank_}}
                        .dump());
}

bool EtcdRendezvous::rejoin(Duration timeout) {
  Peer fresh;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    fresh = self_;
  }
  fresh.id = new_id(fresh);
  EtcdOptions once = options_;
  once.connect_timeout = timeout;
  std::shared_ptr<Session> session;
  try {
    session = std::make_shared<Session>(once, options_.prefix + "workers/" + fresh.id,
                                        Json{{"host", fresh.host}, {"pid", fresh.pid}, {"store", fresh.store},
                                             {"phase", "wait"}, {"round", 0}}
                                            .dump());
  } catch (const CommError&) {
    return false;
  }
  log::warn("shoal elastic: etcd no longer has this worker (pid " + std::to_string(fresh.pid) +
            "): it was silent longer than its lease of " + format_duration(options_.lease_ttl) +
            ", or another worker found its store closed; it joins again as a new worker");
  std::lock_guard<std::mutex> lock(mutex_);
  session_.swap(session);  // the old one stops when `session` goes
  self_ = fresh;
  ++generation_;
  prev_round_ = -1;
  prev_rank_ = -1;
  prev_view_.clear();
  rejoined_ = true;
  return true;
}

std::vector<std::string> EtcdRendezvous::proposal(int64_t round, const Table& table, ViewChooser& chooser,
                                                  std::string& waiting_for) const {
  const std::string me = id();
  std::vector<Candidate> candidates{{me, prev_round_, prev_rank_}};
  for (const auto& [id, w] : table.workers) {
    if (id == me) continue;
    if (w.phase == "wait" && w.round == round) {
      candidates.push_back({id, w.prev_round, w.prev_rank});
    } else if (w.round < round || w.phase == "train") {
      waiting_for = "worker " + who(w) + " to leave round " + std::to_string(w.round);
      return {};
    }
  }
  // The newest round anyone here knows of: what --quorum counts a majority of.
  Newest newest{prev_view_.empty() ? -1 : prev_round_, prev_view_};
  if (!table.rounds.empty() && table.rounds.rbegin()->first > newest.round) {
    newest.round = table.rounds.rbegin()->first;
    newest.members.clear();
    for (const auto& p : table.rounds.rbegin()->second) newest.members.push_back(p.id);
  }
  return chooser.choose(me, prev_round_, std::move(candidates), newest, waiting_for);
}

void EtcdRendezvous::forget_rounds_before(int64_t round) {
  if (round < 2) return;
  try {
    session()->client().erase_range(options_.prefix + round_name(0), options_.prefix + round_name(round));
  } catch (const CommError&) {
    // the next proposer deletes them
  }
}

View EtcdRendezvous::close(int64_t round, const std::vector<Peer>& members) {
  publish("train", round);
  View view;
  view.round = round;
  view.members = members;
  const std::string me = id();
  for (size_t i = 0; i < members.size(); ++i) {
    if (members[i].id == me) view.rank = static_cast<int>(i);
  }
  return view;
}

View EtcdRendezvous::next(const View* previous, Duration timeout) {
  SHOAL_CHECK(!left_) << "next() after leave()";
  Deadline deadline(timeout);
  if (previous != nullptr) {
    std::lock_guard<std::mutex> lock(mutex_);
    prev_round_ = previous->round;
    prev_rank_ = previous->rank;
    prev_view_.clear();
    for (const auto& p : previous->members) prev_view_.push_back(p.id);
  }
  int64_t round = previous != nullptr ? previous->round + 1 : 1;
  int64_t proposed = -1;  // a round this worker's transaction found closed by another's
  ViewChooser chooser(rendezvous_);
  std::string waiting_for = "the other workers";
  bool announced = false;  // "wait for `round`" given to the current session
  auto move_to = [&](int64_t later) {
    round = later;
    chooser.restart();
    publish("wait", round);
  };

  for (;;) {
    if (session()->expired()) {
      // Silent longer than its lease (or found dead): this worker joins again as a newcomer.
      if (rejoin(std::min(options_.request_timeout, deadline.remaining()))) announced = false;
      waiting_for = "etcd to answer, to register this worker again";
    }
    const auto session = this->session();
    const uint64_t seen = session->version();
    if (session->reachable() && has_gone()) erase_gone();
    if (!session->expired()) {
      if (!announced) {
        move_to(round);
        announced = true;
      }
      const auto table = this->table();
      const std::string me = id();

      // The round closed: with this worker, or without it.
      if (auto closed = table->rounds.find(round); closed != table->rounds.end()) {
        if (contains(closed->second, me)) return close(round, closed->second);
        move_to(round + 1);
        continue;
      }
      // Follow the job to a later round: one closed or training already, or one others wait for.
      int64_t later = table->rounds.empty() ? round : std::max(round, table->rounds.rbegin()->first + 1);
      for (const auto& [id, w] : table->workers) {
        if (id != me) later = std::max(later, w.phase == "train" ? w.round + 1 : w.round);
      }
      if (later > round) {
        move_to(later);
        continue;
      }

      const Ids ids = proposal(round, *table, chooser, waiting_for);
      if (!ids.empty() && proposed != round) {
        std::vector<Peer> members;
        Json view = Json::array();
        for (const auto& id : ids) {
          if (id == me) {
            std::lock_guard<std::mutex> lock(mutex_);
            members.push_back(self_);
          } else {
            const Meta& w = table->workers.at(id);
            members.push_back({id, w.host, w.pid, w.store});
          }
          view.push_back(to_json(members.back()));
        }
        try {
          if (session->client().create(options_.prefix + round_name(round), Json{{"members", view}}.dump(), 0)) {
            forget_rounds_before(round - 1);
            return close(round, members);
          }
          proposed = round;  // another worker's view won; the watch brings it
          continue;
        } catch (const CommError& e) {
          waiting_for = std::string("etcd to answer (") + e.what() + ")";
        }
      } else if (proposed == round) {
        waiting_for = "the view of round " + std::to_string(round) + " that another worker proposed";
      }
      std::string error;
      if (!session->reachable(&error)) waiting_for = "etcd to answer (" + error + ")";
    }
    if (deadline.expired()) round_timed_out(round, deadline.elapsed(), waiting_for);
    session->wait_change(seen, std::min(Duration(50), std::max(deadline.remaining(), Duration(1))));
  }
}

std::string EtcdRendezvous::pending_change(const View& current) {
  if (current.size() >= rendezvous_.max_workers) return "";
  const auto table = this->table();
  const std::string me = id();
  for (const auto& [id, w] : table->workers) {
    if (id == me || w.phase != "wait") continue;
    bool member = false;
    for (const auto& p : current.members) member = member || p.id == id;
    if (!member) return "worker " + who(w) + " waits to join";
  }
  return "";
}

std::string EtcdRendezvous::lost(const View& current) {
  if (session()->expired()) {
    return current.describe(current.rank) + " itself, whose key etcd dropped (it was silent longer than its lease of " +
           format_duration(options_.lease_ttl) + ", or another worker found its store closed)";
  }
  const auto table = this->table();
  std::string text;
  for (int r = 0; r < current.size(); ++r) {
    if (r == current.rank || table->workers.count(current.members[r].id) != 0) continue;
    text += (text.empty() ? "" : "; ") + current.describe(r) +
            ", whose key in etcd is gone (it left, its lease expired, or its store refused connections)";
  }
  return text;
}

bool EtcdRendezvous::take_rejoined() {
  std::lock_guard<std::mutex> lock(mutex_);
  return std::exchange(rejoined_, false);
}

void EtcdRendezvous::check(const View& current) {
  std::vector<std::string> ids;
  std::vector<std::string> stores;
  for (int r = 0; r < current.size(); ++r) {
    if (r == current.rank) continue;
    ids.push_back(current.members[r].id);
    stores.push_back(current.members[r].store);
  }
  const auto refused = refusing(stores, options_.probe_timeout);
  const auto session = this->session();
  for (size_t i = 0; i < ids.size(); ++i) {
    if (!refused[i]) continue;
    // Nothing listens at its store: the process is gone. Everyone's copy drops its key at once.
    std::lock_guard<std::mutex> lock(mutex_);
    gone_.push_back(ids[i]);
  }
  erase_gone();
}

void EtcdRendezvous::erase_gone() {
  std::vector<std::string> gone;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    gone.swap(gone_);
  }
  const auto session = this->session();
  for (size_t i = 0; i < gone.size(); ++i) {
    try {
      session->client().erase(options_.prefix + "workers/" + gone[i]);
    } catch (const CommError&) {
      // etcd is away: next() tries again once it answers (sooner than the lease would expire)
      std::lock_guard<std::mutex> lock(mutex_);
      gone_.insert(gone_.end(), gone.begin() + static_cast<std::ptrdiff_t>(i), gone.end());
      return;
    }
  }
}

void EtcdRendezvous::record_commit(int64_t version) {
  if (version <= recorded_) return;
  const auto session = this->session();
  try {
    session->client().put(options_.prefix + "commits/" + id(), std::to_string(version), 0);
    recorded_ = version;
  } catch (const CommError&) {
    // etcd is away: the next record (a round or 100 commits later) tries again
  }
}

int64_t EtcdRendezvous::recorded_commit() {
  // Read from etcd, not from the session's copy: a newcomer asks right after its first round
  // closed, and the record may be older than anything its watch has delivered.
  int64_t newest = recorded_;
  for (const auto& kv : session()->client().range_prefix(options_.prefix + "commits/").kvs) {
    try {
      newest = std::max<int64_t>(newest, std::stoll(kv.value));
    } catch (const std::exception&) {
      throw UsageError("etcd at " + options_.endpoint + ": " + kv.key + " is \"" + kv.value +
                       "\", expected a shoal job's recorded commit (a step number)");
    }
  }
  return newest;
}

void EtcdRendezvous::leave() {
  left_ = true;
  session()->leave();
}

}  // namespace shoal::elastic::etcd
