#include "ledger.h"

#include <algorithm>
#include <string>

#include "shoal/core/error.h"

namespace shoal::ps::detail {

Ledger::Ledger(Options options) : options_(options) {
  if (options_.dataset_size < 0 || options_.batch_size < 1) {
    throw UsageError("parameter server: a ledger of " + std::to_string(options_.dataset_size) +
                     " samples in batches of " + std::to_string(options_.batch_size) +
                     "; expected at least 0 samples and batches of at least 1");
  }
}

int64_t Ledger::batches_per_epoch() const {
  const int64_t size = options_.dataset_size, batch = options_.batch_size;
  return options_.drop_last ? size / batch : (size + batch - 1) / batch;
}

Ledger::Lease Ledger::lease(int32_t worker, int64_t epoch) {
  Lease lease;
  lease.epoch = epoch;
  if (epoch < epoch_) {
    lease.kind = Lease::Kind::kEpochDone;
    return lease;
  }
  if (epoch > epoch_ + 1) {
    throw UsageError("parameter server: worker " + std::to_string(worker) +
                     " asked for a batch of epoch " + std::to_string(epoch) + "; expected epoch " +
                     std::to_string(epoch_) + " (the open one) or " + std::to_string(epoch_ + 1));
  }
  if (epoch == epoch_ + 1) {
    if (!epoch_done()) {
      lease.kind = Lease::Kind::kWait;  // batches of the open epoch are still out
      return lease;
    }
    epoch_ = epoch;
    next_ = 0;
    done_ = 0;
  }
  int64_t batch;
  if (!returned_.empty()) {
    batch = *returned_.begin();
    returned_.erase(returned_.begin());
  } else if (next_ < batches_per_epoch()) {
    batch = next_++;
  } else {
    lease.kind = out_.empty() ? Lease::Kind::kEpochDone : Lease::Kind::kWait;
    return lease;
  }
  out_.emplace(batch, worker);
  lease.kind = Lease::Kind::kBatch;
  lease.batch = batch;
  lease.begin = batch * options_.batch_size;
  lease.end = std::min(lease.begin + options_.batch_size, options_.dataset_size);
  return lease;
}

void Ledger::take_back(int32_t worker, int64_t epoch, int64_t batch, const char* verb,
                       const char* after) {
  if (!is_out(worker, epoch, batch)) {
    throw UsageError("parameter server: worker " + std::to_string(worker) + " " + verb + " batch " +
                     std::to_string(batch) + " of epoch " + std::to_string(epoch) + after +
                     "; expected a batch of epoch " + std::to_string(epoch_) +
                     " leased to it and not yet done");
  }
  out_.erase(batch);
}

void Ledger::done(int32_t worker, int64_t epoch, int64_t batch) {
  take_back(worker, epoch, batch, "reported", " trained");
  ++done_;
}

void Ledger::give_back(int32_t worker, int64_t epoch, int64_t batch) {
  take_back(worker, epoch, batch, "gave back", "");
  returned_.insert(batch);
}

bool Ledger::is_out(int32_t worker, int64_t epoch, int64_t batch) const {
  auto it = out_.find(batch);
  return epoch == epoch_ && it != out_.end() && it->second == worker;
}

int64_t Ledger::release(int32_t worker, const std::set<int64_t>& keep) {
  int64_t count = 0;
  for (auto it = out_.begin(); it != out_.end();) {
    if (it->second == worker && keep.count(it->first) == 0) {
      returned_.insert(it->first);
      it = out_.erase(it);
      ++count;
    } else {
      ++it;
    }
  }
  return count;
}

}  // namespace shoal::ps::detail
