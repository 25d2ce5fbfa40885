// SWIM's failure detector with two of Lifeguard's refinements (Dadgar et al. 2018): a local
// health multiplier that slows this member's probing and suspicion when it is itself slow, and
// suspicions sent straight to the suspect so that it can refute them at once.
#include <algorithm>

#include "state.h"

namespace shoal::elastic::gossip {
namespace {

constexpr int kMaxHealth = 8;
// Push-pull with one random member this often (jittered by +-25%). Each exchange repairs what
// lost datagrams kept from the epidemic.
constexpr Duration kSyncInterval{2000};

}  // namespace

void Gossip::State::adjust_health(int delta) { health = std::clamp(health + delta, 0, kMaxHealth); }

Time Gossip::State::next_timer() const {
  Time next = std::min(next_round, next_sync);
  if (joining) next = std::min(next, next_join);
  for (const auto& probe : probes) {
    next = std::min(next, probe.asked_others ? probe.deadline : probe.direct_deadline);
  }
  for (const auto& [member, deadline] : suspected) next = std::min(next, deadline);
  return next;
}

// Note [Late wake-ups]
// When this member's thread runs late (a loaded CPU, or a SIGSTOP of this process), the silence
// it measured is partly its own. The loop reads every datagram waiting before it looks at any
// deadline, so acks and refutations that arrived meanwhile count; on top of that, the time it
// was late is added to every running deadline, and a probe that was out during such a stall
// ends without suspecting anyone (it raises the local health multiplier instead).
void Gossip::State::note_stall(Duration lateness) {
  const Duration slack = std::max(Duration(5), options.probe_timeout / 4);
  if (lateness < slack) return;
  for (auto& probe : probes) {
    probe.stalled = true;
    probe.direct_deadline += lateness;
    probe.deadline += lateness;
  }
  for (auto& [member, deadline] : suspected) deadline += lateness;
}

void Gossip::State::tick(Time now) {
  if (joining && now >= next_join) send_join(now);

  for (size_t i = 0; i < probes.size();) {
    Probe& probe = probes[i];
    if (!probe.asked_others && now >= probe.direct_deadline) ask_others(probe, now);
    if (now < probe.deadline) {
      ++i;
      continue;
    }
    Probe done = std::move(probe);
    probes.erase(probes.begin() + static_cast<std::ptrdiff_t>(i));
    if (done.purpose == Probe::Purpose::kRelay) {
      send(done.requester, wire::Message{wire::Kind::kNack, done.requester_seq});
    } else if (done.stalled) {
      adjust_health(+1);
    } else {
      // Intermediaries that did not even nack suggest the trouble is on this side.
      if (done.nacks < done.expected_nacks) adjust_health(+1);
      suspect(done.target, now);
    }
  }

  std::vector<std::string> expired;
  for (const auto& [member, deadline] : suspected) {
    if (now >= deadline) expired.push_back(member);
  }
  for (const auto& member : expired) {
    suspected.erase(member);
    declare(member, Status::kDead, now);
  }

  if (now >= next_round) {
    const Probe* busy = nullptr;
    for (const auto& probe : probes) {
      if (probe.purpose == Probe::Purpose::kRound) busy = &probe;
    }
    if (busy != nullptr) {
      next_round = busy->deadline;  // stretched by a stall: the next turn waits for its end
    } else {
      const std::string target = next_probe_target();
      if (!target.empty()) start_probe(Probe::Purpose::kRound, target, now);
      next_round = now + scaled(options.probe_interval);
    }
  }

  if (now >= next_sync) {
    std::vector<const Member*> others;
    std::vector<Member> all = table.all();
    for (const auto& m : all) {
      if (m.id != id && !is_final(m.status)) others.push_back(&m);
    }
    if (!others.empty()) {
      const Member* peer = others[random() % others.size()];
      if (auto to = udp::resolve(peer->address, true)) send_table(*to, wire::Kind::kSync);
    }
    const auto jitter = Duration(static_cast<int64_t>(random() % (kSyncInterval.count() / 2 + 1)));
    next_sync = now + kSyncInterval * 3 / 4 + jitter;
  }
}

void Gossip::State::start_probe(Probe::Purpose purpose, const std::string& target, Time now) {
  const Member* member = table.find(target);
  if (member == nullptr || member->id == id || is_final(member->status)) return;
  for (const auto& probe : probes) {
    if (probe.purpose != Probe::Purpose::kRelay && probe.target == target) return;  // one at a time
  }
  auto to = udp::resolve(member->address, true);
  Probe probe;
  probe.socket = udp::probe_socket();
  if (!to || probe.socket.fd() < 0) return;
  probe.purpose = purpose;
  probe.target = target;
  probe.target_address = *to;
  probe.seq = next_seq++;
  // The round ends by the next turn; the direct ping gets at most half of it, the ping-reqs
  // the rest.
  const Duration period = scaled(options.probe_interval);
  probe.direct_deadline = now + std::min(scaled(options.probe_timeout), period / 2);
  probe.deadline = now + period;
  wire::Message ping{wire::Kind::kPing, probe.seq};
  ping.target = target;
  send_from(probe.socket, *to, ping);
  probes.push_back(std::move(probe));
}

void Gossip::State::start_relay(const wire::Message& request, const sockaddr_in& requester, Time now) {
  auto to = udp::resolve(request.target_address, true);
  Probe probe;
  probe.socket = udp::probe_socket();
  if (!to || probe.socket.fd() < 0) return;
  probe.purpose = Probe::Purpose::kRelay;
  probe.target = request.target;
  probe.target_address = *to;
  probe.seq = next_seq++;
  probe.requester = requester;
  probe.requester_seq = request.seq;
  probe.asked_others = true;
  probe.deadline = now + std::min(Duration(request.nack_after_ms), Duration(5000));
  probe.direct_deadline = probe.deadline;
  wire::Message ping{wire::Kind::kPing, probe.seq};
  ping.target = request.target;
  send_from(probe.socket, *to, ping);
  probes.push_back(std::move(probe));
}

void Gossip::State::ask_others(Probe& probe, Time now) {
  probe.asked_others = true;
  std::vector<Member> helpers;
  for (auto& m : table.all()) {
    if (m.id != id && m.id != probe.target && m.status == Status::kAlive) helpers.push_back(std::move(m));
  }
  std::shuffle(helpers.begin(), helpers.end(), random);
  helpers.resize(std::min<size_t>(helpers.size(), static_cast<size_t>(std::max(options.indirect_probes, 0))));
  // Helpers nack a little before the round ends, so that their nacks arrive in time to count.
  const auto left = std::chrono::duration_cast<Duration>(probe.deadline - now);
  wire::Message request{wire::Kind::kPingReq, probe.seq};
  request.target = probe.target;
  request.target_address = udp::to_string(probe.target_address);
  request.nack_after_ms = static_cast<uint32_t>(std::max<int64_t>(1, left.count() * 4 / 5));
  for (const auto& helper : helpers) {
    if (auto to = udp::resolve(helper.address, true)) send(*to, request);
  }
  probe.expected_nacks = static_cast<int>(helpers.size());
  // And once more directly, in case only the first ping was lost.
  wire::Message ping{wire::Kind::kPing, probe.seq};
  ping.target = probe.target;
  send_from(probe.socket, probe.target_address, ping);
}

void Gossip::State::on_ack(uint64_t seq) {
  for (auto it = probes.begin(); it != probes.end(); ++it) {
    if (it->seq != seq) continue;
    if (it->purpose == Probe::Purpose::kRelay) {
      send(it->requester, wire::Message{wire::Kind::kAck, it->requester_seq});
    } else if (it->purpose == Probe::Purpose::kRound) {
      adjust_health(-1);
    }
    probes.erase(it);
    return;
  }
}

void Gossip::State::on_nack(uint64_t seq) {
  for (auto& probe : probes) {
    if (probe.seq == seq) ++probe.nacks;
  }
}

// The target's port answered with ICMP port-unreachable: its host is up and its process gone.
void Gossip::State::on_refused(uint64_t seq, Time now) {
  for (auto it = probes.begin(); it != probes.end(); ++it) {
    if (it->seq != seq) continue;
    const std::string target = it->target;
    probes.erase(it);
    declare(target, Status::kDead, now);
    return;
  }
}

void Gossip::State::end_probes_of(const std::string& member) {
  probes.erase(std::remove_if(probes.begin(), probes.end(), [&](const Probe& p) { return p.target == member; }),
               probes.end());
}

void Gossip::State::suspect(const std::string& member, Time now) {
  const Member* current = table.find(member);
  if (current == nullptr || current->status != Status::kAlive) return;
  const Member before = *current;
  Member after = before;
  after.status = Status::kSuspect;
  adopt(&before, after, now);
  // Lifeguard's buddy system: the suspect hears of it first, and refutes it if it can.
  wire::Message news{wire::Kind::kNews};
  news.updates = {after};
  if (auto to = udp::resolve(after.address, true)) send(*to, news);
}

void Gossip::State::start_suspicion(const std::string& member, Time now) {
  // Not scaled by local health: the suspect hears of it at once and refutes it in a round trip,
  // and the time this member's thread was late does not count (Note [Late wake-ups]).
  suspected[member] = now + options.suspicion_timeout;
  ++suspicions;
}

void Gossip::State::add_to_probe_order(const std::string& member) {
  // At a random place in the rest of this pass, as memberlist does, so that a new member is
  // probed within one pass without upsetting the order of the others.
  const size_t span = probe_order.size() - std::min(probe_next, probe_order.size()) + 1;
  const size_t at = std::min(probe_next, probe_order.size()) + random() % span;
  probe_order.insert(probe_order.begin() + static_cast<std::ptrdiff_t>(at), member);
}

std::string Gossip::State::next_probe_target() {
  for (int pass = 0; pass < 2; ++pass) {
    while (probe_next < probe_order.size()) {
      const std::string& candidate = probe_order[probe_next++];
      const Member* m = table.find(candidate);
      if (m != nullptr && m->id != id && !is_final(m->status)) return candidate;
    }
    // End of a pass: the next one goes over the members known now, in a new random order.
    probe_order.clear();
    for (const auto& m : table.all()) {
      if (m.id != id && !is_final(m.status)) probe_order.push_back(m.id);
    }
    std::shuffle(probe_order.begin(), probe_order.end(), random);
    probe_next = 0;
  }
  return "";
}

}  // namespace shoal::elastic::gossip
