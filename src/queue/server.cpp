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
#include <fstream>
#include <iostream>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include <httplib.h>

#include "heartbeat.h"
#include "listener.h"
#include "tls.h"
#include "shoal/core/error.h"
#include "core/log.h"

namespace shoal::queue {

using nlohmann::json;

namespace {

std::atomic<Listener*> g_listeners[2] = {nullptr, nullptr};
volatile sig_atomic_t g_stopped = 0;

void on_scheduler_stop_signal(int) {
  g_stopped = 1;
  for (auto& listener : g_listeners) {
    if (Listener* l = listener.load()) l->stop();
  }
}

// A request its sender may not make (403).
class Forbidden : public UsageError {
 public:
  using UsageError::UsageError;
};

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
  } catch (const Forbidden& e) {
    refuse(response, 403, e.what());
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
  if (auto id = parse_job_id(text)) return *id;
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
  if (auto value = parse_integer(text, low, high)) return *value;
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

// The local agent runs detached (its own session, no death signal): a scheduler that is
// SIGKILLed leaves it and its workers training. A restarted scheduler adopts it.
pid_t start_local_agent(const ServeOptions& options, const std::string& agent_address,
                        const std::string& token_file, const std::string& ca_file) {
  const std::string dir = options.scheduler.state_dir;
  const std::string pid_file = dir + "/agent.pid";
  const pid_t running = static_cast<pid_t>(std::atoll(read_file(pid_file).c_str()));
  if (process_alive(running)) {
    log::info(
        log::line("shoal queue: adopting the running agent of this host (pid ", running, ")"));
    return running;
  }
  std::vector<std::string> args = {
      "/proc/self/exe", "agent",
      "--queue",        agent_address,
      "--token-file",   token_file,
      "--dir",          dir + "/agent"};
  if (!ca_file.empty()) {
    args.push_back("--ca-cert");
    args.push_back(ca_file);
  }
  if (options.access.allow_root_jobs) args.push_back("--allow-root-workers");
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

// The bearer token of a request: its Authorization header (never its URL: Note [Tokens out of
// URLs], src/queue/access.h).
std::string bearer(const httplib::Request& request) {
  const std::string header = request.get_header_value("Authorization");
  return header.rfind("Bearer ", 0) == 0 ? header.substr(7) : std::string();
}

std::string cookie(const httplib::Request& request, const std::string& name) {
  const std::string header = request.get_header_value("Cookie");
  for (size_t at = 0; at < header.size();) {
    const size_t end = std::min(header.find(';', at), header.size());
    std::string pair = header.substr(at, end - at);
    pair.erase(0, pair.find_first_not_of(' '));
    if (pair.rfind(name + "=", 0) == 0) return pair.substr(name.size() + 1);
    at = end + 1;
  }
  return "";
}

void write_address(const std::string& path, const std::string& address) {
  std::ofstream(path + ".tmp") << address << "\n";
  ::rename((path + ".tmp").c_str(), path.c_str());
}

bool loopback(const std::string& host) {
  return host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1";
}

constexpr const char* kLoginPage = R"HTML(<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>shoal queue: log in</title></head>
<body style="font: 14px sans-serif; margin: 24px">
<h1 style="font-size: 20px">shoal queue</h1>
<p>Open the link that <code>shoal queue dashboard</code> prints, or paste a token of the queue.</p>
<form method="post" action="/login"><input type="password" name="token" size="40" autofocus>
<button>Log in</button></form></body></html>
)HTML";

}  // namespace

int serve(const ServeOptions& options) {
  const std::string dir = options.scheduler.state_dir;
  ::mkdir(dir.c_str(), 0700);
  struct stat info {};
  if (::stat(dir.c_str(), &info) != 0 || !S_ISDIR(info.st_mode)) {
    throw UsageError("--state-dir " + dir + " is not a directory that can be made");
  }
  StateLock lock(dir);
  AccessOptions access_options = options.access;
  access_options.state_dir = dir;
  Access access(access_options);
  Sessions sessions;
  if (options.tls != "auto" && options.tls != "on" && options.tls != "off")
    throw UsageError("--tls expects auto, on or off, not '" + options.tls + "'");
  // A certificate given is one to serve: --tls auto turns on with it even on loopback, and --tls
  // off beside it is a contradiction rather than a flag silently ignored.
  if (options.tls == "off" && !options.tls_cert.empty())
    throw UsageError("--tls off with --tls-cert; expected one of them");
  const bool tls = options.tls == "on" ||
                   (options.tls == "auto" && (!loopback(options.bind_host) || !options.tls_cert.empty()));
  TlsFiles certificate{options.tls_cert, options.tls_key};
  if (tls && certificate.cert.empty()) certificate = ensure_certificate(dir + "/tls");
  Scheduler scheduler(options.scheduler);
  // Other users may pass through the state directory to their jobs' own directories
  // (STATE_DIR/jobs/ID, theirs), and read nothing else of it.
  ::chmod(dir.c_str(), 0711);
  for (const char* file : {"/queue.db", "/queue.db-wal", "/queue.db-shm"})
    ::chmod((dir + file).c_str(), 0600);
  Listener api({options.bind_host, options.port, "--port", 256, kMaxBody, certificate.cert,
                certificate.key});
  Listener agents({options.bind_host, options.agent_port, "--agent-port", 64, kMaxBody,
                   certificate.cert, certificate.key});
  httplib::Server& server = api.http();

  // Who sent a request to the users' API: the admin or a user, by the token in its header or
  // its session cookie. The agents' token is not one of them.
  const auto principal = [&](const httplib::Request& request) -> std::optional<Principal> {
    std::optional<Principal> who = access.identify(bearer(request));
    if (!who) {
      const std::string session = cookie(request, "shoal_session");
      if (!session.empty()) who = sessions.find(session);
    }
    if (who && who->kind == Principal::kAgent) return std::nullopt;
    return who;
  };
  const auto must_be = [&](const httplib::Request& request) {
    std::optional<Principal> who = principal(request);
    if (!who) throw UsageError("the request's credentials ended");  // checked at routing
    return *who;
  };
  server.set_pre_routing_handler([&](const httplib::Request& request, httplib::Response& response) {
    if (request.path == "/login") return httplib::Server::HandlerResponse::Unhandled;
    if (principal(request)) return httplib::Server::HandlerResponse::Unhandled;
    if (request.path == "/" && request.method == "GET") {
      response.set_redirect("/login");
      return httplib::Server::HandlerResponse::Handled;
    }
    refuse(response, 401,
           "the queue's token is missing or wrong: pass --token-file or set SHOAL_QUEUE_TOKEN");
    return httplib::Server::HandlerResponse::Handled;
  });
  const auto start_session = [&](httplib::Response& response, const std::string& session) {
    response.set_header("Set-Cookie", "shoal_session=" + session +
                                          "; Path=/; HttpOnly; SameSite=Strict; Max-Age=43200" +
                                          (tls ? "; Secure" : ""));
    response.set_redirect("/");
  };
  server.Get("/", [](const httplib::Request&, httplib::Response& response) {
    response.set_content(dashboard_html(), "text/html; charset=utf-8");
  });
  server.Get("/login", [&](const httplib::Request& request, httplib::Response& response) {
    if (!request.has_param("code")) {
      response.set_content(kLoginPage, "text/html; charset=utf-8");
      return;
    }
    if (auto session = sessions.redeem(request.get_param_value("code"))) {
      start_session(response, *session);
    } else {
      refuse(response, 401,
             "the login code is unknown, spent or expired; `shoal queue dashboard` prints a new "
             "one");
    }
  });
  server.Post("/login", [&](const httplib::Request& request, httplib::Response& response) {
    std::optional<Principal> who = access.identify(request.get_param_value("token"));
    if (!who || who->kind == Principal::kAgent) {
      refuse(response, 401, "the queue's token is missing or wrong");
      return;
    }
    start_session(response, sessions.open(*who));
  });
  server.Post("/login/code", [&](const httplib::Request& request, httplib::Response& response) {
    handle(response, [&] {
      const std::string code = sessions.code_for(must_be(request));
      return json{{"code", code}, {"path", "/login?code=" + code}};
    });
  });

  const auto admin_only = [&](const httplib::Request& request) {
    if (must_be(request).kind != Principal::kAdmin)
      throw Forbidden("only the queue's admin may manage users");
  };
  server.Get("/users", [&](const httplib::Request& request, httplib::Response& response) {
    handle(response, [&] {
      admin_only(request);
      return access.users();
    });
  });
  server.Post("/users", [&](const httplib::Request& request, httplib::Response& response) {
    handle(response, [&] {
      admin_only(request);
      const json body = json::parse(request.body);
      const std::string name = body.at("name");
      const std::string token = access.add_user(name, body.value("run_as", std::string()),
                                                body.value("allow_root", false));
      return json{{"name", name}, {"token", token}};
    });
  });
  server.Delete(R"(/users/([^/]+))",
                [&](const httplib::Request& request, httplib::Response& response) {
                  handle(response, [&] {
                    admin_only(request);
                    access.remove_user(request.matches[1]);
                    return json{{"name", std::string(request.matches[1])}, {"removed", true}};
                  });
                });

  Nudges nudges;
  // A decision that may change orders is carried to the agents at once (Note [Nudges]).
  const auto decide_now = [&] {
    scheduler.tick();
    nudges.send(scheduler.take_news());
  };
  server.Post("/jobs", [&](const httplib::Request& request, httplib::Response& response) {
    handle(response, [&] {
      const Principal who = must_be(request);
      Submission spec = Submission::from_json(json::parse(request.body));
      spec.owner = who.name;
      spec.run_as = access.authorize(who, spec.argv.at(0));
      const int64_t id = scheduler.submit(spec);
      decide_now();
      return json{{"id", id}};
    });
  });
  server.Get("/jobs", [&](const httplib::Request&, httplib::Response& response) {
    handle(response, [&] { return json{{"jobs", scheduler.jobs()}}; });
  });
  server.Get(R"(/jobs/([^/]+))", [&](const httplib::Request& request, httplib::Response& response) {
    handle(
        response, [&] { return json(scheduler.job(job_id(request.matches[1]))); }, 404);
  });
  server.Delete(R"(/jobs/([^/]+))",
                [&](const httplib::Request& request, httplib::Response& response) {
                  handle(
                      response,
                      [&] {
                        const int64_t id = job_id(request.matches[1]);
                        const Principal who = must_be(request);
                        const std::string owner = scheduler.job(id).owner;
                        if (who.kind != Principal::kAdmin && owner != who.name) {
                          throw Forbidden("job " + std::to_string(id) + " is " + owner +
                                          "'s; only its owner or the admin may cancel it");
                        }
                        scheduler.cancel(id);
                        decide_now();
                        return json{{"id", id}, {"state", "cancelled"}};
                      },
                      404);
                });
  server.Get("/nodes", [&](const httplib::Request&, httplib::Response& response) {
    handle(response, [&] { return json{{"nodes", scheduler.nodes()}}; });
  });
  server.Get("/events", [&](const httplib::Request& request, httplib::Response& response) {
    handle(response, [&] {
      const std::vector<EventInfo> events =
          scheduler.events(integer_param(request, "since", 0, 0, INT64_MAX),
                           static_cast<int>(integer_param(request, "limit", 1000, 1, 100000)));
      return json{{"events", events}};
    });
  });
  server.Get("/metrics", [&](const httplib::Request&, httplib::Response& response) {
    handle(response, [&] { return json(scheduler.metrics()); });
  });

  // The agents' listener: heartbeats, with the agents' token only.
  agents.http().set_pre_routing_handler([&](const httplib::Request& request,
                                            httplib::Response& response) {
    std::optional<Principal> who = access.identify(bearer(request));
    if (who && who->kind == Principal::kAgent) return httplib::Server::HandlerResponse::Unhandled;
    refuse(response, 401,
           "the agents' token is missing or wrong: pass shoal agent --token-file with a copy of "
           "the scheduler's STATE_DIR/agent-token");
    return httplib::Server::HandlerResponse::Handled;
  });
  agents.http().Post("/agent/heartbeat",
                     [&](const httplib::Request& request, httplib::Response& response) {
                       handle(response, [&] {
                         // Read whole before anything is applied: a malformed report is refused
                         // with one line (Note [A heartbeat is read whole], heartbeat.h).
                         const auto report = json::parse(request.body).get<HeartbeatReport>();
                         nudges.learn(report.host, request.remote_addr, report.nudge_port);
                         json orders = scheduler.heartbeat(report);
                         // Its policy round may have changed other hosts' orders.
                         nudges.send(scheduler.take_news());
                         return orders;
                       });
                     });

  const int port = api.port();
  const int agent_port = agents.port();
  // Clients find the scheme in the address files: https:// when TLS is on.
  const std::string scheme = tls ? "https://" : "";
  const std::string here = reachable_address(options.bind_host);
  const std::string address = scheme + here + ":" + std::to_string(port);
  const std::string agent_address = scheme + here + ":" + std::to_string(agent_port);
  lock.describe("pid " + std::to_string(::getpid()) + ", serving on " + address);
  write_address(dir + "/address", address);
  write_address(dir + "/agent-address", agent_address);

  struct sigaction action {};
  action.sa_handler = on_scheduler_stop_signal;
  sigemptyset(&action.sa_mask);
  ::sigaction(SIGTERM, &action, nullptr);
  ::sigaction(SIGINT, &action, nullptr);
  ::signal(SIGPIPE, SIG_IGN);
  g_listeners[0] = &api;
  g_listeners[1] = &agents;

  log::info(log::line("shoal queue: serving on ", scheme, options.bind_host, ":", port,
                      " (agents on ", agent_port, "), state in ", dir));
  pid_t agent = -1;
  const std::string agent_token_file = access.agent_token_file();
  const auto local_agent = [&] {
    return start_local_agent(options, agent_address, agent_token_file, certificate.cert);
  };
  if (options.local_agent) agent = local_agent();

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
          log::warn(
              log::line("shoal queue: the local agent (pid ", agent, ") ended; starting it again"));
          agent = local_agent();
        }
      } catch (const std::exception& e) {
        log::warn(log::line("shoal queue: ", e.what()));
      }
      std::this_thread::sleep_for(period);
    }
  });
  std::thread agents_thread([&] {
    if (g_stopped == 0) agents.serve();
  });
  if (g_stopped == 0) api.serve();
  agents.stop();
  agents_thread.join();
  g_listeners[0] = g_listeners[1] = nullptr;
  done = true;
  ticker.join();
  if (agent > 0) {
    ::kill(agent, SIGTERM);
    for (int i = 0; i < 150 && process_alive(agent); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    ::unlink((dir + "/agent.pid").c_str());
  }
  log::info(log::line("shoal queue: stopped"));
  return 0;
}

}  // namespace shoal::queue
