#include "server.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <fstream>
#include <iostream>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include <httplib.h>

#include "../elastic/token.h"
#include "shoal/core/error.h"

namespace shoal::queue {

using nlohmann::json;

namespace {

std::atomic<httplib::Server*> g_server{nullptr};
volatile sig_atomic_t g_stopped = 0;

void on_scheduler_stop_signal(int) {
  g_stopped = 1;
  if (auto* server = g_server.load()) server->stop();
}

// The largest request body the API reads: a job's spec with its whole environment, or an
// agent's heartbeat.
constexpr size_t kMaxBody = size_t{1} << 20;

void reply(httplib::Response& response, int status, const json& body) {
  response.status = status;
  response.set_content(body.dump(), "application/json");
}

void refuse(httplib::Response& response, int status, const std::string& why) {
  reply(response, status, json{{"error", why}});
}

// Runs `body`, turning the scheduler's errors into the REST API's answers: UsageError is the
// caller's (400, or `missing` for an unknown id), anything else the scheduler's (500).
template <typename Body>
void handle(httplib::Response& response, Body body, int missing = 400) {
  try {
    reply(response, 200, body());
  } catch (const UsageError& e) {
    const std::string what = e.what();
    refuse(response, what.rfind("no job ", 0) == 0 ? missing : 400, what);
  } catch (const json::exception& e) {
    refuse(response, 400, std::string("malformed request: ") + e.what());
  } catch (const std::exception& e) {
    refuse(response, 500, e.what());
  }
}

// The ID of /jobs/ID; an id that is not one is a job that does not exist (404).
int64_t job_id(const std::string& text) {
  try {
    size_t used = 0;
    const long long id = std::stoll(text, &used);
    if (used == text.size() && id > 0) return id;
  } catch (const std::exception&) {
  }
  throw UsageError("no job '" + text + "': a job's id is a positive integer");
}

bool process_alive(pid_t pid) {
  if (pid <= 0 || ::kill(pid, 0) != 0) return false;
  // A zombie (an agent we started and that died) counts as gone.
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  std::getline(stat, line);
  const auto close = line.rfind(')');
  return close == std::string::npos || close + 2 >= line.size() || line[close + 2] != 'Z';
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::string text;
  std::getline(in, text);
  return text;
}

// Where processes on this host reach the scheduler: the address it listens on, or loopback when
// it listens on all of them. The local agent advertises the address on its route to the
// scheduler to the workers of other hosts, so a scheduler whose jobs span hosts listens on the
// address those hosts reach (docs/queue.md, "Agents").
std::string reachable_address(const std::string& bind_host) {
  return bind_host.empty() || bind_host == "0.0.0.0" ? "127.0.0.1" : bind_host;
}

// An integer query parameter of a REST request; `fallback` when absent.
int64_t integer_param(const httplib::Request& request, const std::string& name, int64_t fallback,
                      int64_t low, int64_t high) {
  if (!request.has_param(name.c_str())) return fallback;
  const std::string text = request.get_param_value(name.c_str());
  try {
    size_t used = 0;
    const long long value = std::stoll(text, &used);
    if (used == text.size() && value >= low && value <= high) return value;
  } catch (const std::exception&) {
  }
  throw UsageError(name + " expects an integer from " + std::to_string(low) + " to " +
                   std::to_string(high) + ", not '" + text + "'");
}

// Note [One scheduler per state]
// Two schedulers on one state directory would both adopt its agent, both answer its heartbeats
// and both run the policy, each undoing the other's orders. The first holds an exclusive lock on
// STATE_DIR/lock (flock: the kernel drops it when the process dies, even by SIGKILL, so a
// scheduler started after a kill -9 takes over at once) and keeps its pid and address in the
// file, for the line that refuses a second one. The descriptor is close-on-exec: the local agent,
// which outlives a SIGKILLed scheduler, must not inherit the lock.
class StateLock {
 public:
  explicit StateLock(const std::string& dir) : path_(dir + "/lock") {
    fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd_ < 0) {
      throw UsageError("cannot open " + path_ + ": " + std::strerror(errno) +
                       "; expected a state directory this user may write");
    }
    if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
      std::string holder = read_file(path_);
      ::close(fd_);
      fd_ = -1;
      throw UsageError("another scheduler (" + (holder.empty() ? "starting" : holder) +
                       ") serves the state in " + dir +
                       "; stop it first, or pass another --state-dir");
    }
    describe("pid " + std::to_string(::getpid()));
  }
  ~StateLock() {
    if (fd_ >= 0) ::close(fd_);
  }
  StateLock(const StateLock&) = delete;
  StateLock& operator=(const StateLock&) = delete;

