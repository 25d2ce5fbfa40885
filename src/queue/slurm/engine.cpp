#include "engine.h"

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "proc/process.h"
#include "client.h"
#include "shoal/core/error.h"
#include "core/log.h"

extern char** environ;

namespace shoal::queue::slurm {

namespace {

// How long an ended Slurm job's .exit file may take to show (a shared filesystem's caching)
// before the worker is reported as ended without a word from its program.
constexpr auto kExitFileGrace = std::chrono::seconds(5);
// How often Slurm is asked about jobs whose files say nothing yet.
constexpr auto kSqueueInterval = std::chrono::seconds(3);
// Slurm's range for --nice.
constexpr long kMaxNice = 2147483645;

std::string read_first_line(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

std::string shell_quoted(const std::string& text) {
  std::string out = "'";
  for (char c : text) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// "KEY=value" out of `scontrol show node -o`'s one line.
std::string field(const std::string& line, const std::string& key) {
  std::istringstream words(line);
  for (std::string word; words >> word;) {
    if (word.rfind(key + "=", 0) == 0) return word.substr(key.size() + 1);
  }
  return "";
}

// The Slurm job's name: what squeue shows, and how a job whose sbatch stalled is found.
std::string name_of(const WorkerLaunch& launch) {
  return "shoal-j" + std::to_string(launch.job) + "-w" + std::to_string(launch.worker);
}

bool ended_state(const std::string& state) {
  for (const char* name : {"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
                           "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY", "SPECIAL_EXIT", "REVOKED"}) {
    if (state == name) return true;
  }
  return false;
}

// Note [Slurm's own SIGTERM]
// Slurm ends a job at its time limit, on a preemption or on someone's `scancel JOBID` by sending
// SIGTERM to all its processes (SIGKILL follows after KillWait). An elastic worker takes SIGTERM
// as the agent's leave: it leaves at its next commit and exits 0, which the scheduler, not having
// asked it to leave, would read as the end of the training. The step program records the
// signals it passed on, and the agent knows which workers it signalled: a worker that got a
// SIGTERM the agent did not send ended by Slurm's hand, whatever its exit code, and is reported
// as a failure, so that the queue replaces it (counted against --max-restarts). A SIGTERM from
// Slurm that comes after the agent's leave or stop is taken as part of it, which is what the
// scheduler then expects anyway.

// Note [A restarted agent's Slurm jobs]
// A Slurm job outlives the agent that submitted it: an agent stopped with SIGTERM scancels its
// jobs, but one that was SIGKILLed (or whose machine died) leaves them pending or running. When
// a new agent with the same --dir comes back before the scheduler's --host-timeout, the
// scheduler still lists those workers on its host and asks it to run them; submitting them again
// would run each worker twice, the two programs sharing its PREFIX files. So the engine lists,
// once at its start, the Slurm jobs of this user whose batch script is one of this --dir's
// (`squeue --me`, the job's command), and start() follows such a job (its id, its .pid and .exit
// files) instead of submitting it again. A predecessor's job that the scheduler no longer lists
// here (it counted the host as lost, or the job ended) is left to run, as before: the agent only
// logs it. The agent's own side is not done: its gossip member for the job is a new one, at a
// new address, that knows only other hosts' members, so on a host that held all of a job's
// workers a worker that joins later (a grow, a replacement) would not find the running ones.

}  // namespace

SlurmEngine::SlurmEngine(SlurmOptions options) : options_(std::move(options)) {
  for (const char* name : {"sbatch", "scancel", "squeue", "scontrol"}) {
    try {
      tools_[name] = proc::resolve_program(name);
    } catch (const UsageError&) {
      throw UsageError(std::string("the Slurm engine needs Slurm's ") + name +
                       " on PATH (package slurm-client); it was not found");
    }
  }
  if (const char* conf = std::getenv("SLURM_CONF"); conf != nullptr) slurm_conf_ = conf;
  char self[4096] = {};
  const ssize_t length = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (length <= 0) throw UsageError("cannot find the shoal program (/proc/self/exe)");
  // The step program sits beside `shoal`, in the build tree as where it is installed.
  const std::string shoal(self, static_cast<size_t>(length));
  step_ = shoal.substr(0, shoal.rfind('/') + 1) + "shoal-slurm-step";
  if (::access(step_.c_str(), X_OK) != 0) {
    throw UsageError("the Slurm engine needs shoal-slurm-step beside shoal, at " + step_ +
                     "; it was not found (it is built and installed with shoal)");
  }
  ::mkdir(options_.dir.c_str(), 0755);

  const ClientResult node = run_client({tool("scontrol"), "show", "node", options_.node, "-o"},
                                       client_env(), options_.command_timeout);
  if (node.exit_code != 0 ||
      node.out.find("NodeName=" + options_.node + " ") == std::string::npos) {
    throw UsageError("--slurm-node " + options_.node + ": " +
                     (node.exit_code != 0 ? node.error_line() : "Slurm does not list it") +
                     "; expected a node of this Slurm cluster (see sinfo -N)");
  }
  capacity_.cores = std::max(1, std::atoi(field(node.out, "CPUTot").c_str()));
  capacity_.slots = capacity_.cores;
  if (!options_.partition.empty()) {
    const std::string partitions = field(node.out, "Partitions");
    bool found = false;
    std::istringstream list(partitions);
    for (std::string name; std::getline(list, name, ',');)
      found = found || name == options_.partition;
    if (!found) {
      throw UsageError("--partition " + options_.partition + " does not hold node " +
                       options_.node +
                       " (its partitions: " + (partitions.empty() ? "none" : partitions) + ")");
    }
  }
  log::info(log::line("shoal agent: Slurm node ", options_.node, " with ", capacity_.cores, " CPUs",
                      (options_.partition.empty() ? "" : ", partition " + options_.partition)));
  find_predecessors();
}

void SlurmEngine::find_predecessors() {
  ClientResult result;
  try {
    result = run_client({tool("squeue"), "--me", "--noheader", "--states=PENDING,RUNNING,SUSPENDED",
                         "--format=%i|%j|%o"},
                        client_env(), options_.command_timeout);
  } catch (const Error& e) {
    log::warn(log::line("shoal agent: ", e.what(),
                        "; Slurm jobs an earlier agent left here are not followed"));
    return;
  }
  if (result.exit_code != 0) {
    log::warn(log::line("shoal agent: squeue failed: ", result.error_line(),
                        "; Slurm jobs an earlier agent left here are not followed"));
    return;
  }
  std::string ids;
  std::istringstream lines(result.out);
  for (std::string line; std::getline(lines, line);) {
    std::istringstream fields(line);
    std::string id, name, command;
    if (!std::getline(fields, id, '|') || !std::getline(fields, name, '|') ||
        !std::getline(fields, command)) {
      continue;
    }
    long long job = 0, worker = 0;
    char rest = 0;
    if (std::sscanf(name.c_str(), "shoal-j%lld-w%lld%c", &job, &worker, &rest) != 2) continue;
    // Its batch script is this --dir's script for that worker: this node's agent submitted it.
    const std::string script = options_.dir + "/worker-" + std::to_string(worker) + ".sh";
    if (command.compare(0, script.size(), script) != 0) continue;
    predecessors_[worker] = Predecessor{id, job};
    ids += (ids.empty() ? "" : ", ") + id + " (worker " + std::to_string(worker) + ")";
  }
  if (!ids.empty()) {
    log::info(log::line(
        "shoal agent: Slurm jobs of an earlier agent with this --dir still pend or run: ", ids,
        "; each is followed if the scheduler still lists its worker here"));
  }
}

std::string SlurmEngine::tool(const std::string& name) const {
  return tools_.at(name);
}

std::vector<std::string> SlurmEngine::client_env() const {
  std::vector<std::string> env;
  for (char** entry = environ; *entry != nullptr; ++entry) env.emplace_back(*entry);
  return env;
}

Capacity SlurmEngine::capacity() const {
  return capacity_;
}

int64_t SlurmEngine::start(const WorkerLaunch& launch) {
  const std::string name = "worker-" + std::to_string(launch.worker);
  Job job;
  job.prefix = options_.dir + "/" + name;
  // See Note [A restarted agent's Slurm jobs].
  if (auto it = predecessors_.find(launch.worker);
      it != predecessors_.end() && it->second.job == launch.job) {
    job.id = it->second.id;
    job.pid = std::atoll(read_first_line(job.prefix + ".pid").c_str());
    predecessors_.erase(it);
    log::info(log::line("shoal agent: worker ", launch.worker, " of job ", launch.job,
                        " is Slurm job ", job.id, " on ", options_.node,
                        ", submitted by an earlier agent: followed, not submitted again"));
    const int64_t pid = job.pid;
    jobs_[launch.worker] = std::move(job);
    return pid;
  }
  ::unlink((job.prefix + ".pid").c_str());
  ::unlink((job.prefix + ".exit").c_str());
  const std::string script = job.prefix + ".sh";
  {
    std::ofstream out(script, std::ios::trunc);
    out << "#!/bin/sh\n"
        << "# Worker " << launch.worker << " of the queue's job " << launch.job << " on node "
        << options_.node
        << " (docs/queue.md, section Slurm). The step wrapper is the batch step's own\n"
        << "# process: it passes scancel's signals on and records the program's end.\n"
        << "exec " << shell_quoted(step_) << " " << shell_quoted(job.prefix) << " \"$@\"\n";
    if (!out) throw Error("cannot write the batch script " + script);
  }

  std::vector<std::string> argv = {tool("sbatch"),
                                   "--parsable",
                                   "--job-name=" + name_of(launch),
                                   "--nodelist=" + options_.node,
                                   "--nodes=1",
                                   "--ntasks=1",
                                   "--cpus-per-task=1",
                                   "--no-requeue",
                                   "--export=ALL",
                                   "--chdir=" + launch.cwd,
                                   "--output=" + launch.log,
                                   "--error=" + launch.log,
                                   "--open-mode=append"};
  if (!options_.partition.empty()) argv.push_back("--partition=" + options_.partition);
  // Slurm runs a batch job as the user who submitted it: this agent's. A job of another user is
  // refused rather than run as the agent (docs/queue.md, "Security").
  if (launch.user) {
    throw UsageError("the Slurm engine runs workers as its agent's user, not as " +
                     launch.user->name + "; run a Slurm agent as " + launch.user->name);
  }
  // Higher in the queue is lower nice in Slurm. Only an operator (root, SlurmUser) may go below
  // 0; others keep Slurm's own priority for the queue's high jobs.
  long nice = -static_cast<long>(launch.priority);
  nice = std::max(-kMaxNice, std::min(kMaxNice, nice));
  if (nice < 0 && ::geteuid() != 0) nice = 0;
  if (nice != 0) argv.push_back("--nice=" + std::to_string(nice));
  argv.push_back(script);
  argv.insert(argv.end(), launch.argv.begin(), launch.argv.end());

  // sbatch exports its own environment to the job (--export=ALL): the worker's, without the
  // submitter's Slurm variables (which would describe some other job), and with the agent's
  // SLURM_CONF so that sbatch finds this cluster.
  std::vector<std::string> env;
  for (const auto& entry : launch.env) {
    if (entry.rfind("SLURM_", 0) == 0 || entry.rfind("SBATCH_", 0) == 0) continue;
    env.push_back(entry);
  }
  if (!slurm_conf_.empty()) env.push_back("SLURM_CONF=" + slurm_conf_);
  ClientResult result;
  try {
    result = run_client(argv, env, options_.command_timeout);
  } catch (const CommError& e) {
    // sbatch may have made the job before it stalled: withdraw it, so that no worker runs that
    // the agent does not know.
    std::string left = "; any job it made is withdrawn";
    try {
      const ClientResult withdrawn =
          run_client({tool("scancel"), "--name=" + name_of(launch), "--nodelist=" + options_.node},
                     client_env(), options_.command_timeout);
      if (withdrawn.exit_code != 0) left = "; a job it made may be left: " + withdrawn.error_line();
    } catch (const Error& again) {
      left = "; a job it made may be left: " + std::string(again.what());
    }
    throw Error(std::string(e.what()) + left);
  }
  if (result.exit_code != 0) {
    throw Error("sbatch to node " + options_.node + " failed: " + result.error_line());
  }
  job.id = result.out.substr(0, result.out.find_first_of(";\n"));
  if (job.id.empty() || job.id.find_first_not_of("0123456789") != std::string::npos) {
    throw Error("sbatch to node " + options_.node + " answered '" + result.out +
                "'; expected a job id (--parsable)");
  }
  log::info(log::line("shoal agent: worker ", launch.worker, " of job ", launch.job,
                      " is Slurm job ", job.id, " on ", options_.node));
  jobs_[launch.worker] = std::move(job);
  return 0;
}

void SlurmEngine::scancel(const Job& job, const std::vector<std::string>& flags) {
  std::vector<std::string> argv = {tool("scancel")};
  argv.insert(argv.end(), flags.begin(), flags.end());
  argv.push_back(job.id);
  try {
    const ClientResult result = run_client(argv, client_env(), options_.command_timeout);
    // A job that ended meanwhile is no error: poll() reports its end.
    if (result.exit_code != 0 &&
        result.err.find("already completing or completed") == std::string::npos &&
        result.err.find("Invalid job id") == std::string::npos) {
      log::warn(log::line("shoal agent: scancel of Slurm job ", job.id,
                          " failed: ", result.error_line()));
    }
  } catch (const Error& e) {
    log::warn(log::line("shoal agent: ", e.what()));
  }
}

void SlurmEngine::signal(int64_t worker, int signal) {
  auto it = jobs_.find(worker);
  if (it == jobs_.end()) return;
  Job& job = it->second;
  if (job.pid == 0) job.pid = std::atoll(read_first_line(job.prefix + ".pid").c_str());
  if (job.pid == 0) {
    // Its program has not started (the job waits in Slurm's queue): nothing to tell, only to
    // withdraw.
    if (!job.cancelled) scancel(job, {});
    job.cancelled = signal;
    return;
  }
  job.signalled = true;
  if (signal == SIGKILL) {
    // Slurm's own end of a job: SIGTERM to all its processes, SIGKILL after its KillWait.
    scancel(job, {});
  } else {
    // --batch: to the batch step's own process, the step wrapper, which passes it on.
    scancel(job, {"--batch", "--signal=" + proc::signal_name(signal).substr(3)});
  }
}

std::optional<std::map<std::string, std::pair<std::string, std::string>>> SlurmEngine::states() {
  std::string ids;
  for (const auto& [worker, job] : jobs_) ids += (ids.empty() ? "" : ",") + job.id;
  ClientResult result;
  try {
    result = run_client(
        {tool("squeue"), "--noheader", "--states=all", "--jobs=" + ids, "--format=%i|%T|%r"},
        client_env(), options_.command_timeout);
  } catch (const Error& e) {
    if (!squeue_failing_) log::warn(log::line("shoal agent: ", e.what(), "; retrying"));
    squeue_failing_ = true;
    return std::nullopt;
  }
  std::map<std::string, std::pair<std::string, std::string>> found;
  // Without accounting, squeue forgets a job MinJobAge seconds after it ended; when it knows
  // none of the ids it says "Invalid job id specified".
  if (result.exit_code != 0 && result.err.find("Invalid job id") == std::string::npos) {
    if (!squeue_failing_) {
      log::warn(log::line("shoal agent: squeue failed: ", result.error_line(), "; retrying"));
    }
    squeue_failing_ = true;
    return std::nullopt;
  }
  if (squeue_failing_) log::info(log::line("shoal agent: squeue answers again"));
  squeue_failing_ = false;
  std::istringstream lines(result.out);
  for (std::string line; std::getline(lines, line);) {
    const auto bar = line.find('|');
    const auto second = line.find('|', bar == std::string::npos ? 0 : bar + 1);
    if (bar == std::string::npos || second == std::string::npos) continue;
    found[line.substr(0, bar)] = {line.substr(bar + 1, second - bar - 1), line.substr(second + 1)};
  }
  return found;
}

std::vector<WorkerChange> SlurmEngine::poll() {
  std::vector<WorkerChange> changes;
  // The step's files first: they say what the program did.
  auto read_exit = [&](int64_t worker, Job& job) {
    const std::string text = read_first_line(job.prefix + ".exit");
    if (text.empty()) return false;
    WorkerChange change{worker, job.pid, true, "ended without a report", false};
    try {
      const auto report = nlohmann::json::parse(text);
      change.exit = report.at("exit").get<std::string>();
      change.success = report.at("success").get<bool>();
      // See Note [Slurm's own SIGTERM].
      const auto signals = report.value("signals", std::vector<std::string>{});
      if (!job.signalled && std::find(signals.begin(), signals.end(), "SIGTERM") != signals.end()) {
        change.exit = "ended after a SIGTERM that the agent did not send (Slurm's: a time limit, "
                      "a preemption or a scancel): " + change.exit;
        change.success = false;
      }
    } catch (const std::exception& e) {
      change.exit = "ended; its report " + job.prefix + ".exit is unreadable (" + e.what() + ")";
    }
    changes.push_back(change);
    return true;
  };
  for (auto it = jobs_.begin(); it != jobs_.end();) {
    Job& job = it->second;
    if (job.pid == 0) {
      job.pid = std::atoll(read_first_line(job.prefix + ".pid").c_str());
      if (job.pid > 0) changes.push_back(WorkerChange{it->first, job.pid, false, "", false});
    }
    it = read_exit(it->first, job) ? jobs_.erase(it) : std::next(it);
  }
  if (jobs_.empty()) return changes;

  // Then Slurm: a job that ended without its program's word (cancelled while pending, its node
  // lost, the wrapper killed) is known only to Slurm. That is rare, and each squeue costs the
  // controller an RPC and this host a process, so Slurm is asked every few seconds, and at once
  // after a job was withdrawn.
  const auto now = Clock::now();
  bool withdrawn = false;
  for (const auto& [worker, job] : jobs_)
    withdrawn = withdrawn || (job.cancelled && !job.gone_since);
  if (!withdrawn && now - last_squeue_ < kSqueueInterval) return changes;
  last_squeue_ = now;
  const auto known = states();
  if (!known) return changes;
  for (auto it = jobs_.begin(); it != jobs_.end();) {
    Job& job = it->second;
    auto found = known->find(job.id);
    const std::string state = found == known->end() ? "" : found->second.first;
    if (!state.empty() && !ended_state(state)) {
      if (state == "PENDING" && job.state != "PENDING") {
        log::info(log::line("shoal agent: Slurm job ", job.id, " (worker ", it->first,
                            ") is pending: ", found->second.second));
      }
      job.state = state;
      job.gone_since.reset();
      ++it;
      continue;
    }
    if (!job.gone_since) job.gone_since = now;
    if (job.cancelled) {
      // Withdrawn before it ran: a leave took nothing from the job.
      changes.push_back(WorkerChange{it->first, job.pid, true,
                                     "was withdrawn from Slurm (job " + job.id + ") before it ran",
                                     *job.cancelled != SIGKILL});
      it = jobs_.erase(it);
      continue;
    }
    if (now - *job.gone_since < kExitFileGrace) {
      ++it;
      continue;
    }
    changes.push_back(WorkerChange{
        it->first, job.pid, true,
        "ended in Slurm as " + (state.empty() ? std::string("a job it no longer lists") : state) +
            " (job " + job.id + ") without a report from its program",
        false});
    it = jobs_.erase(it);
  }
  return changes;
}

}  // namespace shoal::queue::slurm
