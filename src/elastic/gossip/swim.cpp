#include "swim.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>

#include "shoal/core/error.h"
#include "state.h"
#include "core/log.h"

namespace shoal::elastic::gossip {
namespace {

// Full tables (join answers, push-pull) go in chunks of this size; piggy-backed updates take at
// most kPiggybackBudget of a ping or ack, so that probes stay small on a real network.
constexpr size_t kTableChunk = 16 * 1024;
constexpr size_t kPiggybackBudget = 8 * 1024;
// One entry must fit a datagram whatever else it carries.
constexpr size_t kMaxEntry = 48 * 1024;
constexpr Duration kLeaveRetry{50};
constexpr int kLeaveSends = 4;  // ~200 ms in all
constexpr Duration kRefusalInterval{500};
constexpr Duration kTellFinalInterval{500};

std::string seconds(Duration d) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.2f s", static_cast<double>(d.count()) / 1000.0);
  return text;
}

std::string random_hex(std::mt19937_64& random) {
  char text[17];
  std::snprintf(text, sizeof(text), "%016" PRIx64, random());
  return text;
}

void check_entry_size(const Member& member) {
  if (wire::encoded_size(member) > kMaxEntry) {
    throw UsageError("shoal gossip: metadata of " + std::to_string(member.meta.size()) +
                     " bytes is too large; expected at most " + std::to_string(kMaxEntry / 1024 - 1) + " KiB");
  }
}

}  // namespace

const char* to_string(Status status) {
  switch (status) {
    case Status::kAlive: return "alive";
    case Status::kSuspect: return "suspect";
    case Status::kDead: return "dead";
    case Status::kLeft: return "left";
  }
  return "?";
}

// ---- Lifecycle --------------------------------------------------------------------------------

std::unique_ptr<Gossip> Gossip::start(const Options& options) {
  if (options.token.empty()) {
    throw UsageError("shoal gossip: the job's token is empty; expected the job's shared secret "
                     "(set SHOAL_JOB_TOKEN or --token-file)");
  }
  auto state = std::make_unique<State>();
  state->options = options;
  state->random.seed(std::random_device()());
  for (const auto& seed : options.seeds) {
    auto address = udp::resolve(seed);
    if (!address) throw UsageError("shoal gossip: seed \"" + seed + "\" is not a reachable HOST:PORT");
    state->seeds.emplace_back(seed, *address);
  }
  std::string error;
  state->socket = udp::bind(options.bind_host, options.port, &error);
  if (state->socket.fd() < 0) throw UsageError("shoal gossip: " + error);
  const int port = ntohs(udp::local_address(state->socket).sin_port);

  std::string host = options.advertise_host;
  if (host.empty() && options.bind_host != "0.0.0.0") host = options.bind_host;
  if (host.empty() && !state->seeds.empty()) host = udp::route_source(state->seeds.front().second).value_or("");
  if (host.empty()) host = "127.0.0.1";
  auto advertised = udp::resolve(host + ":" + std::to_string(port));
  if (!advertised) throw UsageError("shoal gossip: advertise_host \"" + host + "\" is not a host name or address");
  state->address = udp::to_string(*advertised);
  state->id = state->address + "/" + random_hex(state->random);

  Member me{state->id, state->address, Status::kAlive, 1, options.meta};
  check_entry_size(me);
  state->table.put(me);
  // A member listed among its own seeds starts the job rather than joining itself.
  for (auto it = state->seeds.begin(); it != state->seeds.end();) {
    it = udp::same(it->second, *advertised) ? state->seeds.erase(it) : it + 1;
  }
  const Time now = Clock::now();
  state->joining = !state->seeds.empty();
  state->next_join = now;
  state->next_round = now + options.probe_interval;
  state->next_sync = now + options.probe_interval;

  state->wake_fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  SHOAL_CHECK(state->wake_fd >= 0) << "eventfd failed";
  State* s = state.get();
  s->thread = std::thread([s] { s->run(); });
  std::unique_ptr<Gossip> gossip(new Gossip(std::move(state)));
  if (!s->joining) return gossip;

  std::unique_lock<std::mutex> lock(s->mutex);
  s->changed.wait_for(lock, options.join_timeout, [s] { return !s->joining || !s->refused_by.empty(); });
  const std::string refused_by = s->refused_by;
  const bool joined = !s->joining;
  lock.unlock();
  if (!refused_by.empty()) {
    throw UsageError("shoal gossip: the job at " + refused_by +
                     " refused this process: its token does not match the job's (set SHOAL_JOB_TOKEN or "
                     "--token-file)");
  }
  if (!joined) {
    std::string tried;
    for (const auto& seed : s->seeds) tried += (tried.empty() ? "" : ", ") + seed.first;
    throw CommError("shoal gossip: no seed answered within " + seconds(options.join_timeout) + " (tried " + tried +
                    ")");
  }
  return gossip;
}

