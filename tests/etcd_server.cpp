#include "etcd_server.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <vector>

namespace shoal::testing {
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

// Two distinct free ports of 127.0.0.1 (free now: etcd binds them a moment later).
std::pair<int, int> free_ports() {
  int fds[2];
  int ports[2];
  for (int i = 0; i < 2; ++i) {
    fds[i] = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t size = sizeof(address);
    if (fds[i] < 0 || ::bind(fds[i], reinterpret_cast<sockaddr*>(&address), size) != 0 ||
        ::getsockname(fds[i], reinterpret_cast<sockaddr*>(&address), &size) != 0) {
      throw std::runtime_error("EtcdServer: cannot find a free port");
    }
    ports[i] = ntohs(address.sin_port);
  }
  ::close(fds[0]);
  ::close(fds[1]);
  return {ports[0], ports[1]};
}

// GET /health answers {"health":"true"}. One try, at most `timeout`.
bool healthy(int port, std::chrono::milliseconds timeout) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  timeval tv{0, static_cast<suseconds_t>(std::chrono::microseconds(timeout).count())};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(static_cast<uint16_t>(port));
  std::string response;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0) {
    const std::string request = "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
    if (::send(fd, request.data(), request.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(request.size())) {
      char buffer[4096];
      ssize_t n;
      while ((n = ::recv(fd, buffer, sizeof(buffer), 0)) > 0) response.append(buffer, static_cast<size_t>(n));
    }
  }
  ::close(fd);
  return response.find("\"health\":\"true\"") != std::string::npos;
}

std::string tail(const std::string& path, size_t bytes) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  const std::string all = text.str();
  return all.size() > bytes ? "..." + all.substr(all.size() - bytes) : all;
}

}  // namespace

std::string EtcdServer::program() {
  if (const char* set = std::getenv("SHOAL_ETCD"); set != nullptr && *set != '\0') return set;
  if (::access("/usr/bin/etcd", X_OK) == 0) return "/usr/bin/etcd";
  const char* path = std::getenv("PATH");
  std::stringstream dirs(path != nullptr ? path : "");
  for (std::string dir; std::getline(dirs, dir, ':');) {
    if (!dir.empty() && ::access((dir + "/etcd").c_str(), X_OK) == 0) return dir + "/etcd";
  }
  return "";
}

EtcdServer::EtcdServer(std::chrono::milliseconds timeout) {
  if (program().empty()) throw std::runtime_error("EtcdServer: no etcd program (set SHOAL_ETCD)");
  std::string pattern = (std::filesystem::temp_directory_path() / "shoal-etcd-XXXXXX").string();
  if (::mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("EtcdServer: mkdtemp failed");
  directory_ = pattern;
  // Another process may take a port between free_ports() and etcd's bind: then try others.
  for (int attempt = 1;; ++attempt) {
    std::tie(client_port_, peer_port_) = free_ports();
    try {
      start(timeout);
      return;
    } catch (const std::runtime_error&) {
      kill();
      std::filesystem::remove_all(directory_ + "/data");
      if (attempt == 3) {
        std::filesystem::remove_all(directory_);
        throw;
      }
    }
  }
}

EtcdServer::~EtcdServer() {
  kill();
  std::error_code ignored;
  std::filesystem::remove_all(directory_, ignored);
}

std::string EtcdServer::endpoint() const { return "127.0.0.1:" + std::to_string(client_port_); }

void EtcdServer::start(std::chrono::milliseconds timeout) {
  if (running()) return;
  launch();
  wait_until_ready(timeout);
}

void EtcdServer::launch() {
  const std::string client = "http://127.0.0.1:" + std::to_string(client_port_);
  const std::string peer = "http://127.0.0.1:" + std::to_string(peer_port_);
  // A short election timeout: a single member elects itself at once (and its minimum lease TTL,
  // 1.5 election timeouts, stays at 1 s).
  std::vector<std::string> args = {program(),
                                   "--name=shoal-test",
                                   "--data-dir=" + directory_ + "/data",
                                   "--listen-client-urls=" + client,
                                   "--advertise-client-urls=" + client,
                                   "--listen-peer-urls=" + peer,
                                   "--initial-advertise-peer-urls=" + peer,
                                   "--initial-cluster=shoal-test=" + peer,
                                   "--heartbeat-interval=50",
                                   "--election-timeout=500",
                                   "--logger=zap",
                                   "--log-outputs=stderr"};
  const std::string log = directory_ + "/etcd.log";
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error("EtcdServer: fork failed");
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(1);
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd >= 0) {
      ::dup2(fd, STDOUT_FILENO);
      ::dup2(fd, STDERR_FILENO);
    }
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  pid_ = pid;
}

void EtcdServer::wait_until_ready(std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (Clock::now() < deadline) {
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      throw std::runtime_error("EtcdServer: etcd exited at start; its log:\n" + tail(directory_ + "/etcd.log", 2000));
    }
    if (healthy(client_port_, 500ms)) return;
    std::this_thread::sleep_for(20ms);
  }
  throw std::runtime_error("EtcdServer: etcd did not answer within " + std::to_string(timeout.count()) +
                           " ms; its log:\n" + tail(directory_ + "/etcd.log", 2000));
}

void EtcdServer::signal_and_wait(int signal, std::chrono::milliseconds grace) {
  if (!running()) return;
  ::kill(pid_, signal);
  const auto deadline = Clock::now() + grace;
  int status = 0;
  while (::waitpid(pid_, &status, WNOHANG) == 0) {
    if (Clock::now() >= deadline) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, &status, 0);
      break;
    }
    std::this_thread::sleep_for(5ms);
  }
  pid_ = -1;
}

void EtcdServer::stop() { signal_and_wait(SIGTERM, 5s); }

void EtcdServer::kill() { signal_and_wait(SIGKILL, 5s); }

}  // namespace shoal::testing
