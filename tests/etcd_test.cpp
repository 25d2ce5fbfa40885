// The etcd backend of elastic rendezvous (docs/elastic.md, "The etcd backend"), against a real
// etcd server started here (tests/etcd_server.h). Workers run as threads of this process, except
// those that a test kills or stops: they are forked children (forked before this process has
// threads of its own) that report through a pipe. Each worker hosts a listening TCP socket as its
// "store", which check() probes.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "elastic/etcd/rendezvous.h"
#include "child_process.h"
#include "etcd_server.h"
#include "shoal/core/error.h"

namespace shoal::elastic::etcd {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using Child = shoal::testing::ChildProcess;
using shoal::testing::EtcdServer;

double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

// Milliseconds until pred() holds (checked every 5 ms), or nullopt after `timeout`.
std::optional<double> time_until(const std::function<bool()>& pred, Duration timeout) {
  const auto start = Clock::now();
  while (Clock::now() - start < timeout) {
    if (pred()) return ms_since(start);
    std::this_thread::sleep_for(5ms);
  }
  return std::nullopt;
}

void measured(const std::string& what, double ms) { std::printf("[ measured ] %s: %.0f ms\n", what.c_str(), ms); }

// A listening TCP socket on 127.0.0.1: what a worker's store looks like to check().
class Listener {
 public:
  Listener() : fd_(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)) {
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t size = sizeof(address);
    ::bind(fd_, reinterpret_cast<sockaddr*>(&address), size);
    ::listen(fd_, 16);
    ::getsockname(fd_, reinterpret_cast<sockaddr*>(&address), &size);
    address_ = "127.0.0.1:" + std::to_string(ntohs(address.sin_port));
  }
  ~Listener() { ::close(fd_); }
  const std::string& address() const { return address_; }

 private:
  int fd_;
  std::string address_;
};

// One worker: its store and its rendezvous.
struct Worker {
  Listener store;
  std::unique_ptr<EtcdRendezvous> rendezvous;

  Worker(const EtcdOptions& options, const RendezvousOptions& rounds) {
    Peer self;
    self.host = "localhost";
    self.pid = static_cast<int>(::getpid());
    self.store = store.address();
    rendezvous = std::make_unique<EtcdRendezvous>(options, self, rounds);
  }
  EtcdRendezvous* operator->() { return rendezvous.get(); }
};

std::vector<std::string> ids(const View& view) {
  std::vector<std::string> out;
  for (const auto& p : view.members) out.push_back(p.id);
  return out;
}

struct Outcome {
  std::optional<View> view;
  std::string error;
  double ms = 0;
};

