// elastic::EtcdJob (src/elastic/membership.h): a launcher's hold on the job's record in etcd.
#include "../membership.h"

#include <algorithm>
#include <thread>

#include "client.h"
#include "job.h"
#include "shoal/core/error.h"

namespace shoal::elastic {
namespace {

// How long one request to etcd may take, and how long to wait before trying again one that
// etcd did not answer.
constexpr Duration kEtcdRequestTimeout{2000};
constexpr Duration kEtcdRetryInterval{200};

}  // namespace

EtcdJob::EtcdJob(const std::string& endpoint, const std::string& run_id,
                 const std::string& token, const JobSettings& settings, bool create,
                 Duration timeout)
    : client_(std::make_unique<etcd::Client>(etcd::Endpoint::parse(endpoint),
                                             kEtcdRequestTimeout)),
      prefix_(etcd::job_prefix(run_id)) {
  etcd::JobRecord record;
  record.min_workers = settings.min_workers;
  record.max_workers = settings.max_workers;
  record.quorum = settings.quorum;
  record.last_call = settings.last_call;
  Deadline deadline(timeout);
  for (;;) {
    try {
      record = etcd::open_job(*client_, prefix_, token, record, create);
      break;
    } catch (const CommError&) {
      if (deadline.expired()) throw;
      std::this_thread::sleep_for(std::min(kEtcdRetryInterval, deadline.remaining()));
    }
  }
  settings_.min_workers = record.min_workers;
  settings_.max_workers = record.max_workers;
  settings_.quorum = record.quorum;
  settings_.last_call = record.last_call;
}

EtcdJob::~EtcdJob() = default;

void EtcdJob::forget_if_done() const {
  etcd::forget_job_if_done(*client_, prefix_);
}

}  // namespace shoal::elastic