  // What a second scheduler's refusal names: "pid 812, serving on 127.0.0.1:7460".
  void describe(const std::string& holder) {
    const std::string line = holder + "\n";
    if (::ftruncate(fd_, 0) != 0 || ::pwrite(fd_, line.data(), line.size(), 0) < 0) return;
  }

 private:
  std::string path_;
  int fd_ = -1;
};

// Note [Clients cannot stall the scheduler]
// cpp-httplib serves connections from a pool of 8 threads by default, and a connection holds its
// thread until its request is read or its read times out (5 s a read): eight clients that sent
// half a request stalled the API, and thirty starved the agents' heartbeats until the scheduler
// counted its own host lost. Here every connection gets a thread of its own, up to kConnections
// at once (the accept loop waits beyond that), so a slow client holds only its own thread. The
// policy's rounds run on a thread of their own and take the scheduler's lock only between
// requests' reads and writes, never during them.
class ThreadPerConnection : public httplib::TaskQueue {
 public:
  static constexpr size_t kConnections = 256;

  void enqueue(std::function<void()> serve) override {
    std::unique_lock<std::mutex> lock(mutex_);
    room_.wait(lock, [&] { return live_ < kConnections; });
    ++live_;
    std::thread([this, serve = std::move(serve)] {
      serve();
      std::lock_guard<std::mutex> done(mutex_);
      --live_;
      room_.notify_all();
    }).detach();
  }

  // A connection's thread ends within its read timeout and keep-alive wait; the server waits for
  // them (at most 15 s), since each runs the server's code.
  void shutdown() override {
    std::unique_lock<std::mutex> lock(mutex_);
    room_.wait_for(lock, std::chrono::seconds(15), [&] { return live_ == 0; });
  }

 private:
  std::mutex mutex_;
  std::condition_variable room_;
  size_t live_ = 0;
};

// The local agent runs detached (its own session, no death signal): a scheduler that is
// SIGKILLed leaves it and its workers training. A restarted scheduler adopts it.
pid_t start_local_agent(const ServeOptions& options, int port, const std::string& token_file) {
  const std::string dir = options.scheduler.state_dir;
  const std::string pid_file = dir + "/agent.pid";
  const pid_t running = static_cast<pid_t>(std::atoll(read_file(pid_file).c_str()));
  if (process_alive(running)) {
    std::cerr << "shoal queue: adopting the running agent of this host (pid " << running << ")"
              << std::endl;
    return running;
  }
  std::vector<std::string> args = {
      "/proc/self/exe", "agent",
      "--queue",        reachable_address(options.bind_host) + ":" + std::to_string(port),
      "--token-file",   token_file,
      "--dir",          dir + "/agent"};
  if (options.local_slots > 0) {
    args.push_back("--slots");
    args.push_back(std::to_string(options.local_slots));
  }
  std::vector<char*> argv;
  for (auto& arg : args) argv.push_back(arg.data());
  argv.push_back(nullptr);
  const std::string log = dir + "/agent.log";
  const int log_fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  const int null_fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  const pid_t pid = ::fork();
  if (pid < 0) throw UsageError(std::string("fork: ") + std::strerror(errno));
  if (pid == 0) {
    ::setsid();
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    ::dup2(null_fd, 0);
    if (log_fd >= 0) {
      ::dup2(log_fd, 1);
      ::dup2(log_fd, 2);
    }
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  if (log_fd >= 0) ::close(log_fd);
  if (null_fd >= 0) ::close(null_fd);
  std::ofstream(pid_file) << pid << "\n";
  return pid;
}

// Note [Nudges]
// An agent learns its orders from the answer to its heartbeat, every half second: a start, a
// leave or a stop decided just after a beat waited up to 0.5 s for the next (the queue's target
// for a high-priority job's first step is 5 s from its submission). So each heartbeat names a
// UDP port on which its agent listens, and whenever a host's orders change (a round of the
// policy, a submission, a cancellation, another host's heartbeat) the server sends that port
// one empty datagram: the agent beats at once. A nudge carries nothing; a lost one costs the
// old half second, and a forged one only an early heartbeat, which the token still guards.
class Nudges {
 public:
  Nudges() : fd_(::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0)) {}
  ~Nudges() {
    if (fd_ >= 0) ::close(fd_);
  }

  // Where `host`'s agent listens: the heartbeat's source address, the port it named.
  void learn(const std::string& host, const std::string& address, int port) {
    sockaddr_in to{};
    to.sin_family = AF_INET;
    to.sin_port = htons(static_cast<uint16_t>(port));
    if (port <= 0 || port > 65535 || ::inet_pton(AF_INET, address.c_str(), &to.sin_addr) != 1)
      return;
    std::lock_guard<std::mutex> lock(mutex_);
    agents_[host] = to;
  }

  void send(const std::set<std::string>& hosts) {
    if (fd_ < 0 || hosts.empty()) return;
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& host : hosts) {
      auto it = agents_.find(host);
      if (it == agents_.end()) continue;
      ::sendto(fd_, "", 0, MSG_DONTWAIT, reinterpret_cast<const sockaddr*>(&it->second),
               sizeof(it->second));
    }
  }

 private:
  int fd_;
  std::mutex mutex_;
  std::map<std::string, sockaddr_in> agents_;
};

}  // namespace