// next() on each worker at once, each in a thread of its own.
std::vector<Outcome> next_together(const std::vector<Worker*>& workers, const std::vector<const View*>& previous,
                                   Duration timeout) {
  std::vector<Outcome> out(workers.size());
  std::vector<std::thread> threads;
  const auto start = Clock::now();
  for (size_t i = 0; i < workers.size(); ++i) {
    threads.emplace_back([&, i] {
      try {
        out[i].view = (*workers[i])->next(previous.empty() ? nullptr : previous[i], timeout);
      } catch (const std::exception& e) {
        out[i].error = e.what();
      }
      out[i].ms = ms_since(start);
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

// Every worker closed the same round with the same members, each at its own place.
void expect_one_round(const std::vector<Outcome>& outcomes, const std::vector<Worker*>& workers, int64_t round) {
  for (size_t i = 0; i < outcomes.size(); ++i) {
    ASSERT_TRUE(outcomes[i].view) << "worker " << i << ": " << outcomes[i].error;
    const View& view = *outcomes[i].view;
    EXPECT_EQ(view.round, round);
    EXPECT_EQ(ids(view), ids(*outcomes[0].view)) << "worker " << i << " closed another view";
    ASSERT_GE(view.rank, 0);
    ASSERT_LT(view.rank, view.size());
    EXPECT_EQ(view.members[view.rank].id, (*workers[i])->id());
  }
}

class EtcdRendezvousTest : public ::testing::Test {
 protected:
  // One etcd for the whole suite; each test has a prefix of its own.
  static void SetUpTestSuite() {
    if (!EtcdServer::program().empty()) etcd_ = new EtcdServer();
  }
  static void TearDownTestSuite() {
    delete etcd_;
    etcd_ = nullptr;
  }
  void SetUp() override {
    if (etcd_ == nullptr) GTEST_SKIP() << "no etcd program (set SHOAL_ETCD)";
  }

  static EtcdOptions options(const EtcdServer& server) {
    EtcdOptions options;
    options.endpoint = server.endpoint();
    options.prefix = std::string("/shoal/") + ::testing::UnitTest::GetInstance()->current_test_info()->name() + "/";
    return options;
  }
  static EtcdOptions options() { return options(*etcd_); }

  static RendezvousOptions rounds(int min, int max, Duration last_call = 300ms, bool quorum = false) {
    RendezvousOptions rounds;
    rounds.min_workers = min;
    rounds.max_workers = max;
    rounds.last_call = last_call;
    rounds.quorum = quorum;
    return rounds;
  }

  static EtcdServer* etcd_;
};

EtcdServer* EtcdRendezvousTest::etcd_ = nullptr;

TEST_F(EtcdRendezvousTest, ThreeWorkersFormRoundOne) {
  std::vector<std::unique_ptr<Worker>> owned;
  std::vector<Worker*> workers;
  for (int i = 0; i < 3; ++i) {
    owned.push_back(std::make_unique<Worker>(options(), rounds(2, 4)));
    workers.push_back(owned.back().get());
  }
  const auto outcomes = next_together(workers, {}, 10s);
  ASSERT_NO_FATAL_FAILURE(expect_one_round(outcomes, workers, 1));
  EXPECT_EQ(outcomes[0].view->size(), 3);
  measured("three workers close round 1 (last call 300 ms)", outcomes[0].ms);
}

TEST_F(EtcdRendezvousTest, TooFewWorkersTimeOut) {
  Worker alone(options(), rounds(2, 4));
  const auto start = Clock::now();
  try {
    alone->next(nullptr, 1s);
    FAIL() << "a round of 1 closed although --min is 2";
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find("round 1 did not close"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("at least 2 workers (--min); 1 are here"), std::string::npos) << e.what();
  }
  const double ms = ms_since(start);
  // Not before the timeout; the upper bound only catches a wait that ignores it.
  EXPECT_GE(ms, 1000);
  EXPECT_LT(ms, 4000);
  measured("CommError for --min after a timeout of 1 s", ms);
}

TEST_F(EtcdRendezvousTest, UnreachableEtcdFailsTheConstructor) {
  std::string endpoint;
  {
    Listener closed;  // nobody listens there once it is closed
    endpoint = closed.address();
  }
  EtcdOptions unreachable = options();
  unreachable.endpoint = endpoint;
  unreachable.connect_timeout = 1s;
  const auto start = Clock::now();
  try {
    Worker worker(unreachable, rounds(1, 1));
    FAIL() << "registered with no etcd";
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find("etcd at " + endpoint + " did not answer"), std::string::npos) << e.what();
  }
  const double ms = ms_since(start);
  EXPECT_GE(ms, 1000);
  EXPECT_LT(ms, 4000);  // a failure bound: it keeps trying for the timeout, not for ever
  measured("CommError for an unreachable etcd (connect timeout 1 s)", ms);
}

TEST_F(EtcdRendezvousTest, KilledMemberIsLeftOutAfterCheck) {
  const EtcdOptions opts = options();
  // --max 3: round 1 closes once all three wait; --min 2: round 2 without the killed one.
  Child child([&](const Child::Say& say) {
    Worker worker(opts, rounds(2, 3, 1s));
    const View view = worker->next(nullptr, 20s);
    say(worker->id() + " " + std::to_string(view.round));
    for (;;) ::pause();
  });
  Worker a(opts, rounds(2, 3, 1s));
  Worker b(opts, rounds(2, 3, 1s));
  const auto first = next_together({&a, &b}, {}, 20s);
  ASSERT_NO_FATAL_FAILURE(expect_one_round(first, {&a, &b}, 1));
  const std::string heard = child.read_line(5s);
  ASSERT_EQ(heard.substr(heard.find(' ') + 1), "1") << heard;
  const std::string child_id = heard.substr(0, heard.find(' '));
  const View round1 = *first[0].view;
  ASSERT_EQ(round1.size(), 3);

  ::kill(child.pid(), SIGKILL);
  ::waitpid(child.pid(), nullptr, 0);
  const auto start = Clock::now();
  // A collective failed: each survivor checks, then forms the next round.
  a->check(round1);
  b->check(round1);
  const double checked = ms_since(start);
  const auto lost = time_until([&] { return !a->lost(round1).empty() && !b->lost(*first[1].view).empty(); }, 5s);
  ASSERT_TRUE(lost) << "the survivors do not see the killed member as lost";
  EXPECT_NE(a->lost(round1).find("whose key in etcd is gone"), std::string::npos) << a->lost(round1);
  const auto second = next_together({&a, &b}, {&*first[0].view, &*first[1].view}, 10s);
  ASSERT_NO_FATAL_FAILURE(expect_one_round(second, {&a, &b}, 2));
  const double ms = ms_since(start);
  EXPECT_EQ(second[0].view->size(), 2);
  for (const auto& p : second[0].view->members) EXPECT_NE(p.id, child_id);
  // A failure bound, below the lease TTL (5 s): without check() the key would go only then.
  EXPECT_LT(ms, 4000);
  measured("check() of 2 stores", checked);
  measured("SIGKILL to lost() on both survivors", *lost + checked);
  measured("SIGKILL to round 2 closed without the killed member", ms);
}

TEST_F(EtcdRendezvousTest, JoinerIsPendingWhenTheRoundHasRoom) {
  Worker a(options(), rounds(2, 3));
  Worker b(options(), rounds(2, 3));
  const auto first = next_together({&a, &b}, {}, 10s);
  ASSERT_NO_FATAL_FAILURE(expect_one_round(first, {&a, &b}, 1));
  const View& round1 = *first[0].view;
  EXPECT_EQ(a->pending_change(round1), "");

  const auto start = Clock::now();
  Worker joiner(options(), rounds(2, 3));
  Outcome joined;
  std::thread waiting([&] {
    try {
      joined.view = joiner->next(nullptr, 10s);
    } catch (const std::exception& e) {
      joined.error = e.what();
    }
  });
  const auto pending =
      time_until([&] { return !a->pending_change(round1).empty() && !b->pending_change(*first[1].view).empty(); }, 5s);
  ASSERT_TRUE(pending) << "the trainers do not see the joiner";
  EXPECT_NE(a->pending_change(round1).find("waits to join"), std::string::npos) << a->pending_change(round1);
  measured("a joiner's constructor to the trainers' pending_change()", ms_since(start));

  const auto second = next_together({&a, &b}, {&*first[0].view, &*first[1].view}, 10s);
  waiting.join();
  ASSERT_TRUE(joined.view) << joined.error;
  ASSERT_NO_FATAL_FAILURE(expect_one_round({second[0], second[1], joined}, {&a, &b, &joiner}, 2));
  EXPECT_EQ(joined.view->rank, 2) << "a newcomer comes after the survivors";
  EXPECT_EQ(ids(*second[0].view)[0], ids(round1)[0]) << "survivors keep their order";
  measured("joiner's next() to round 2 with it", ms_since(start));
}

TEST_F(EtcdRendezvousTest, JoinerIsNotPendingAtMax) {
  Worker a(options(), rounds(2, 2));
  Worker b(options(), rounds(2, 2));
  const auto first = next_together({&a, &b}, {}, 10s);
  ASSERT_NO_FATAL_FAILURE(expect_one_round(first, {&a, &b}, 1));
  Worker joiner(options(), rounds(2, 2));
  std::string error;
  std::thread waiting([&] {
    try {
      joiner->next(nullptr, 1500ms);
    } catch (const CommError& e) {
      error = e.what();
    }
  });
  const auto pending = time_until([&] { return !a->pending_change(*first[0].view).empty(); }, 1s);
  waiting.join();
  EXPECT_FALSE(pending) << a->pending_change(*first[0].view);
  // The joiner did wait, for the trainers of round 1.
  EXPECT_NE(error.find("round 2 did not close"), std::string::npos) << error;
  EXPECT_NE(error.find("to leave round 1"), std::string::npos) << error;
}

TEST_F(EtcdRendezvousTest, LeaveIsSeenAtOnce) {
  Worker a(options(), rounds(3, 3));
  Worker b(options(), rounds(3, 3));
  Worker c(options(), rounds(3, 3));
  const auto first = next_together({&a, &b, &c}, {}, 10s);
  ASSERT_NO_FATAL_FAILURE(expect_one_round(first, {&a, &b, &c}, 1));
  const int leaving = first[2].view->rank;
  const auto start = Clock::now();
  c->leave();
  const double left = ms_since(start);
  const auto seen = time_until([&] { return !a->lost(*first[0].view).empty() && !b->lost(*first[1].view).empty(); }, 5s);
  ASSERT_TRUE(seen);
  EXPECT_NE(a->lost(*first[0].view).find("worker " + std::to_string(leaving) + " (pid"), std::string::npos)
      << a->lost(*first[0].view);
  EXPECT_LT(*seen + left, 3000);  // a failure bound, below the lease TTL (5 s)
  measured("leave() (revoking the lease)", left);
  measured("leave() seen by lost() on both others", *seen + left);
}

TEST_F(EtcdRendezvousTest, EtcdRestartLosesNobody) {
  EtcdServer own;  // restarted here; the suite's server is left alone
  EtcdOptions opts = options(own);
  opts.lease_ttl = 2s;  // shorter than the time etcd is away
  Worker a(opts, rounds(3, 3));
  Worker b(opts, rounds(3, 3));
  Worker c(opts, rounds(3, 3));
  std::vector<Worker*> all{&a, &b, &c};
  const auto first = next_together(all, {}, 10s);
  ASSERT_NO_FATAL_FAILURE(expect_one_round(first, all, 1));
  auto anyone_lost = [&](const std::vector<Outcome>& views) {
    for (size_t i = 0; i < all.size(); ++i) {
      if (std::string text = (*all[i])->lost(*views[i].view); !text.empty()) return text;
    }
    return std::string();
  };

  own.stop();
  const auto down = Clock::now();
  // The next round is asked for while etcd is away: next() waits for it.
  std::vector<Outcome> second;
  std::thread forming([&] { second = next_together(all, {&*first[0].view, &*first[1].view, &*first[2].view}, 30s); });
  std::string lost;
  while (ms_since(down) < 2000 && lost.empty()) {
    lost = anyone_lost(first);
    std::this_thread::sleep_for(20ms);
  }
  EXPECT_EQ(lost, "") << "a member was reported lost while etcd was away";
  const double away = ms_since(down);
  const auto restart = Clock::now();
  own.start();
  const double restarted = ms_since(restart);
  forming.join();
  const double formed = ms_since(restart);
  ASSERT_NO_FATAL_FAILURE(expect_one_round(second, all, 2));
  EXPECT_EQ(ids(*second[0].view), ids(*first[0].view)) << "the same members in the same order";
  // Past a whole lease TTL after the restart, still nobody is lost.
  const auto after = Clock::now();
  while (ms_since(after) < 2500 && lost.empty()) {
    lost = anyone_lost(second);
    std::this_thread::sleep_for(20ms);
  }
  EXPECT_EQ(lost, "") << "a member was lost after etcd came back";
  measured("etcd stopped, until its start", away);
  measured("etcd start until it answered", restarted);
  measured("etcd start until round 2 closed", formed);
}

TEST_F(EtcdRendezvousTest, StoppedMemberIsLostThenRejoins) {
  EtcdOptions opts = options();
  opts.lease_ttl = 2s;
  Child child([&](const Child::Say& say) {
    Worker worker(opts, rounds(2, 3, 1s));
    const View round1 = worker->next(nullptr, 20s);
    say(std::to_string(round1.size()));
    std::string lost;
    while ((lost = worker->lost(round1)).empty()) std::this_thread::sleep_for(20ms);
    const std::string old_id = worker->id();
    const View view = worker->next(&round1, 20s);
    say(lost);
    say(std::string(worker->take_rejoined() ? "rejoined" : "not rejoined") + " " + std::to_string(view.round) + " " +
        std::to_string(view.rank) + " " + (worker->id() != old_id ? "new id" : "same id"));
    for (;;) ::pause();
  });
  Worker a(opts, rounds(2, 3, 1s));
  Worker b(opts, rounds(2, 3, 1s));
  const auto first = next_together({&a, &b}, {}, 20s);
  ASSERT_NO_FATAL_FAILURE(expect_one_round(first, {&a, &b}, 1));
  ASSERT_EQ(child.read_line(5s), "3");

  ::kill(child.pid(), SIGSTOP);
  const auto stopped = Clock::now();
  const auto lost = time_until([&] { return !a->lost(*first[0].view).empty() && !b->lost(*first[1].view).empty(); }, 10s);
  ASSERT_TRUE(lost) << "the stopped member is not lost after 10 s";
  EXPECT_GE(*lost, 1500);
  const auto second = next_together({&a, &b}, {&*first[0].view, &*first[1].view}, 10s);
  ASSERT_NO_FATAL_FAILURE(expect_one_round(second, {&a, &b}, 2));
  EXPECT_EQ(second[0].view->size(), 2);
  const double formed = ms_since(stopped);

  ::kill(child.pid(), SIGCONT);
  const auto resumed = Clock::now();
  const auto pending = time_until([&] { return !a->pending_change(*second[0].view).empty(); }, 10s);
  ASSERT_TRUE(pending) << "the woken member does not wait to join";
  const auto third = next_together({&a, &b}, {&*second[0].view, &*second[1].view}, 10s);
  ASSERT_NO_FATAL_FAILURE(expect_one_round(third, {&a, &b}, 3));
  EXPECT_EQ(third[0].view->size(), 3);
  const std::string self_lost = child.read_line(5s);
  EXPECT_NE(self_lost.find("itself"), std::string::npos) << self_lost;
  EXPECT_EQ(child.read_line(5s), "rejoined 3 2 new id");
  measured("SIGSTOP to lost() on both others (lease TTL 2 s)", *lost);
  measured("SIGSTOP to round 2 closed without it", formed);
  measured("SIGCONT to round 3 closed with it again", ms_since(resumed));
}

TEST_F(EtcdRendezvousTest, QuorumHoldsBackAMinority) {
  Worker a(options(), rounds(1, 3, 300ms, /*quorum=*/true));
  Worker b(options(), rounds(1, 3, 300ms, true));
  Worker c(options(), rounds(1, 3, 300ms, true));
  const auto first = next_together({&a, &b, &c}, {}, 10s);
  ASSERT_NO_FATAL_FAILURE(expect_one_round(first, {&a, &b, &c}, 1));
  // 2 of 3 are a majority: the round closes.
  c->leave();
  const auto second = next_together({&a, &b}, {&*first[0].view, &*first[1].view}, 10s);
  ASSERT_NO_FATAL_FAILURE(expect_one_round(second, {&a, &b}, 2));
  // 1 of 2 is not.
  b->leave();
  const auto start = Clock::now();
  try {
    a->next(&*second[0].view, 1500ms);
    FAIL() << "a round of 1 closed without a quorum";
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find("a quorum (--quorum): more than half of the 2 workers of round 2"),
              std::string::npos)
        << e.what();
  }
  const double ms = ms_since(start);
  EXPECT_GE(ms, 1500);
  EXPECT_LT(ms, 4500);  // a failure bound: the wait ends at its timeout
  measured("CommError for --quorum after a timeout of 1.5 s", ms);
}

}  // namespace
}  // namespace shoal::elastic::etcd
