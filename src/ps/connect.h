// How a job's workers and servers find each other through the job's store (docs/ps.md,
// "Processes"): server i publishes "host:port" under server_key(i); a worker waits for all of them
// and opens one RpcClient per server. Both sides take the job's token from the environment.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "rpc.h"
#include "comm/store.h"
#include "shoal/core/env.h"

namespace shoal::ps::detail {

// "ps/server/<index>": the address of server <index> (its primary, when it has a backup).
std::string server_key(int index);
// "ps/server/<index>/backup": the address of its backup (`shoal run --ps-replicas 2`), published
// before server_key(index).
std::string backup_key(int index);
// "ps/server/<index>/lost": set by the launcher when the primary died while its backup runs, so
// that a worker still waiting for the primary's address takes the backup's instead.
std::string lost_primary_key(int index);

// The job's token: SHOAL_JOB_TOKEN, or the file named by SHOAL_JOB_TOKEN_FILE. UsageError when
// neither is set (`shoal run --servers` sets SHOAL_JOB_TOKEN).
std::string job_token(const env::Environment& env);

// SHOAL_PS_SERVERS: how many servers the job has; 0 when unset. UsageError when not a count.
int server_count(const env::Environment& env);

// Waits (until `timeout` in all) for the addresses of servers 0..count-1 and for each to answer
// a Ping, and returns their clients in index order (a server with a backup gets a client that
// fails over to it, see RpcClient). CommError naming the first server that was not published or
// did not answer in time.
std::vector<std::unique_ptr<RpcClient>> connect_servers(const comm::StorePtr& store, int count,
                                                        const std::string& token, Duration timeout);

}  // namespace shoal::ps::detail