int serve(const ServeOptions& options) {
  const std::string dir = options.scheduler.state_dir;
  ::mkdir(dir.c_str(), 0700);
  struct stat info {};
  if (::stat(dir.c_str(), &info) != 0 || !S_ISDIR(info.st_mode)) {
    throw UsageError("--state-dir " + dir + " is not a directory that can be made");
  }
  StateLock lock(dir);
  const std::string token_file = options.token_file.empty() ? dir + "/token" : options.token_file;
  std::string token;
  if (::access(token_file.c_str(), F_OK) == 0) {
    token = elastic::read_token_file(token_file, "the queue's token file");
  } else {
    token = elastic::make_token();
    elastic::write_token_file(token_file, token);
  }

  Scheduler scheduler(options.scheduler);
  httplib::Server server;
  server.new_task_queue = [] { return new ThreadPerConnection(); };
  server.set_payload_max_length(kMaxBody);
  // A port in use is an error (SO_REUSEADDR only: cpp-httplib's default adds SO_REUSEPORT, with
  // which two schedulers both listened on 0.0.0.0:7460 and the kernel split the clients).
  server.set_socket_options([](int fd) {
    const int yes = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  // Answers that no handler wrote (an unknown path or method, a body over the limit, a request
  // that is not HTTP) carry the API's one-line JSON error too.
  server.set_error_handler([](const httplib::Request& request, httplib::Response& response) {
    if (!response.body.empty()) return;
    std::string why;
    if (response.status == 404) {
      why = "no such request: " + request.method + " " + request.path +
            "; the REST API is in docs/queue.md";
    } else if (response.status == 413) {
      why = "the request's body is over " + std::to_string(kMaxBody) + " bytes";
    } else {
      why = "malformed HTTP request (status " + std::to_string(response.status) + ")";
    }
    response.set_content(json{{"error", why}}.dump(), "application/json");
  });
  server.set_pre_routing_handler([&](const httplib::Request& request, httplib::Response& response) {
    if (request.path == "/" && request.method == "GET")
      return httplib::Server::HandlerResponse::Unhandled;
    const std::string header = request.get_header_value("Authorization");
    const std::string given =
        header.rfind("Bearer ", 0) == 0 ? header.substr(7) : request.get_param_value("token");
    if (given != token) {
      refuse(response, 401,
             "the queue's token is missing or wrong: pass --token-file or set SHOAL_QUEUE_TOKEN");
      return httplib::Server::HandlerResponse::Handled;
    }
    return httplib::Server::HandlerResponse::Unhandled;
  });
  server.Get("/", [](const httplib::Request&, httplib::Response& response) {
    response.set_content(dashboard_html(), "text/html; charset=utf-8");
  });
  Nudges nudges;
  // A decision that may change orders is carried to the agents at once (Note [Nudges]).
  const auto decide_now = [&] {
    scheduler.tick();
    nudges.send(scheduler.take_news());
  };
  server.Post("/jobs", [&](const httplib::Request& request, httplib::Response& response) {
    handle(response, [&] {
      const int64_t id = scheduler.submit(JobSpec::from_json(json::parse(request.body)));
      decide_now();
      return json{{"id", id}};
    });
  });
  server.Get("/jobs", [&](const httplib::Request&, httplib::Response& response) {
    handle(response, [&] { return scheduler.jobs(); });
  });
  server.Get(R"(/jobs/([^/]+))", [&](const httplib::Request& request, httplib::Response& response) {
    handle(
        response, [&] { return scheduler.job(job_id(request.matches[1])); }, 404);
  });
  server.Delete(R"(/jobs/([^/]+))",
                [&](const httplib::Request& request, httplib::Response& response) {
                  handle(
                      response,
                      [&] {
                        const int64_t id = job_id(request.matches[1]);
                        scheduler.cancel(id);
                        decide_now();
                        return json{{"id", id}, {"state", "cancelled"}};
                      },
                      404);
                });
  server.Get("/nodes", [&](const httplib::Request&, httplib::Response& response) {
    handle(response, [&] { return scheduler.nodes(); });
  });
  server.Get("/events", [&](const httplib::Request& request, httplib::Response& response) {
    handle(response, [&] {
      return scheduler.events(integer_param(request, "since", 0, 0, INT64_MAX),
                              static_cast<int>(integer_param(request, "limit", 1000, 1, 100000)));
    });
  });
  server.Get("/metrics", [&](const httplib::Request&, httplib::Response& response) {
    handle(response, [&] { return scheduler.metrics(); });
  });
  server.Post("/agent/heartbeat",
              [&](const httplib::Request& request, httplib::Response& response) {
                handle(response, [&] {
                  const json report = json::parse(request.body);
                  if (report.contains("nudge_port") && report.contains("host")) {
                    nudges.learn(report.at("host").get<std::string>(), request.remote_addr,
                                 report.at("nudge_port").get<int>());
                  }
                  json orders = scheduler.heartbeat(report);
                  // Its policy round may have changed other hosts' orders.
                  nudges.send(scheduler.take_news());
                  return orders;
                });
              });

  int port = options.port;
  if (port == 0) {
    port = server.bind_to_any_port(options.bind_host.c_str());
  } else if (!server.bind_to_port(options.bind_host.c_str(), port)) {
    throw UsageError("cannot listen on " + options.bind_host + ":" + std::to_string(port) +
                     ": the port is in use or the address is not this host's; pass another "
                     "--port or --host");
  }
  if (port <= 0) throw UsageError("cannot listen on " + options.bind_host);
  lock.describe("pid " + std::to_string(::getpid()) + ", serving on " +
                reachable_address(options.bind_host) + ":" + std::to_string(port));
  {
    const std::string address = dir + "/address";
    std::ofstream(address + ".tmp") << reachable_address(options.bind_host) << ":" << port << "\n";
    ::rename((address + ".tmp").c_str(), address.c_str());
  }

  struct sigaction action {};
  action.sa_handler = on_scheduler_stop_signal;
  sigemptyset(&action.sa_mask);
  ::sigaction(SIGTERM, &action, nullptr);
  ::sigaction(SIGINT, &action, nullptr);
  ::signal(SIGPIPE, SIG_IGN);
  g_server = &server;

  std::cerr << "shoal queue: serving on " << options.bind_host << ":" << port << ", state in "
            << dir << std::endl;
  pid_t agent = -1;
  if (options.local_agent) agent = start_local_agent(options, port, token_file);

  std::atomic<bool> done{false};
  std::thread ticker([&] {
    const auto period = std::chrono::milliseconds(static_cast<int64_t>(options.tick * 1000));
    while (!done) {
      try {
        decide_now();
        // The local agent this scheduler runs is started again if it dies (docs/queue.md,
        // "Agents"); its workers died with it and are replaced as any lost host's are.
        if (agent > 0 && g_stopped == 0 && !process_alive(agent)) {
          ::waitpid(agent, nullptr, WNOHANG);
          std::cerr << "shoal queue: the local agent (pid " << agent
                    << ") ended; starting it again" << std::endl;
          agent = start_local_agent(options, port, token_file);
        }
      } catch (const std::exception& e) {
        std::cerr << "shoal queue: " << e.what() << std::endl;
      }
      std::this_thread::sleep_for(period);
    }
  });
  if (g_stopped == 0) server.listen_after_bind();
  g_server = nullptr;
  done = true;
  ticker.join();
  if (agent > 0) {
    ::kill(agent, SIGTERM);
    for (int i = 0; i < 150 && process_alive(agent); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    ::unlink((dir + "/agent.pid").c_str());
  }
  std::cerr << "shoal queue: stopped" << std::endl;
  return 0;
}

}  // namespace shoal::queue
