#include "launcher.h"

#include <poll.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <thread>

#include "elastic_agent.h"
#include "job_store.h"
#include "nodes.h"
#include "proc/process.h"
#include "ps/serve.h"
#include "shoal/core/error.h"
#include "signals.h"
#include "watchdog.h"
#include "worker.h"
#include "proc/worker_env.h"

namespace shoal::launch {
namespace {

using Clock = std::chrono::steady_clock;

// After the last worker is reaped, how long its output may still arrive: its process group was
// SIGKILLed, so only a descendant that left the group can hold a pipe open this long.
constexpr Duration kDrainLimit{2000};
// After SIGKILL, how long to wait for workers to be reaped before giving up on them.
constexpr Duration kKillLimit{5000};
// The longest poll() sleeps: a safety net that reaps even if a SIGCHLD were missed.
constexpr Duration kMaxSleep{1000};

// Pumps one worker stream; at its EOF, writes its last incomplete line and closes it.
void forward(proc::Fd& pipe, LineForwarder& lines, int max_reads) {
  if (pipe.valid() && !pump(pipe, lines, max_reads)) {
    lines.finish();
    pipe.reset();
  }
}

}  // namespace

Launcher::Launcher(LaunchOptions options)
    : options_(std::move(options)), out_(STDOUT_FILENO), err_(STDERR_FILENO) {}

Launcher::~Launcher() {
  for (auto& worker : workers_) {
    if (worker->running()) proc::signal_group(worker->pid, SIGKILL);
  }
}

void Launcher::say(const std::string& message) { err_.write("shoal run: " + message + "\n"); }

int Launcher::run() {
  signals_ = std::make_unique<SignalSet>();
  watchdog_ = std::make_unique<Watchdog>();
  // Descendants that a worker orphans are re-parented to us rather than to init, so we reap
  // them, and can kill those that left their worker's process group (kill_leftovers).
  ::prctl(PR_SET_CHILD_SUBREAPER, 1);
  if (options_.elastic && options_.servers == 0) return run_elastic();
  if (ps_elastic() && options_.joins()) return run_ps_join();
  const std::string own_run_id = make_run_id();
  try {
    store_ = open_job_store(options_, *signals_, own_run_id);
  } catch (const Interrupted& interrupted) {
    say("received " + proc::signal_name(interrupted.signal()) + " before the workers started");
    return 128 + interrupted.signal();
  }
  nodes_ = std::make_unique<NodeGroup>(*store_, options_, *signals_, err_);
  const std::string node = "node " + std::to_string(options_.node_rank);
  try {
    // Every node's workers connect to every server: the nodes must agree on them.
    if (options_.servers > 0) choose_ps_token();
    if (options_.nnodes > 1 && options_.hosts_store()) store_->put(kServersKey, servers_flags());
    const std::string run_id = nodes_->join(own_run_id);
    if (options_.nnodes > 1 && !options_.hosts_store()) check_servers_flags();
    if (options_.servers > 0) adopt_ps_token();
    if (options_.servers > 0) start_servers(run_id, store_->port());
    start_workers(run_id, store_->port());
    // After the first workers are counted: a launcher that joins finds the room they left.
    if (ps_elastic()) publish_ps_job();
  } catch (const Interrupted& interrupted) {
    say("received " + proc::signal_name(interrupted.signal()) + " before the workers started");
    nodes_->report_failure(node + "'s launcher received " + proc::signal_name(interrupted.signal()));
    nodes_->finish();
    return 128 + interrupted.signal();
  } catch (const Error& e) {
    nodes_->report_failure(node + ": " + e.what());
    nodes_->finish();
    throw;
  }
  supervise();
  kill_leftovers();
  const std::string failure = nodes_->finish();
  if (exit_code_ == 0 && !failure.empty()) {
    say("the job failed on another node: " + failure);
    return 1;
  }
  // An elastic job whose training finished succeeds, whatever workers it lost on the way.
  if (ps_elastic() && !stopping_ && any_success_) return 0;
  return exit_code_;
}

void Launcher::start_workers(const std::string& run_id, int port) {
  env::Environment base = env::current();
  if (options_.servers > 0) add_ps_environment(base);
  for (int i = 0; i < options_.nproc_per_node; ++i) {
    proc::WorkerPlace place;
    place.local_rank = i;
    place.local_world_size = options_.nproc_per_node;
    place.node_rank = options_.node_rank;
    place.nnodes = options_.nnodes;
    place.master_addr = options_.master_addr();
    place.master_port = port;
    place.run_id = run_id;
    const std::string prefix =
        options_.tags_output() ? "[" + std::to_string(place.rank()) + "] " : std::string();
    auto worker = std::make_unique<Worker>(i, place.rank(), prefix, out_, err_);
    worker->envp = proc::to_envp(proc::worker_environment(base, place));
    if (ps_elastic()) set_ps_worker(*worker);
    try {
      if (ps_elastic()) reserve_workers(1);  // fits: -n <= --max, and no launcher joined yet
      spawn(*worker);
    } catch (const Error& e) {
      if (workers_.empty()) throw;  // nothing started: a plain usage error
      say(std::string(e.what()) + "; stopping the other workers");
      nodes_->report_failure("node " + std::to_string(options_.node_rank) + ": " + e.what());
      exit_code_ = 2;
      begin_stop(SIGTERM);
      return;
    }
    workers_.push_back(std::move(worker));
  }
}

void Launcher::spawn(Worker& worker) {
  std::vector<std::string> argv{options_.program};
  argv.insert(argv.end(), options_.program_args.begin(), options_.program_args.end());
  proc::ProcessSpec spec;
  spec.path = options_.program_path;
  if (worker.server) {
    argv = {"shoal", "ps-server", "--index", std::to_string(worker.rank)};
    argv.insert(argv.end(), worker.server_args.begin(), worker.server_args.end());
    spec.path = "/proc/self/exe";
  }
  spec.argv = argv;
  spec.env = worker.envp;
  spec.signal_mask = signals_->original_mask();
  proc::ChildProcess child;
  pid_t watched = -1;
  try {
    // See Note [No orphans] (watchdog.h): the guard learns the group before the program runs.
    child = proc::start_process(spec, [&](pid_t group) { watchdog_->watch(watched = group); });
  } catch (const Error&) {
    if (watched > 0) watchdog_->forget(watched);  // the child was reaped: the group is gone
    throw;
  }
  worker.pid = child.pid;
  worker.exit.reset();
  worker.out = std::move(child.stdout_pipe);
  worker.err = std::move(child.stderr_pipe);
}

bool Launcher::any_running() const {
  return std::any_of(workers_.begin(), workers_.end(), [](const auto& w) { return w->running(); });
}

void Launcher::signal_running(int signal, bool group) {
  for (auto& worker : workers_) {
    if (!worker->running()) continue;
    if (group) {
      proc::signal_group(worker->pid, signal);
    } else {
      ::kill(worker->pid, signal);
    }
  }
}

void Launcher::begin_stop(int signal) {
  if (stopping_) return;
  stopping_ = true;
  signal_running(signal);
  kill_at_ = Clock::now() + options_.stop_grace;
}

void Launcher::supervise() {
  const bool several_nodes = options_.nnodes > 1;
  TimePoint next_check = Clock::now() + NodeGroup::kCheckInterval;
  std::optional<TimePoint> drain_until;
  std::vector<pollfd> fds;
  std::vector<std::pair<Worker*, bool>> owners;  // (worker, is stderr) for fds[1...]

  for (;;) {
    reap();
    if (options_.elastic) restart_due(Clock::now());
    const TimePoint now = Clock::now();
    const bool running = any_running() || next_restart().has_value();
    const bool open_pipes = std::any_of(workers_.begin(), workers_.end(), [](const auto& w) {
      return w->out.valid() || w->err.valid();
    });
    if (!running) {
      if (!open_pipes) break;
      if (!drain_until) drain_until = now + kDrainLimit;
      if (now >= *drain_until) {
        for (auto& worker : workers_) close_output(*worker);
        break;
      }
    }
    if (kill_at_ && now >= *kill_at_) {
      signal_running(SIGKILL);
      kill_at_.reset();
      give_up_at_ = now + kKillLimit;
    }
    if (give_up_at_ && now >= *give_up_at_ && running) {
      say("some workers did not end within " + format_duration(kKillLimit) +
          " of SIGKILL; leaving them");
      break;
    }
    if ((several_nodes || ps_elastic()) && now >= next_check) {
      if (several_nodes) {
        check_nodes();
      } else if (options_.joins()) {
        publish_joiner();
      } else if (options_.servers > 0) {
        watch_joiners();
        stop_servers_after_workers();  // once the joined launchers' workers are done too
      }
      next_check = Clock::now() + NodeGroup::kCheckInterval;
    }

    TimePoint wake = now + kMaxSleep;
    if (several_nodes || ps_elastic()) wake = std::min(wake, next_check);
    for (const auto& at : {kill_at_, give_up_at_, drain_until, next_restart()}) {
      if (at) wake = std::min(wake, *at);
    }
    const auto sleep = std::chrono::duration_cast<Duration>(wake - Clock::now()).count();

    fds.assign(1, pollfd{signals_->fd(), POLLIN, 0});
    owners.assign(1, {nullptr, false});
    for (auto& worker : workers_) {
      if (worker->out.valid()) {
        fds.push_back(pollfd{worker->out.get(), POLLIN, 0});
        owners.emplace_back(worker.get(), false);
      }
      if (worker->err.valid()) {
        fds.push_back(pollfd{worker->err.get(), POLLIN, 0});
        owners.emplace_back(worker.get(), true);
      }
    }
    if (::poll(fds.data(), fds.size(), static_cast<int>(std::max<int64_t>(sleep, 0))) < 0) continue;

    // Output first: a worker's last lines come before the launcher's verdict on its exit.
    for (size_t i = 1; i < fds.size(); ++i) {
      if (fds[i].revents == 0) continue;
      Worker& worker = *owners[i].first;
      if (owners[i].second) {
        forward(worker.err, worker.err_lines, 8);
      } else {
        forward(worker.out, worker.out_lines, 8);
      }
    }
    if (fds[0].revents != 0) {
      for (int signal : signals_->take()) {
        if (signal != SIGCHLD) on_signal(signal);  // SIGCHLD: reap() at the top of the loop
      }
    }
  }
}

void Launcher::reap() {
  for (;;) {
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid <= 0) return;
    // Anything else reaped is an orphaned descendant (we are a subreaper) or the guard.
    for (auto& worker : workers_) {
      if (worker->pid == pid && !worker->exit) {
        on_exit(*worker, proc::ExitStatus::from_wait_status(status));
        break;
      }
    }
  }
}