Gossip::Gossip(std::unique_ptr<State> state) : state_(std::move(state)) {}

Gossip::~Gossip() { state_->stop(); }

Gossip::State::~State() {
  if (wake_fd >= 0) ::close(wake_fd);
}

void Gossip::State::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex);
    stopping = true;
  }
  wake();
  if (thread.joinable()) thread.join();
}

void Gossip::State::wake() {
  const uint64_t one = 1;
  [[maybe_unused]] auto ignored = ::write(wake_fd, &one, sizeof(one));
}

// ---- Public calls -----------------------------------------------------------------------------

const std::string& Gossip::id() const { return state_->id; }
const std::string& Gossip::address() const { return state_->address; }

void Gossip::set_meta(const std::string& meta) {
  std::lock_guard<std::mutex> lock(state_->mutex);
  Member me = state_->me();
  me.meta = meta;
  check_entry_size(me);
  if (!state_->participating()) return;
  ++me.incarnation;  // as memberlist does: newer metadata wins everywhere by its incarnation
  state_->adopt(&state_->me(), me, Clock::now());
  state_->push_to_all(me);
}

std::vector<Member> Gossip::members() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->table.all();
}

uint64_t Gossip::version() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->version;
}

uint64_t Gossip::wait_change(uint64_t seen, Duration timeout) const {
  std::unique_lock<std::mutex> lock(state_->mutex);
  state_->changed.wait_for(lock, timeout, [&] { return state_->version != seen; });
  return state_->version;
}

void Gossip::declare_dead(const std::string& id) {
  std::lock_guard<std::mutex> lock(state_->mutex);
  if (state_->participating() && id != state_->id) state_->declare(id, Status::kDead, Clock::now());
}

void Gossip::declare_left(const std::string& id) {
  std::lock_guard<std::mutex> lock(state_->mutex);
  if (state_->participating() && id != state_->id) state_->declare(id, Status::kLeft, Clock::now());
}

void Gossip::probe_now(const std::vector<std::string>& ids) {
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    if (!state_->participating()) return;
    for (const auto& id : ids) state_->start_probe(Probe::Purpose::kNow, id, Clock::now());
  }
  state_->wake();
}

void Gossip::leave() {
  std::unique_lock<std::mutex> lock(state_->mutex);
  State& s = *state_;
  if (s.participating()) {
    Member me = s.me();
    me.status = Status::kLeft;
    s.adopt(&s.me(), me, Clock::now());
    s.self = Status::kLeft;
    s.leaving = true;
    s.leave_seq = s.next_seq++;
    for (const auto& m : s.table.all()) {
      if (m.id != s.id && !is_final(m.status)) s.leave_unacked.insert(m.id);
    }
    // Members ack the news; lost datagrams are sent again, within ~200 ms in all.
    for (int sends = 0; sends < kLeaveSends && !s.leave_unacked.empty(); ++sends) {
      wire::Message news(wire::Kind::kNews, s.leave_seq);
      news.wants_ack = true;
      news.updates = {me};
      for (const auto& id : s.leave_unacked) {
        if (auto to = udp::resolve(s.table.find(id)->address, true)) s.send(*to, news);
      }
      s.changed.wait_for(lock, kLeaveRetry, [&] { return s.leave_unacked.empty(); });
    }
    s.leaving = false;
  }
  lock.unlock();
  s.stop();
}

