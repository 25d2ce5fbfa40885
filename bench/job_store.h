// For the benchmarks: a client of the job's store of its own, beside the one shoal::init() holds,
// so that a benchmark can build reference groups (raw c10d) over the same rendezvous.
#pragma once

#include "shoal/shoal.h"
#include "comm/store.h"

inline shoal::comm::StorePtr open_job_store() {
  const auto& job = shoal::job();
  shoal::comm::StoreOptions options;
  options.host = job.master_addr;
  options.port = job.master_port;
  options.described_as = job.master_described_as;
  return shoal::comm::open_store(options);
}
