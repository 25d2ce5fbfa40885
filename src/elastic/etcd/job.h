// An elastic job's record in etcd, under its prefix: the settings a joining `shoal run` takes
// from the job, and a digest of the job's token that whoever joins must match. See
// docs/elastic.md, "The etcd backend".
#pragma once

#include <string>

#include "client.h"
#include "shoal/core/timeout.h"

namespace shoal::elastic::etcd {

struct JobRecord {
  int min_workers = 1;
  int max_workers = 1;
  bool quorum = false;
  Duration last_call{0};
};

// Where the keys of the job with this run id go: "/shoal/<run id>/".
std::string job_prefix(const std::string& run_id);

// Creates the job's record with `record` and `token`'s digest when there is none (`create`), and
// returns the job's record, which exists or was just made. UsageError when `token` is not the
// job's (nothing is written), or when there is no record and `create` is false; CommError when
// etcd does not answer.
JobRecord open_job(const Client& client, const std::string& prefix, const std::string& token,
                   const JobRecord& record, bool create);

// Deletes every key of the job once no worker is registered in it any more. Best effort.
void forget_job_if_done(const Client& client, const std::string& prefix);

}  // namespace shoal::elastic::etcd