Status Gossip::self_status() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->self;
}

uint64_t Gossip::refused_datagrams() const { return state_->refused.load(); }
uint64_t Gossip::suspicions() const { return state_->suspicions.load(); }

// ---- The protocol thread ----------------------------------------------------------------------

void Gossip::State::run() {
  std::unique_lock<std::mutex> lock(mutex);
  // A member told it is dead stops here: no more pings, acks or refutations from it.
  while (!stopping && (participating() || leaving)) {
    const Time wake_at = participating() ? next_timer() : Clock::now() + Duration(1000);
    std::vector<pollfd> fds{{wake_fd, POLLIN, 0}, {socket.fd(), POLLIN, 0}};
    for (const auto& probe : probes) fds.push_back({probe.socket.fd(), POLLIN, 0});
    const auto wait = std::chrono::duration_cast<Duration>(wake_at - Clock::now());
    const int timeout_ms = static_cast<int>(std::clamp<int64_t>(wait.count() + 1, 0, 1000));

    lock.unlock();
    ::poll(fds.data(), fds.size(), timeout_ms);
    lock.lock();

    const Time now = Clock::now();
    uint64_t ignored;
    while (::read(wake_fd, &ignored, sizeof(ignored)) > 0) {
    }
    // Read everything that arrived before looking at deadlines: after a stall, the acks and
    // refutations waiting in the buffers are the freshest evidence.
    receive_all(socket, now);
    std::vector<uint64_t> seqs;
    for (const auto& probe : probes) seqs.push_back(probe.seq);
    for (uint64_t seq : seqs) {
      for (auto& probe : probes) {
        if (probe.seq != seq) continue;
        std::string datagram;
        sockaddr_in from{};
        const auto received = udp::receive(probe.socket, &datagram, &from);
        if (received == udp::Received::kRefused) {
          on_refused(seq, now);
        } else if (received == udp::Received::kDatagram) {
          handle(datagram, from, now);
        }
        break;
      }
    }
    if (!participating()) continue;
    if (now > wake_at) note_stall(std::chrono::duration_cast<Duration>(now - wake_at));
    tick(now);
  }
  for (auto& probe : probes) probe.socket.reset();
  probes.clear();
}

void Gossip::State::receive_all(const udp::Socket& from_socket, Time now) {
  std::string datagram;
  sockaddr_in from{};
  // Bounded, so that a flood cannot keep the timers from running.
  for (int i = 0; i < 1000 && udp::receive(from_socket, &datagram, &from) == udp::Received::kDatagram; ++i) {
    handle(datagram, from, now);
  }
}

void Gossip::State::bump_version() {
  ++version;
  changed.notify_all();
}

// ---- Sending ----------------------------------------------------------------------------------

void Gossip::State::send(const sockaddr_in& to, wire::Message message) { send_from(socket, to, std::move(message)); }

void Gossip::State::send_from(const udp::Socket& from, const sockaddr_in& to, wire::Message message) {
  message.from = id;
  if (message.kind == wire::Kind::kPing || message.kind == wire::Kind::kAck || message.kind == wire::Kind::kPingReq) {
    const size_t overhead = wire::sealed_overhead(message);
    message.updates = table.piggyback(std::min(kPiggybackBudget, wire::kMaxDatagram - overhead));
  }
  udp::send(from, to, wire::seal(options.token, wire::encode(message)));
}

void Gossip::State::send_table(const sockaddr_in& to, wire::Kind kind) {
  wire::Message chunk{kind};
  chunk.from = id;
  const size_t overhead = wire::sealed_overhead(chunk);
  size_t size = overhead;
  for (const auto& m : table.all()) {
    const size_t entry = wire::encoded_size(m);
    if (!chunk.updates.empty() && size + entry > kTableChunk) {
      send(to, chunk);
      chunk.updates.clear();
      size = overhead;
    }
    chunk.updates.push_back(m);
    size += entry;
  }
  send(to, chunk);
}

