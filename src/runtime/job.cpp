#include "shoal/runtime/job.h"

#include "shoal/core/error.h"

namespace shoal {
namespace {

// torch.distributed's default port, used when a Slurm job names no port.
constexpr int kDefaultMasterPort = 29500;

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
// MASTER_ADDR/MASTER_PORT. Returns false when none is set.
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
    job.master_port = optional_int(env, "MASTER_PORT", kDefaultMasterPort, 1, 65535);
    job.master_described_as = "MASTER_ADDR:MASTER_PORT";
    return true;
  }
  return false;
}

JobSpec from_shoal(const env::Environment& env) {
  JobSpec job;
  job.launcher = "shoal";
  const std::string incomplete =
      "SHOAL_RANK is set but SHOAL_WORLD_SIZE is not; shoal run sets both (was this process "
      "started by shoal run?)";
  job.world_size = required_int(env, "SHOAL_WORLD_SIZE", incomplete, 1);
  job.rank = required_int(env, "SHOAL_RANK", incomplete, 0);
  check_rank("SHOAL_RANK", job.rank, "SHOAL_WORLD_SIZE", job.world_size);
  job.local_rank = optional_int(env, "SHOAL_LOCAL_RANK", job.rank, 0);
  job.local_world_size = optional_int(env, "SHOAL_LOCAL_WORLD_SIZE", job.world_size, 1);
  check_local(job, "SHOAL_LOCAL_RANK", "SHOAL_LOCAL_WORLD_SIZE");
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
  return job;
}

JobSpec from_torchrun(const env::Environment& env) {
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
  job.rank = required_int(env, "RANK", "", 0);
  check_rank("RANK", job.rank, "WORLD_SIZE", job.world_size);
  // Without LOCAL_WORLD_SIZE, assume every worker shares this host: it only sizes thread pools.
  job.local_rank = optional_int(env, "LOCAL_RANK", job.rank, 0);
  job.local_world_size = optional_int(env, "LOCAL_WORLD_SIZE", job.world_size, 1);
  check_local(job, "LOCAL_RANK", "LOCAL_WORLD_SIZE");
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
  return job;
}

JobSpec from_openmpi(const env::Environment& env) {
  JobSpec job;
  job.launcher = "openmpi";
  job.world_size = required_int(
      env, "OMPI_COMM_WORLD_SIZE",
      "OMPI_COMM_WORLD_RANK is set but OMPI_COMM_WORLD_SIZE is not; expected both from mpirun", 1);
  job.rank = required_int(env, "OMPI_COMM_WORLD_RANK", "", 0);
  check_rank("OMPI_COMM_WORLD_RANK", job.rank, "OMPI_COMM_WORLD_SIZE", job.world_size);
  job.local_rank = optional_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", job.rank, 0);
  job.local_world_size = optional_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", job.world_size, 1);
  check_local(job, "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE");
  return job;
}

JobSpec from_slurm(const env::Environment& env) {
  JobSpec job;
  job.launcher = "slurm";
  job.world_size = required_int(
      env, "SLURM_NTASKS", "SLURM_PROCID is set but SLURM_NTASKS is not; expected both from srun", 1);
  job.rank = required_int(env, "SLURM_PROCID", "", 0);
  check_rank("SLURM_PROCID", job.rank, "SLURM_NTASKS", job.world_size);
  job.local_rank = optional_int(env, "SLURM_LOCALID", 0, 0);
  // SLURM_TASKS_PER_NODE reads like "2(x3),1": this node's count is not knowable from it
  // alone, so prefer SLURM_NTASKS_PER_NODE and otherwise take the first entry.
  int per_node = 0;
  if (auto value = env::get_int(env, "SLURM_NTASKS_PER_NODE", 1)) {
    per_node = static_cast<int>(*value);
  } else if (auto text = env::get(env, "SLURM_TASKS_PER_NODE")) {
    per_node = std::atoi(text->c_str());
  }
  job.local_world_size = per_node > 0 ? per_node : std::max(1, job.local_rank + 1);
  check_local(job, "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE");
  return job;
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
  return first.substr(0, open) + head;
}

JobSpec discover_job(const env::Environment& env, const std::string& master) {
  JobSpec job;
  if (env::get_bool(env, "SHOAL_ELASTIC").value_or(false)) {
    job.launcher = "shoal";
    job.elastic = true;
    job.local_world_size = optional_int(env, "SHOAL_LOCAL_WORLD_SIZE", 1, 1);
    return job;
  }
  if (env.count("SHOAL_RANK") || env.count("SHOAL_WORLD_SIZE")) {
    if (!env.count("SHOAL_RANK")) {
      throw UsageError("SHOAL_WORLD_SIZE is set but SHOAL_RANK is not; shoal run sets both");
    }
    return from_shoal(env);
  }
  if (env.count("RANK") || env.count("WORLD_SIZE")) return from_torchrun(env);
  if (env.count("OMPI_COMM_WORLD_RANK")) {
    job = from_openmpi(env);
    if (!take_user_master(env, master, job) && job.world_size > 1) {
      throw UsageError("an Open MPI job of " + std::to_string(job.world_size) +
                       " workers needs the master's address: set SHOAL_MASTER=HOST:PORT (or "
                       "MASTER_ADDR and MASTER_PORT), or pass InitOptions::master");
    }
    return job;
  }
  if (env.count("SLURM_PROCID")) {
    job = from_slurm(env);
    if (!take_user_master(env, master, job) && job.world_size > 1) {
      auto nodes = env::get(env, "SLURM_JOB_NODELIST");
      if (!nodes) nodes = env::get(env, "SLURM_NODELIST");
      if (!nodes || nodes->empty()) {
        throw UsageError("SLURM_JOB_NODELIST is not set; a Slurm job of " +
                         std::to_string(job.world_size) +
                         " workers needs it (or SHOAL_MASTER=HOST:PORT) to find its master");
      }
      job.master_addr = first_slurm_host(*nodes);
      job.master_port = optional_int(env, "MASTER_PORT", kDefaultMasterPort, 1, 65535);
      job.master_described_as = "the first host of SLURM_JOB_NODELIST";
    }
    return job;
  }
  return job;
}

}  // namespace shoal
