#include "comm/shm/sync.h"

#include <linux/futex.h>
#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <ctime>
#include <fstream>
#include <sstream>

#include "shoal/core/error.h"

namespace shoal::comm::shm {
namespace {

constexpr Duration kSlice{10};

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// The process state letter and start time from /proc/<pid>/stat ('\0', 0 when gone).
std::pair<char, uint64_t> stat_of(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(in, line)) return {'\0', 0};
  // The command name, in parentheses, may itself hold spaces and parentheses: fields count from
  // the last ')'.
  const auto close = line.rfind(')');
  if (close == std::string::npos) return {'\0', 0};
  std::istringstream fields(line.substr(close + 1));
  std::string field;
  char state = '\0';
  uint64_t start = 0;
  for (int i = 3; fields >> field; ++i) {
    if (i == 3) state = field[0];
    if (i == 22) {
      start = std::stoull(field);
      break;
    }
  }
  return {state, start};
}

}  // namespace

uint64_t process_start_time(pid_t pid) {
  return stat_of(pid).second;
}

Liveness::~Liveness() {
  for (auto& p : peers_) {
    if (p.pidfd >= 0) ::close(p.pidfd);
  }
}

void Liveness::watch(int member, pid_t pid, uint64_t start_time) {
  const int pidfd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
  // Read after opening: when the start time still matches, the pidfd is the member's process
  // (a pid reused before pidfd_open would show another start time).
  const bool reused = stat_of(pid).second != start_time;
  peers_.push_back({member, pid, start_time, pidfd, reused});
}

pid_t Liveness::pid(int member) const {
  for (auto& p : peers_) {
    if (p.member == member) return p.pid;
  }
  return 0;
}

int Liveness::ended(int member) const {
  std::vector<pollfd> fds;
  for (auto& p : peers_) {
    if (member >= 0 && p.member != member) continue;
    if (p.reused) return p.member;
    if (p.pidfd >= 0) {
      fds.push_back({p.pidfd, POLLIN, 0});
      continue;
    }
    const auto [state, start] = stat_of(p.pid);
    if (state == '\0' || state == 'Z' || state == 'X' || start != p.start_time) return p.member;
  }
  if (fds.empty() || ::poll(fds.data(), fds.size(), 0) <= 0) return -1;
  for (auto& p : peers_) {
    for (auto& f : fds) {
      if (f.fd == p.pidfd && (f.revents & (POLLIN | POLLHUP | POLLERR)) != 0) return p.member;
    }
  }
  return -1;
}

void advance(Counter& c, uint32_t value) {
  c.value.store(value, std::memory_order_seq_cst);
  if (c.waiters.load(std::memory_order_seq_cst) != 0) {
    ::syscall(SYS_futex, &c.value, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
  }
}

void wait_for(Counter& c, uint32_t target, int member, const WaitScope& scope) {
  if (reached(c.value.load(std::memory_order_acquire), target)) return;
  for (int i = 0; i < scope.spins; ++i) {
    cpu_relax();
    if (reached(c.value.load(std::memory_order_acquire), target)) return;
  }
  const std::string prefix = std::string("shared-memory ") + scope.operation + ": ";
  auto who = [&](int m) {
    const pid_t pid = scope.liveness->pid(m);
    return "member " + std::to_string(m) +
           (pid != 0 ? " (pid " + std::to_string(pid) + ")" : std::string(" (not joined yet)"));
  };
  for (;;) {
    SegmentHeader* header = scope.segment->header();
    if (const int failed = header->failed.load(std::memory_order_acquire); failed > 0) {
      throw WaitFailed(
          prefix + "member " + std::to_string(failed - 1) + " failed first: " +
              std::string(header->failure, strnlen(header->failure, sizeof(header->failure))),
          static_cast<FailureKind>(header->failure_kind), header->failure_member, failed - 1);
    }
    if (const int gone = scope.liveness->ended(scope.watch); gone >= 0) {
      throw WaitFailed(prefix + "lost " + who(gone) + ", whose process ended while member " +
                           std::to_string(scope.self) + " waited for member " +
                           std::to_string(member) + " (after " +
                           format_duration(scope.deadline.elapsed()) + ")",
                       FailureKind::kLost, gone);
    }
    if (scope.cancelled != nullptr && scope.cancelled->load(std::memory_order_acquire)) {
      throw CommError(prefix + "abandoned after " + format_duration(scope.deadline.elapsed()) +
                      ": its caller stopped waiting");
    }
    const Duration left = scope.deadline.remaining();
    if (left.count() <= 0) {
      throw WaitFailed(prefix + "timed out after " + format_duration(scope.deadline.timeout()) +
                           " waiting for " + who(member) +
                           " (this member: " + std::to_string(scope.self) + ")",
                       FailureKind::kTimedOut, -1);
    }
    const Duration slice = left < kSlice ? left : kSlice;
    timespec ts{};
    ts.tv_sec = slice.count() / 1000;
    ts.tv_nsec = (slice.count() % 1000) * 1000000L;
    c.waiters.fetch_add(1, std::memory_order_seq_cst);
    const uint32_t seen = c.value.load(std::memory_order_seq_cst);
    if (!reached(seen, target)) {
      ::syscall(SYS_futex, &c.value, FUTEX_WAIT, seen, &ts, nullptr, 0);
    }
    c.waiters.fetch_sub(1, std::memory_order_seq_cst);
    if (reached(c.value.load(std::memory_order_acquire), target)) return;
  }
}

}  // namespace shoal::comm::shm