// A member's own changes go to every member at once rather than waiting for the epidemic, so
// that a rendezvous round built on metadata closes within one round trip.
void Gossip::State::push_to_all(const Member& member, bool wants_ack) {
  wire::Message news{wire::Kind::kNews};
  news.wants_ack = wants_ack;
  news.updates = {member};
  for (const auto& m : table.all()) {
    // A member just declared dead is told too: if it is only frozen, it learns at once when it
    // wakes up and stops rather than carrying on as a zombie.
    if (m.id == id || (is_final(m.status) && m.id != member.id)) continue;
    if (auto to = udp::resolve(m.address, true)) send(*to, news);
  }
}

void Gossip::State::send_join(Time now) {
  wire::Message join{wire::Kind::kJoin};
  join.updates = {me()};
  for (const auto& seed : seeds) send(seed.second, join);
  next_join = now + join_backoff;
  join_backoff = std::min(join_backoff * 2, Duration(1000));
}

// ---- Receiving --------------------------------------------------------------------------------

void Gossip::State::handle(const std::string& datagram, const sockaddr_in& from, Time now) {
  std::string payload;
  switch (wire::open(options.token, datagram, &payload)) {
    case wire::Opened::kRefusal:
      // Unauthenticated, so only a joiner waiting for the answer of a seed believes it.
      if (!joining) return;
      for (const auto& seed : seeds) {
        if (seed.second.sin_port == from.sin_port) {
          refused_by = seed.first;
          changed.notify_all();
        }
      }
      return;
    case wire::Opened::kGarbage:
    case wire::Opened::kBadToken:
      handle_bad_token(payload, from, now);
      return;
    case wire::Opened::kValid:
      if (auto message = wire::decode(payload)) handle(*message, from, now);
      return;
  }
}

void Gossip::State::handle_bad_token(const std::string& payload, const sockaddr_in& from, Time now) {
  ++refused;
  const std::string sender = udp::to_string(from);
  if (logged_senders.size() < 1024 && logged_senders.insert(sender).second) {
    log::warn("shoal gossip: dropped a datagram from " + sender +
              ": it lacks the job's token (a process of another job, or one given another token); "
              "further ones from there are only counted");
  }
  // A joiner with the wrong token is told so, rather than left to time out. Rate-limited per
  // sender; the answer is smaller than the request, so it amplifies nothing.
  auto message = payload.empty() ? std::nullopt : wire::decode(payload);
  if (!message || message->kind != wire::Kind::kJoin) return;
  if (refusals_sent.size() > 4096) refusals_sent.clear();
  auto [it, first] = refusals_sent.emplace(sender, now);
  if (!first && now - it->second < kRefusalInterval) return;
  it->second = now;
  udp::send(socket, from, wire::refusal());
}