void Launcher::drain(Worker& worker) {
  // Everything the worker itself wrote is in the pipes by now (a pipe holds 64 KiB unless
  // enlarged); read it without waiting, and without chasing a descendant that keeps writing.
  forward(worker.out, worker.out_lines, 16);
  forward(worker.err, worker.err_lines, 16);
}

void Launcher::close_output(Worker& worker) {
  if (worker.out.valid()) {
    worker.out_lines.finish();
    worker.out.reset();
  }
  if (worker.err.valid()) {
    worker.err_lines.finish();
    worker.err.reset();
  }
}

void Launcher::on_exit(Worker& worker, const proc::ExitStatus& status) {
  if (worker.server) {
    on_server_exit(worker, status);
    return;
  }
  worker.exit = status;
  // Workers read this to name a lost peer, so it is written before anything slower.
  if (nodes_) nodes_->record_exit(worker.rank, status.describe());
  if (status.success()) any_success_ = true;
  drain(worker);
  // Note [No orphans] (watchdog.h): whatever the worker left behind in its group goes with it.
  proc::signal_group(worker.pid, SIGKILL);
  watchdog_->forget(worker.pid);
  // Left first, then no longer counted: the servers stop once no worker is counted.
  if (ps_elastic() && !stopping_) leave_servers(worker);
  if (ps_elastic()) release_workers(1);
  if (!status.success() && !stopping_) on_failure(worker, status);
  if (options_.servers > 0) stop_servers_after_workers();
}

