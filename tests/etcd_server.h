// A real etcd server for tests: one member on free ports of 127.0.0.1, with a temporary
// directory of its own (data in <directory>/data, its log in <directory>/etcd.log). No torch
// and no shoal library needed.
//
//   EtcdServer etcd;                        // started, and answering
//   options.endpoint = etcd.endpoint();     // "127.0.0.1:PORT"
//   etcd.stop(); ...; etcd.start();         // a restart: same ports, same data
//
// The server is a child of the thread that constructs the EtcdServer and gets SIGKILL when that
// thread ends (PR_SET_PDEATHSIG): construct it on the main thread, or on one that outlives its use.
// A forked child process must leave with _exit(), so that it does not run this destructor.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <string>

namespace shoal::testing {

class EtcdServer {
 public:
  // The etcd program: $SHOAL_ETCD, else /usr/bin/etcd, else etcd on PATH; "" when there is none
  // (tests then skip).
  static std::string program();

  // Starts etcd and waits until it answers (GET /health). std::runtime_error with the end of its
  // log when it does not within `timeout`.
  explicit EtcdServer(std::chrono::milliseconds timeout = std::chrono::seconds(30));
  // Kills the server (SIGKILL) and removes its directory.
  ~EtcdServer();
  EtcdServer(const EtcdServer&) = delete;
  EtcdServer& operator=(const EtcdServer&) = delete;

  // "127.0.0.1:PORT" of the client URL; the same after a restart.
  std::string endpoint() const;
  // SIGTERM, and waits until the server exits (SIGKILL after 5 s).
  void stop();
  // SIGKILL, and waits until the server exits.
  void kill();
  // Starts it again (after stop() or kill()) on the same ports and data, and waits until it
  // answers, as the constructor does.
  void start(std::chrono::milliseconds timeout = std::chrono::seconds(30));

  bool running() const { return pid_ > 0; }
  pid_t pid() const { return pid_; }
  const std::string& directory() const { return directory_; }

 private:
  void launch();
  void wait_until_ready(std::chrono::milliseconds timeout);
  void signal_and_wait(int signal, std::chrono::milliseconds grace);

  std::string directory_;
  int client_port_ = 0;
  int peer_port_ = 0;
  pid_t pid_ = -1;
};

}  // namespace shoal::testing
