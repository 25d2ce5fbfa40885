// Private to src/elastic/gossip: the state of one Gossip instance and its protocol thread.
// swim.cpp has the public calls, the thread's loop and the handling of datagrams; detector.cpp
// the failure detector (probes, suspicion, local health).
//
// Threading: one mutex guards everything below it. The protocol thread holds it except while it
// waits in poll(); public calls take it and may send datagrams themselves (sendto is safe from
// any thread), then wake the thread when they changed its timers.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "swim.h"
#include "table.h"
#include "udp.h"
#include "wire.h"

namespace shoal::elastic::gossip {

using Clock = std::chrono::steady_clock;
using Time = Clock::time_point;

inline bool is_final(Status s) { return s == Status::kDead || s == Status::kLeft; }

// A ping in flight, sent from a socket of its own (see udp::probe_socket).
struct Probe {
  enum class Purpose {
    kRound,  // this period's turn of the round robin
    kNow,    // probe_now()
    kRelay,  // on behalf of a member that sent us a ping-req
  };
  Purpose purpose = Purpose::kRound;
  std::string target;
  sockaddr_in target_address{};
  uint64_t seq = 0;
  udp::Socket socket;
  Time direct_deadline;  // kRound, kNow: no ack by then, ask others to try
  Time deadline;         // no ack by then: suspect the target (kRelay: nack the requester)
  bool asked_others = false;
  int expected_nacks = 0;
  int nacks = 0;
  bool stalled = false;  // this member's thread ran late while the probe was out
  sockaddr_in requester{};  // kRelay
  uint64_t requester_seq = 0;
};

struct Gossip::State {
  // Set by start(), then read-only.
  Options options;
  std::string id;
  std::string address;
  udp::Socket socket;
  int wake_fd = -1;  // an eventfd: public calls wake the thread's poll() with it
  std::vector<std::pair<std::string, sockaddr_in>> seeds;  // as given, resolved
  std::thread thread;

  std::atomic<uint64_t> refused{0};
  std::atomic<uint64_t> suspicions{0};

  mutable std::mutex mutex;
  // Notified on every version bump, on the join's outcome and on acks for leave().
  mutable std::condition_variable changed;

  uint64_t version = 1;
  Table table;
  Status self = Status::kAlive;
  bool stopping = false;
  std::mt19937_64 random;
  uint64_t next_seq = 1;

  // Joining (start() with seeds).
  bool joining = false;
  std::string refused_by;  // the seed that answered "wrong token"
  Time next_join;
  Duration join_backoff{100};

  // leave(): members that have not acked the news yet.
  bool leaving = false;
  uint64_t leave_seq = 0;
  std::set<std::string> leave_unacked;

  // Failure detector (detector.cpp).
  std::vector<Probe> probes;
  std::vector<std::string> probe_order;
  size_t probe_next = 0;
  Time next_round;
  Time next_sync;
  std::map<std::string, Time> suspected;  // id -> when it is declared dead
  int health = 0;  // Lifeguard's local health multiplier, 0 (healthy) to kMaxHealth

  // Rate limits and once-only logs.
  std::set<std::string> logged_senders;
  std::map<std::string, Time> refusals_sent;
  std::map<std::string, Time> told_final;

  ~State();

  // swim.cpp
  void run();
  void wake();
  void stop();
  bool participating() const { return self == Status::kAlive; }
  const Member& me() const { return *table.find(id); }
  void bump_version();
  void send(const sockaddr_in& to, wire::Message message);
  void send_from(const udp::Socket& from, const sockaddr_in& to, wire::Message message);
  void send_table(const sockaddr_in& to, wire::Kind kind);
  void push_to_all(const Member& member, bool wants_ack = false);
  void receive_all(const udp::Socket& from, Time now);
  void handle(const std::string& datagram, const sockaddr_in& from, Time now);
  void handle_bad_token(const std::string& payload, const sockaddr_in& from, Time now);
  void handle(const wire::Message& message, const sockaddr_in& from, Time now);
  void apply(const Member& update, Time now);
  void apply_about_self(const Member& update);
  // Takes `after` as a member's record (`before`: the one it replaces, null for a new member)
  // and starts disseminating it. (elastic::State::commit is the one "commit" in shoal.)
  void adopt(const Member* before, const Member& after, Time now);
  void declare(const std::string& id, Status status, Time now);
  void send_join(Time now);

  // detector.cpp
  Duration scaled(Duration d) const { return d * (1 + health); }
  void adjust_health(int delta);
  Time next_timer() const;
  void tick(Time now);
  void note_stall(Duration lateness);
  void start_probe(Probe::Purpose purpose, const std::string& target, Time now);
  void start_relay(const wire::Message& request, const sockaddr_in& requester, Time now);
  void ask_others(Probe& probe, Time now);
  void on_ack(uint64_t seq);
  void on_nack(uint64_t seq);
  void on_refused(uint64_t seq, Time now);
  void end_probes_of(const std::string& id);
  void suspect(const std::string& id, Time now);
  void add_to_probe_order(const std::string& id);
  std::string next_probe_target();
  void start_suspicion(const std::string& id, Time now);
};

}  // namespace shoal::elastic::gossip