void Launcher::on_failure(Worker& worker, const proc::ExitStatus& status) {
  if (options_.elastic) {
    on_elastic_failure(worker, status);
    return;
  }
  // A static job cannot go on without a worker: stop the rest. (An elastic policy would decide
  // here between restarting the worker, shrinking the job and giving up.)
  exit_code_ = status.shell_code();
  say("worker " + std::to_string(worker.rank) + " " + status.describe() +
      (any_running() ? "; stopping the other workers" : ""));
  std::string where = options_.nnodes > 1 ? " on node " + std::to_string(options_.node_rank) : "";
  nodes_->report_failure("worker " + std::to_string(worker.rank) + where + " " + status.describe());
  begin_stop(SIGTERM);
}

void Launcher::on_signal(int signal) {
  // An elastic worker leaves the job at its next commit on SIGTERM; SIGINT (Ctrl-C) asks for
  // the same (docs/elastic.md). That SIGTERM goes to the worker alone: the processes it started
  // are its own to end, and would otherwise die mid-step (a Python worker's DataLoader processes,
  // whose death torch's loader raises as an error in the worker). The grace's SIGKILL still
  // reaches the whole group.
  const bool leave = options_.elastic && (signal == SIGINT || signal == SIGTERM);
  signal_running(leave ? SIGTERM : signal, /*group=*/!leave);
  if (signal == SIGTSTP) {
    // Workers are not in the terminal's foreground group, so Ctrl-Z reaches only us: pause them,
    // then ourselves. Execution goes on here when the shell's `fg` or `bg` sends SIGCONT.
    ::raise(SIGSTOP);
    signal_running(SIGCONT);
    return;
  }
  if (!is_stopping_signal(signal)) return;
  if (stopping_) {
    kill_at_ = Clock::now();  // a second stopping signal: no more grace
    return;
  }
  stopping_ = true;
  exit_code_ = 128 + signal;
  kill_at_ = Clock::now() + options_.stop_grace;
  say("received " + proc::signal_name(signal) + "; stopping the workers");
  if (nodes_) nodes_->report_failure("node " + std::to_string(options_.node_rank) + "'s launcher received " +
                         proc::signal_name(signal));
}

void Launcher::check_nodes() {
  const std::string node = "node " + std::to_string(options_.node_rank);
  std::string failure;
  try {
    failure = nodes_->check();
  } catch (const Error& e) {
    failure = e.what();
  }
  if (failure.empty() || stopping_) {
    // Servers wait for every node's workers (docs/ps.md, "Processes").
    if (options_.servers > 0) stop_servers_after_workers();
    return;
  }
  exit_code_ = 1;
  say(failure + "; stopping the workers of " + node);
  begin_stop(SIGTERM);
}

void Launcher::kill_leftovers() {
  const pid_t guard = watchdog_->guard_pid();
  std::vector<pid_t> leftovers;
  for (pid_t pid : proc::child_processes()) {
    if (pid != guard) leftovers.push_back(pid);
  }
  for (pid_t pid : leftovers) ::kill(pid, SIGKILL);
  Deadline deadline(std::chrono::seconds(1));
  for (pid_t pid : leftovers) {
    while (::waitpid(pid, nullptr, WNOHANG) == 0 && !deadline.expired()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
}

}  // namespace shoal::launch