void Gossip::State::handle(const wire::Message& message, const sockaddr_in& from, Time now) {
  if (!participating()) {
    if (leaving && message.kind == wire::Kind::kAck && message.seq == leave_seq) {
      leave_unacked.erase(message.from);
      if (leave_unacked.empty()) changed.notify_all();
    }
    return;
  }
  if (message.from == id) return;
  // A member we know to be dead (frozen for too long, say) is told so and otherwise ignored.
  if (const Member* sender = table.find(message.from); sender != nullptr && is_final(sender->status)) {
    if (message.kind == wire::Kind::kNews && message.wants_ack) {
      send(from, wire::Message(wire::Kind::kAck, message.seq));  // leave() sending again
    }
    if (sender->status != Status::kDead) return;
    auto [it, first] = told_final.emplace(sender->id, now);
    if (first || now - it->second >= kTellFinalInterval) {
      it->second = now;
      wire::Message news{wire::Kind::kNews};
      news.updates = {*sender};
      send(from, news);
    }
    return;
  }
  for (const auto& update : message.updates) {
    apply(update, now);
    if (!participating()) return;
  }
  switch (message.kind) {
    case wire::Kind::kPing:
      // A ping for another id reached a new process on a dead member's port: no ack.
      if (message.target == id) send(from, wire::Message{wire::Kind::kAck, message.seq});
      break;
    case wire::Kind::kAck:
      on_ack(message.seq);
      break;
    case wire::Kind::kPingReq:
      start_relay(message, from, now);
      break;
    case wire::Kind::kNack:
      on_nack(message.seq);
      break;
    case wire::Kind::kJoin:
      send_table(from, wire::Kind::kJoinAck);
      break;
    case wire::Kind::kJoinAck:
      // The joiner announces itself to everyone in the table rather than leaving it to the
      // seed's dissemination: a join is seen by all within a round trip.
    {
      wire::Message news{wire::Kind::kNews};
      news.updates = {me()};
      for (const auto& m : message.updates) {
        if (m.id == id || is_final(m.status)) continue;
        if (auto to = udp::resolve(m.address, true)) send(*to, news);
      }
      if (joining) {
        joining = false;
        changed.notify_all();
      }
      break;
    }
    case wire::Kind::kSync:
      send_table(from, wire::Kind::kSyncAck);
      break;
    case wire::Kind::kSyncAck:
      break;
    case wire::Kind::kNews:
      if (message.wants_ack) send(from, wire::Message{wire::Kind::kAck, message.seq});
      break;
  }
}

// ---- Table changes ----------------------------------------------------------------------------

void Gossip::State::apply(const Member& update, Time now) {
  if (update.id == id) return apply_about_self(update);
  if (!udp::resolve(update.address, true)) return;
  const Member* current = table.find(update.id);
  if (current == nullptr) {
    // An unknown member is added whatever its status: a dead one too, so that older news about
    // it can't bring it back.
    adopt(nullptr, update, now);
  } else if (overrides(*current, update)) {
    const Member before = *current;
    adopt(&before, merged(before, update), now);
  }
}

void Gossip::State::apply_about_self(const Member& update) {
  Member me = this->me();
  if (is_final(update.status)) {
    // Final, at any incarnation: the others have dropped this id already.
    self = update.status == Status::kLeft ? Status::kLeft : Status::kDead;
    me.status = self;
    table.put(me);
    bump_version();
    return;
  }
  if (update.incarnation < me.incarnation) return;  // stale news
  if (update.status == Status::kAlive && update.incarnation == me.incarnation) return;
  // Refute: only this member raises its own incarnation, and the higher one wins everywhere.
  me.incarnation = update.incarnation + 1;
  table.put(me);
  table.disseminate(me);
  bump_version();
  push_to_all(me);
  // Someone could not reach this member in time: it may be this member that is slow.
  if (update.status == Status::kSuspect) adjust_health(+1);
}

void Gossip::State::adopt(const Member* before, const Member& after, Time now) {
  const bool was_suspect = before != nullptr && before->status == Status::kSuspect;
  table.put(after);
  table.disseminate(after);
  bump_version();
  if (after.id == id) return;
  if (after.status == Status::kSuspect && !was_suspect) start_suspicion(after.id, now);
  if (after.status != Status::kSuspect) suspected.erase(after.id);
  if (is_final(after.status)) end_probes_of(after.id);
  if (before == nullptr && !is_final(after.status)) add_to_probe_order(after.id);
}

// This member's own evidence (a refused probe, a suspicion that ran out, the caller's word):
// applied here and pushed to every member at once.
void Gossip::State::declare(const std::string& member_id, Status status, Time now) {
  const Member* current = table.find(member_id);
  if (current == nullptr) return;
  const Member before = *current;
  Member after = before;
  after.status = status;
  if (!overrides(before, after)) return;
  adopt(&before, after, now);
  push_to_all(after);
}

}  // namespace shoal::elastic::gossip
