#include "runtime/job_discovery.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "shoal/core/error.h"

namespace shoal {
namespace {

// torch.distributed's default port, used when a job names neither a port nor an identity.
constexpr int kDefaultMasterPort = 29500;
// Derived ports lie in [kDefaultMasterPort, kDefaultMasterPort + kDerivedPorts), below Linux's
// ephemeral range (32768-60999), from which outgoing connections take their local ports.
constexpr int kDerivedPorts = 3000;

int required_int(const env::Environment& env, const std::string& name, const std::string& why,
                 int64_t min, int64_t max = INT32_MAX) {
  auto value = env::get_int(env, name, min, max);
  if (!value) throw UsageError(why);
  return static_cast<int>(*value);
}

int optional_int(const env::Environment& env, const std::string& name, int fallback, int64_t min,
                 int64_t max = INT32_MAX) {
  auto value = env::get_int(env, name, min, max);
  return value ? static_cast<int>(*value) : fallback;
}

void check_rank(const std::string& rank_var, int rank, const std::string& size_var, int size) {
  if (rank >= size) {
    throw UsageError(rank_var + "=" + std::to_string(rank) + " must be less than " + size_var +
                     "=" + std::to_string(size));
  }
}

void check_local(JobSpec& job, const std::string& rank_var, const std::string& size_var) {
  if (job.local_rank >= job.local_world_size) {
    throw UsageError(rank_var + "=" + std::to_string(job.local_rank) + " must be less than " +
                     size_var + "=" + std::to_string(job.local_world_size));
  }
}

// Address for launchers that provide none: the caller's `master`, then SHOAL_MASTER, then
// MASTER_ADDR with MASTER_PORT (or the port derived from the job id). False when none is set.
bool take_user_master(const env::Environment& env, const std::string& master, JobSpec& job) {
  if (!master.empty()) {
    std::tie(job.master_addr, job.master_port) = parse_host_port(master, "InitOptions::master");
    job.master_described_as = "InitOptions::master";
    return true;
  }
  if (auto text = env::get(env, "SHOAL_MASTER")) {
    std::tie(job.master_addr, job.master_port) = parse_host_port(*text, "SHOAL_MASTER");
    job.master_described_as = "SHOAL_MASTER";
    return true;
  }
  if (auto addr = env::get(env, "MASTER_ADDR")) {
    job.master_addr = *addr;
    job.master_port = optional_int(env, "MASTER_PORT", default_master_port(job.job_id), 1, 65535);
    job.master_described_as = "MASTER_ADDR:MASTER_PORT";
    return true;
  }
  return false;
}

// --- What every worker of a job reads alike -------------------------------------------------

JobSpec shoal_store(const env::Environment& env) {
  JobSpec job;
  job.launcher = "shoal";
  const std::string incomplete =
      "SHOAL_RANK is set but SHOAL_WORLD_SIZE is not; shoal run sets both (was this process "
      "started by shoal run?)";
  job.world_size = required_int(env, "SHOAL_WORLD_SIZE", incomplete, 1);
  auto addr = env::get(env, "SHOAL_MASTER_ADDR");
  if (!addr || addr->empty()) {
    throw UsageError("SHOAL_MASTER_ADDR is not set; expected the address of the job's store, as "
                     "shoal run exports it");
  }
  job.master_addr = *addr;
  job.master_port = required_int(
      env, "SHOAL_MASTER_PORT", "SHOAL_MASTER_PORT is not set; expected the port of the job's store",
      1, 65535);
  job.master_described_as = "SHOAL_MASTER_ADDR:SHOAL_MASTER_PORT";
  job.store_hosted_by_launcher = true;
  if (auto id = env::get(env, "SHOAL_RUN_ID"); id && !id->empty()) job.job_id = "shoal run " + *id;
  return job;
}

JobSpec torchrun_store(const env::Environment& env) {
  JobSpec job;
  job.launcher = "torchrun";
  const bool has_rank = env.count("RANK") > 0;
  const bool has_size = env.count("WORLD_SIZE") > 0;
  if (has_rank && !has_size) {
    throw UsageError("RANK is set but WORLD_SIZE is not; a torchrun-style job needs RANK, "
                     "WORLD_SIZE, MASTER_ADDR and MASTER_PORT");
  }
  if (has_size && !has_rank) {
    throw UsageError("WORLD_SIZE is set but RANK is not; a torchrun-style job needs RANK, "
                     "WORLD_SIZE, MASTER_ADDR and MASTER_PORT");
  }
  job.world_size = required_int(env, "WORLD_SIZE", "", 1);
  if (job.world_size > 1) {
    auto addr = env::get(env, "MASTER_ADDR");
    if (!addr || addr->empty()) {
      throw UsageError("MASTER_ADDR is not set; a torchrun-style job of " +
                       std::to_string(job.world_size) + " workers needs the master's address");
    }
    job.master_addr = *addr;
    job.master_port = required_int(
        env, "MASTER_PORT", "MASTER_PORT is not set; a torchrun-style job needs the master's port",
        1, 65535);
    job.master_described_as = "MASTER_ADDR:MASTER_PORT";
  }
  job.store_hosted_by_launcher = env::get_bool(env, "TORCHELASTIC_USE_AGENT_STORE").value_or(false);
  // torchrun's agent hosts a store of its own, without shoal's job id.
  job.store_names_job = !job.store_hosted_by_launcher;
  if (auto id = env::get(env, "TORCHELASTIC_RUN_ID"); id && !id->empty()) {
    job.job_id = "torchrun run " + *id;
  }
  return job;
}

// The addresses of the first tcp:// entry of an ORTE URI, in Open MPI's order
// ("1206517760.0;tcp://10.0.0.1,10.0.1.1:37115;tcp6://[fd00::2]:32913" -> 10.0.0.1, 10.0.1.1).
std::vector<std::string> tcp_addresses(const std::string& uri) {
  const std::string scheme = "tcp://";
  auto at = uri.find(scheme);
  if (at == std::string::npos) return {};
  const auto begin = at + scheme.size();
  const auto colon = uri.find_first_of(":;", begin);
  const std::string list =
      uri.substr(begin, colon == std::string::npos ? std::string::npos : colon - begin);
  std::vector<std::string> addresses;
  size_t from = 0;
  while (from <= list.size()) {
    const auto comma = list.find(',', from);
    std::string address =
        list.substr(from, comma == std::string::npos ? std::string::npos : comma - from);
    if (!address.empty()) addresses.push_back(std::move(address));
    if (comma == std::string::npos) break;
    from = comma + 1;
  }
  return addresses;
}

JobSpec openmpi_store(const env::Environment& env, const std::string& master) {
  JobSpec job;
  job.launcher = "openmpi";
  job.world_size = required_int(
      env, "OMPI_COMM_WORLD_SIZE",
      "OMPI_COMM_WORLD_RANK is set but OMPI_COMM_WORLD_SIZE is not; expected both from mpirun", 1);
  if (auto id = env::get(env, "OMPI_MCA_ess_base_jobid"); id && !id->empty()) {
    job.job_id = "Open MPI job " + *id;
  }
  if (take_user_master(env, master, job) || job.world_size == 1) return job;
  // See Note [mpirun's host] in docs/runtime.md: a one-node job meets on this host; a job of
  // several nodes meets where mpirun runs, which is where Open MPI puts rank 0 by default.
  const int nodes = optional_int(env, "OMPI_MCA_orte_num_nodes", 0, 0);
  const auto addresses = tcp_addresses(env::get(env, "OMPI_MCA_orte_hnp_uri").value_or(""));
  if (nodes == 1) {
    job.master_addr = "127.0.0.1";
    job.master_described_as = "this host (mpirun's job has one node)";
  } else if (!addresses.empty()) {
    // Several addresses (a host on several networks): init() settles on one.
    job.master_addr = addresses.front();
    if (addresses.size() > 1) job.master_candidates = addresses;
    job.master_described_as = "mpirun's host (OMPI_MCA_orte_hnp_uri)";
  } else {
    throw UsageError("an Open MPI job of " + std::to_string(job.world_size) +
                     " workers needs the master's address: set SHOAL_MASTER=HOST:PORT (or "
                     "MASTER_ADDR and MASTER_PORT), or pass InitOptions::master");
  }
  job.master_port = optional_int(env, "MASTER_PORT", default_master_port(job.job_id), 1, 65535);
  return job;
}

std::string slurm_tasks_variable(const env::Environment& env) {
  return env.count("SLURM_STEP_TASKS_PER_NODE") ? "SLURM_STEP_TASKS_PER_NODE"
                                                : "SLURM_TASKS_PER_NODE";
}

JobSpec slurm_store(const env::Environment& env, const std::string& master) {
  JobSpec job;
  job.launcher = "slurm";
  job.world_size = required_int(
      env, "SLURM_NTASKS", "SLURM_PROCID is set but SLURM_NTASKS is not; expected both from srun", 1);
  if (job.world_size > 1 && !env.count("SLURM_STEP_ID") && !env.count("SLURM_STEPID")) {
    // sbatch's script is not a task of the job: srun starts the tasks, each in a step.
    throw UsageError(
        "SLURM_PROCID is set but SLURM_STEP_ID is not: this is the batch script of a "
        "Slurm job of " +
        std::to_string(job.world_size) +
        " tasks, not one of its tasks; start the workers with srun PROGRAM");
  }
  if (auto id = env::get(env, "SLURM_JOB_ID"); id && !id->empty()) {
    job.job_id = "Slurm job " + *id;
    auto step = env::get(env, "SLURM_STEP_ID");
    if (!step) step = env::get(env, "SLURM_STEPID");
    if (step && !step->empty()) job.job_id += " step " + *step;
  }
  // Every worker checks the whole layout, so that a wrong one fails on all of them alike.
  const std::string tasks_var = slurm_tasks_variable(env);
  if (auto text = env::get(env, tasks_var)) {
    auto counts = expand_slurm_tasks_per_node(*text, tasks_var);
    int64_t sum = 0;
    for (int count : counts) sum += count;
    if (sum != job.world_size) {
      throw UsageError(tasks_var + "='" + *text + "' adds up to " + std::to_string(sum) +
                       " tasks but SLURM_NTASKS=" + std::to_string(job.world_size));
    }
  }
  if (take_user_master(env, master, job) || job.world_size == 1) return job;
  std::string nodes_var;
  for (const char* name : {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"}) {
    if (auto nodes = env::get(env, name); nodes && !nodes->empty()) {
      nodes_var = name;
      break;
    }
  }
  if (nodes_var.empty()) {
    throw UsageError("SLURM_JOB_NODELIST is not set; a Slurm job of " +
                     std::to_string(job.world_size) +
                     " workers needs it (or SHOAL_MASTER=HOST:PORT) to find its master");
  }
  job.master_addr = first_slurm_host(*env::get(env, nodes_var));
  job.master_port = optional_int(env, "MASTER_PORT", default_master_port(job.job_id), 1, 65535);
  job.master_described_as = "the first host of " + nodes_var;
  return job;
}

// --- Where this worker stands -----------------------------------------------------------------

void place_shoal(const env::Environment& env, JobSpec& job) {
  if (!env.count("SHOAL_RANK")) {
    throw UsageError("SHOAL_WORLD_SIZE is set but SHOAL_RANK is not; shoal run sets both");
  }
  job.rank = required_int(env, "SHOAL_RANK", "", 0);
  check_rank("SHOAL_RANK", job.rank, "SHOAL_WORLD_SIZE", job.world_size);
  job.local_rank = optional_int(env, "SHOAL_LOCAL_RANK", job.rank, 0);
  job.local_world_size = optional_int(env, "SHOAL_LOCAL_WORLD_SIZE", job.world_size, 1);
  check_local(job, "SHOAL_LOCAL_RANK", "SHOAL_LOCAL_WORLD_SIZE");
}

void place_torchrun(const env::Environment& env, JobSpec& job) {
  job.rank = required_int(env, "RANK", "", 0);
  job.hosts_store = !job.store_hosted_by_launcher && job.rank == 0;
  check_rank("RANK", job.rank, "WORLD_SIZE", job.world_size);
  // Without LOCAL_WORLD_SIZE, assume every worker shares this host: it only sizes thread pools.
  job.local_rank = optional_int(env, "LOCAL_RANK", job.rank, 0);
  job.local_world_size = optional_int(env, "LOCAL_WORLD_SIZE", job.world_size, 1);
  check_local(job, "LOCAL_RANK", "LOCAL_WORLD_SIZE");
}

void place_openmpi(const env::Environment& env, JobSpec& job) {
  job.rank = required_int(env, "OMPI_COMM_WORLD_RANK", "", 0);
  job.local_rank = optional_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", job.rank, 0);
  if (job.master_described_as.rfind("mpirun's host", 0) == 0) {
    // The first worker on mpirun's host: there, mpirun is this process's local daemon.
    const auto hnp = env::get(env, "OMPI_MCA_orte_hnp_uri");
    job.on_master_host = hnp && hnp == env::get(env, "OMPI_MCA_orte_local_daemon_uri");
    job.hosts_store = job.local_rank == 0 && job.on_master_host;
  } else {
    job.hosts_store = job.rank == 0;
  }
  check_rank("OMPI_COMM_WORLD_RANK", job.rank, "OMPI_COMM_WORLD_SIZE", job.world_size);
  job.local_world_size = optional_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", job.world_size, 1);
  check_local(job, "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE");
}

void place_slurm(const env::Environment& env, JobSpec& job) {
  job.rank = required_int(env, "SLURM_PROCID", "", 0);
  job.hosts_store = job.rank == 0;
  check_rank("SLURM_PROCID", job.rank, "SLURM_NTASKS", job.world_size);
  job.local_rank = optional_int(env, "SLURM_LOCALID", 0, 0);
  // This node's task count: its entry of the step's compressed list ("2(x3),1"), found by
  // SLURM_NODEID; SLURM_NTASKS_PER_NODE is only set when the user asked for a fixed count.
  const std::string tasks_var = slurm_tasks_variable(env);
  const auto text = env::get(env, tasks_var);
  const auto node = env::get_int(env, "SLURM_NODEID", 0, INT32_MAX);
  std::string size_var;
  if (text && node) {
    auto counts = expand_slurm_tasks_per_node(*text, tasks_var);
    if (*node >= static_cast<int64_t>(counts.size())) {
      throw UsageError("SLURM_NODEID=" + std::to_string(*node) + " must be less than the " +
                       std::to_string(counts.size()) + " nodes of " + tasks_var + "='" + *text +
                       "'");
    }
    job.local_world_size = counts[*node];
    if (job.local_rank >= job.local_world_size) {
      throw UsageError("SLURM_LOCALID=" + std::to_string(job.local_rank) + " must be less than " +
                       std::to_string(job.local_world_size) + ", the tasks of node SLURM_NODEID=" +
                       std::to_string(*node) + " in " + tasks_var + "='" + *text + "'");
    }
    return;
  } else if (auto per_node = env::get_int(env, "SLURM_NTASKS_PER_NODE", 1)) {
    job.local_world_size = static_cast<int>(*per_node);
    size_var = "SLURM_NTASKS_PER_NODE";
  } else {
    // Without a node id the count is unknowable on an uneven layout; it only sizes thread pools.
    job.local_world_size =
        text ? expand_slurm_tasks_per_node(*text, tasks_var).front() : job.local_rank + 1;
    job.local_world_size = std::max(job.local_world_size, job.local_rank + 1);
    size_var = tasks_var;
  }
  check_local(job, "SLURM_LOCALID", size_var);
}

// Sets the worker's place; raises UsageError for a wrong one. hosts_store is set as soon as the
// rank variables say it, before the checks that may fail.
void place_worker(const env::Environment& env, JobSpec& job) {
  if (job.launcher == "shoal") place_shoal(env, job);
  if (job.launcher == "torchrun") place_torchrun(env, job);
  if (job.launcher == "openmpi") place_openmpi(env, job);
  if (job.launcher == "slurm") place_slurm(env, job);
}

}  // namespace

std::pair<std::string, int> parse_host_port(const std::string& text, const std::string& what) {
  auto colon = text.rfind(':');
  const std::string expected = "; expected HOST:PORT with PORT in [1, 65535]";
  if (colon == std::string::npos || colon == 0 || colon + 1 == text.size()) {
    throw UsageError(what + "='" + text + "' has no port" + expected);
  }
  std::string host = text.substr(0, colon);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  env::Environment one{{what, text.substr(colon + 1)}};
  try {
    return {host, static_cast<int>(*env::get_int(one, what, 1, 65535))};
  } catch (const UsageError&) {
    throw UsageError(what + "='" + text + "' has a bad port" + expected);
  }
}

std::string first_slurm_host(const std::string& nodelist) {
  // The first entry ends at the first comma outside brackets.
  std::string first;
  int depth = 0;
  for (char c : nodelist) {
    if (c == '[') ++depth;
    if (c == ']') --depth;
    if (c == ',' && depth == 0) break;
    first.push_back(c);
  }
  auto open = first.find('[');
  if (open == std::string::npos) return first;
  auto close = first.find(']', open);
  std::string range = first.substr(open + 1, (close == std::string::npos ? first.size() : close) - open - 1);
  std::string head = range.substr(0, range.find_first_of(",-"));
  const std::string tail = close == std::string::npos ? "" : first.substr(close + 1);
  return first.substr(0, open) + head + tail;
}

int default_master_port(const std::string& job_id) {
  if (job_id.empty()) return kDefaultMasterPort;
  // Slurm numbers jobs in sequence, and jobs that share a node are mostly close in number:
  // consecutive jobs, and up to 8 steps of each, get distinct ports.
  unsigned long long job = 0, step = 0;
  char rest = 0;
  const int read = std::sscanf(job_id.c_str(), "Slurm job %llu step %llu%c", &job, &step, &rest);
  if (read == 1 || read == 2) {
    return kDefaultMasterPort + static_cast<int>((job * 8 + step) % kDerivedPorts);
  }
  uint64_t hash = 14695981039346656037ull;  // FNV-1a: stable across builds and hosts
  for (unsigned char c : job_id) {
    hash ^= c;
    hash *= 1099511628211ull;
  }
  return kDefaultMasterPort + static_cast<int>(hash % kDerivedPorts);
}

std::vector<int> expand_slurm_tasks_per_node(const std::string& text, const std::string& what) {
  auto bad = [&] {
    return UsageError(what + "='" + text +
                      "' is not a Slurm task list; expected counts like "
                      "'2(x3),1'");
  };
  std::vector<int> counts;
  size_t at = 0;
  while (at <= text.size()) {
    auto comma = text.find(',', at);
    const std::string entry =
        text.substr(at, comma == std::string::npos ? std::string::npos : comma - at);
    // "N" or "N(xR)"
    char* end = nullptr;
    const long count = std::strtol(entry.c_str(), &end, 10);
    if (end == entry.c_str() || count < 1 || count > INT32_MAX) throw bad();
    long repeat = 1;
    if (*end == '(') {
      if (end[1] != 'x') throw bad();
      char* close = nullptr;
      repeat = std::strtol(end + 2, &close, 10);
      if (close == end + 2 || *close != ')' || close[1] != '\0' || repeat < 1 || repeat > 1 << 20) {
        throw bad();
      }
    } else if (*end != '\0') {
      throw bad();
    }
    counts.insert(counts.end(), repeat, static_cast<int>(count));
    if (comma == std::string::npos) break;
    at = comma + 1;
  }
  return counts;
}

JobSpec discover_job_store(const env::Environment& env, const std::string& master) {
  if (env.count("SHOAL_RANK") || env.count("SHOAL_WORLD_SIZE")) {
    return shoal_store(env);
  }
  if (env.count("RANK") || env.count("WORLD_SIZE")) {
    JobSpec job = torchrun_store(env);
    auto rank = env::get(env, "RANK");
    job.hosts_store = !job.store_hosted_by_launcher && rank && *rank == "0";
    return job;
  }
  JobSpec job;
  if (env.count("OMPI_COMM_WORLD_RANK"))
    job = openmpi_store(env, master);
  else if (env.count("SLURM_PROCID"))
    job = slurm_store(env, master);
  else
    return job;
  JobSpec placed = job;
  try {
    place_worker(env, placed);
  } catch (const UsageError&) {
    // This worker's own variables are wrong; whether it hosts the store may still be known.
  }
  job.hosts_store = placed.hosts_store;
  job.on_master_host = placed.on_master_host;
  return job;
}

JobSpec discover_job(const env::Environment& env, const std::string& master) {
  if (env::get_bool(env, "SHOAL_ELASTIC").value_or(false)) {
    JobSpec job;
    job.launcher = "shoal";
    job.elastic = true;
    job.local_world_size = optional_int(env, "SHOAL_LOCAL_WORLD_SIZE", 1, 1);
    if (auto id = env::get(env, "SHOAL_RUN_ID"); id && !id->empty())
      job.job_id = "shoal run " + *id;
    return job;
  }
  JobSpec job = discover_job_store(env, master);
  place_worker(env, job);
  return job;
}

}  // namespace shoal
