// SWIM-style gossip membership among a job's processes, over UDP: who is in the job, who is
// alive, and each member's small metadata blob. No third-party service; see docs/elastic.md.
//
// Failure detection is SWIM's (Das, Gupta, Motivala 2002): every probe_interval a member pings
// the next member of a shuffled round-robin list; with no ack within probe_timeout it asks
// indirect_probes other members to ping it; with no ack by the end of the period the target is
// suspected, and declared dead when no refutation (a higher incarnation from the suspect itself)
// arrives within suspicion_timeout. A probe whose target's port is refused (ICMP port
// unreachable: the host is up, the process is gone) declares it dead at once. Dissemination is
// piggy-backed on pings and acks (each update sent a bounded number of times), and a member's
// own changes (its metadata, its leaving) are also pushed to every member right away, so that
// rendezvous rounds built on top close within one round trip.
//
// Every datagram carries an HMAC-SHA256 of its contents keyed by the job's token; a datagram
// without a valid one is dropped and logged once per sender, and never changes the table.
//
// Death and leaving are final for a member id: a process that learns it was declared dead
// (e.g. after being SIGSTOPped for longer than the suspicion timeout) stops taking part and
// says so through self_status(); to come back it starts a new Gossip, with a new id.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "shoal/core/timeout.h"

namespace shoal::elastic::gossip {

enum class Status { kAlive, kSuspect, kDead, kLeft };

const char* to_string(Status status);

struct Member {
  std::string id;       // unique for the life of one Gossip instance
  std::string address;  // "IP:PORT" of its UDP socket
  Status status = Status::kAlive;
  uint64_t incarnation = 0;
  std::string meta;     // the newest metadata known here
};

struct Options {
  // Where this member's UDP socket binds (port 0: any free port).
  std::string bind_host = "0.0.0.0";
  int port = 0;
  // The address other members reach this one on; empty: the local address on the route to the
  // first seed, or 127.0.0.1 without seeds. (A bind_host other than 0.0.0.0 is advertised as is.)
  std::string advertise_host;
  // "HOST:PORT" of members already in the job. Empty: this member starts a new job.
  std::vector<std::string> seeds;
  // The job's shared secret. Must be the same on every member; may not be empty.
  std::string token;
  // This member's initial metadata.
  std::string meta;

  // probe_timeout is the direct ping's share of a probe period (at most half of it); the rest
  // is for the indirect pings. See docs/elastic.md for why these values.
  Duration probe_interval = std::chrono::milliseconds(200);
  Duration probe_timeout = std::chrono::milliseconds(100);
  int indirect_probes = 3;
  Duration suspicion_timeout = std::chrono::milliseconds(2000);
  // How long start() keeps trying the seeds.
  Duration join_timeout = std::chrono::seconds(30);
};

class Gossip {
 public:
  // Opens the socket, starts the protocol thread and, with seeds, joins through the first seed
  // that answers (receiving its whole table). UsageError: a bad seed address, an empty token, a
  // port that can't be bound, or a seed that refused this member's token (the message says so).
  // CommError: no seed answered within join_timeout.
  static std::unique_ptr<Gossip> start(const Options& options);

  // Stops the protocol thread without announcing anything (others will detect the silence).
  ~Gossip();
  Gossip(const Gossip&) = delete;
  Gossip& operator=(const Gossip&) = delete;

  const std::string& id() const;
  const std::string& address() const;

  // Replaces this member's metadata and sends it to every member at once.
  void set_meta(const std::string& meta);

  // Every member known here, this one included, whatever its status.
  std::vector<Member> members() const;

  // Increases whenever the table changes (a member added, a status or metadata changed).
  uint64_t version() const;
  // Blocks until version() != seen or the timeout passes; returns the current version.
  uint64_t wait_change(uint64_t seen, Duration timeout) const;

  // Evidence from outside the protocol (a collective saw the member's connection close, or it
  // announced leaving in a collective): mark it dead (or left) here and disseminate that.
  void declare_dead(const std::string& id);
  void declare_left(const std::string& id);

  // Probes these members now rather than in turn (after a collective failed, to learn fast who
  // is gone); results appear as status changes.
  void probe_now(const std::vector<std::string>& ids);

  // Announces that this member leaves (every member is told at once), then stops.
  void leave();

  // kAlive normally; kDead once this member learned that the others declared it dead; kLeft
  // after leave().
  Status self_status() const;

  // Datagrams dropped for a missing or wrong token.
  uint64_t refused_datagrams() const;

  // How many times a member became Suspect in this member's table, whether this member's probe
  // failed or it heard so: a measure of false alarms, since most are refuted.
  uint64_t suspicions() const;

  struct State;

 private:
  explicit Gossip(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace shoal::elastic::gossip
