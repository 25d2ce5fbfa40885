#include "session.h"

#include <algorithm>
#include <cstdio>
#include <functional>
#include <thread>
#include <tuple>

#include "shoal/core/error.h"
#include "core/log.h"

namespace shoal::elastic::etcd {
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

constexpr Duration kRetryFirst = 100ms;  // after a failed request; doubles up to kRetryMost
constexpr Duration kRetryMost = 1s;

}  // namespace

// Note [etcd going away]
// The thread renews the lease every TTL/3 and reads the watch in between. When a request fails
// (etcd restarts, or the network drops), the copy of the keys stays as it was: "etcd does not
// answer" says nothing about the workers, and reporting them lost would break a healthy job. The
// thread retries, after 100 ms, 200 ms, ... up to 1 s, and drops the watch: once etcd answers
// again it reads the whole prefix and watches from there, so whatever changed meanwhile (leases
// that expired, keys deleted) shows at once. etcd 3.4 keeps leases in its data directory and,
// when it starts (or a new leader takes over), gives each its whole TTL again, so a restart of
// a few seconds costs no worker its key. Should the lease have expired anyway, the renewal says
// so (TTL 0) and the session is over (expired()); the rendezvous then registers again.

Session::Session(const EtcdOptions& options, std::string key, const std::string& value)
    : client_(Endpoint::parse(options.endpoint), options.request_timeout), prefix_(options.prefix), key_(std::move(key)) {
  Deadline deadline(options.connect_timeout);
  Duration retry = kRetryFirst;
  for (;;) {
    try {
      std::tie(lease_, ttl_) = client_.grant(options.lease_ttl);
      auto created = client_.create(key_, value, lease_);
      SHOAL_CHECK(created.has_value()) << "the key " << key_ << " exists already";
      create_revision_ = *created;
      sync();
      break;
    } catch (const CommError& e) {
      if (deadline.expired()) {
        throw CommError("elastic rendezvous: etcd at " + client_.endpoint().text() + " did not answer within " +
                        format_duration(deadline.elapsed()) + ": " + e.what());
      }
      std::this_thread::sleep_for(std::min(retry, deadline.remaining()));
      retry = std::min(retry * 2, kRetryMost);
    }
  }
  thread_ = std::thread([this] { run(); });
}

// The watch, if any, closes its connection as it is destroyed, after the thread.
Session::~Session() {
  stopping_ = true;
  if (thread_.joinable()) {
    wake();
    thread_.join();
  }
}

void Session::wake() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    woken_ = true;
  }
  wake_.notify_one();
}

void Session::publish(std::string value) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    unsent_ = std::move(value);
    has_unsent_ = true;
  }
  wake();
}

void Session::leave() {
  stopping_ = true;
  if (thread_.joinable()) {
    wake();
    thread_.join();
  }
  watch_.reset();
  changed([&] { expired_ = true; });
  try {
    client_.revoke(lease_);
  } catch (const CommError& e) {
    log::warn(std::string("shoal elastic: could not tell etcd that this worker leaves (") +
              e.what() + "); its lease expires in " + format_duration(ttl_));
  }
}

std::shared_ptr<const Session::Keys> Session::keys() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return keys_;
}

uint64_t Session::version() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return version_;
}

void Session::wait_change(uint64_t seen, Duration timeout) const {
  std::unique_lock<std::mutex> lock(mutex_);
  cv_.wait_for(lock, timeout, [&] { return version_ != seen; });
}

bool Session::reachable(std::string* error) const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (error != nullptr) *error = error_;
  return reachable_;
}

void Session::changed(const std::function<void()>& change) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    change();
    ++version_;
  }
  cv_.notify_all();
}

void Session::set_reachable(bool reachable, const std::string& error) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (reachable_ == reachable && error_ == error) return;
  }
  changed([&] {
    reachable_ = reachable;
    error_ = error;
  });
}

void Session::sync() {
  auto range = client_.range_prefix(prefix_);
  auto watch = std::make_unique<Watch>(client_, prefix_, range.revision + 1, [this] { wake(); });
  auto keys = std::make_shared<Keys>();
  for (auto& kv : range.kvs) (*keys)[kv.key] = std::move(kv.value);
  const bool mine = keys->count(key_) != 0;
  changed([&] {
    keys_ = std::move(keys);
    expired_ = expired_ || !mine;
  });
  watch_ = std::move(watch);
}

void Session::apply(const std::vector<Watch::Event>& events) {
  if (events.empty()) return;
  auto keys = std::make_shared<Keys>(*this->keys());
  for (const auto& event : events) {
    if (event.deleted) {
      keys->erase(event.kv.key);
    } else {
      (*keys)[event.kv.key] = event.kv.value;
    }
  }
  const bool mine = keys->count(key_) != 0;
  changed([&] {
    keys_ = std::move(keys);
    expired_ = expired_ || !mine;
  });
}

void Session::send_published() {
  std::string value;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!has_unsent_) return;
    value = unsent_;
  }
  const bool kept = client_.update(key_, value, lease_, create_revision_);
  changed([&] {
    if (unsent_ == value) has_unsent_ = false;  // else publish() gave a newer one meanwhile
    expired_ = expired_ || !kept;
  });
}

void Session::run() {
  auto renew_at = Clock::now() + ttl_ / 3;
  auto retry_at = Clock::now();  // of a failed watch or publish
  Duration retry = kRetryFirst;
  while (!stopping_) {
    const auto now = Clock::now();
    bool pending;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      pending = has_unsent_;
    }
    try {
      if (!expired_ && now >= renew_at) {
        renew_at = now + ttl_ / 3;  // a failure brings it forward (below)
        if (client_.keep_alive(lease_).count() <= 0) changed([&] { expired_ = true; });
        set_reachable(true);
      }
      if (now >= retry_at) {
        if (watch_ == nullptr) sync();
        if (pending && !expired_) send_published();
        set_reachable(true);
        retry = kRetryFirst;
      }
    } catch (const std::exception& e) {  // CommError, or an answer of an unexpected shape
      watch_.reset();  // resynchronize once etcd answers: it may have restarted
      set_reachable(false, e.what());
      retry_at = Clock::now() + retry;
      renew_at = std::min(renew_at, retry_at + retry);
      retry = std::min(retry * 2, kRetryMost);
    }

    // Sleep until the watch has news, publish() or the destructor wakes us, or a timer is due.
    // An expired session only reads the watch: nothing to renew or publish.
    {
      std::unique_lock<std::mutex> lock(mutex_);
      auto until = Clock::now() + kRetryMost;
      if (!expired_) until = std::min(until, renew_at);
      if ((has_unsent_ && !expired_) || watch_ == nullptr) until = std::min(until, std::max(retry_at, Clock::now()));
      wake_.wait_until(lock, until, [&] { return woken_; });
      woken_ = false;
    }
    if (watch_ != nullptr) {
      try {
        apply(watch_->events());
      } catch (const std::exception& e) {
        watch_.reset();
        set_reachable(false, e.what());
        retry_at = Clock::now() + kRetryFirst;
      }
    }
  }
}

}  // namespace shoal::elastic::etcd
