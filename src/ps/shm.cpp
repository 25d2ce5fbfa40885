#include "shm.h"

#include <unistd.h>

#include <cstring>
#include <fstream>
#include <random>
#include <sstream>

#include "../core/hash.h"
#include "shoal/core/error.h"

namespace shoal::ps::detail {
namespace {

// The tag, the sequence (SharedSequence), then room to keep the values 64-byte aligned.
constexpr size_t kHeaderBytes = 64;
constexpr size_t kTagBytes = 16;
constexpr size_t kSequenceAt = 16;
constexpr char kMemfdName[] = "shoal-ps";

using shoal::detail::hex;

}  // namespace

const std::string& boot_id() {
  static const std::string id = [] {
    std::ifstream in("/proc/sys/kernel/random/boot_id");
    std::string line;
    std::getline(in, line);
    return line;
  }();
  return id;
}

std::unique_ptr<SharedSegment> SharedSegment::create(size_t floats) {
  if (boot_id().empty()) return nullptr;
  std::unique_ptr<SharedSegment> segment(new SharedSegment());
  try {
    segment->memory_ =
        comm::shm::Mapping::create(kMemfdName, kHeaderBytes + floats * sizeof(float));
  } catch (const CommError&) {
    return nullptr;
  }
  unsigned char* base = segment->memory_.data();
  unsigned char tag[kTagBytes];
  std::random_device random;
  for (auto& byte : tag) byte = static_cast<unsigned char>(random());
  std::memcpy(base, tag, kTagBytes);
  segment->values_ = {reinterpret_cast<float*>(base + kHeaderBytes), floats};
  segment->handle_ = "v1 " + std::to_string(getpid()) + " " +
                     std::to_string(segment->memory_.fd()) + " " + boot_id() + " " +
                     hex(tag, kTagBytes) + " " + std::to_string(segment->memory_.bytes());
  return segment;
}

SharedSequence SharedSegment::sequence() const {
  return SharedSequence(reinterpret_cast<uint64_t*>(memory_.data() + kSequenceAt));
}

SharedSequence SegmentMapping::sequence() const {
  return SharedSequence(reinterpret_cast<uint64_t*>(memory_.data() + kSequenceAt));
}

std::shared_ptr<const SegmentMapping> SegmentMappings::open(const std::string& handle) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = kept_.begin(); it != kept_.end(); ++it) {
      if (it->first == handle) {
        kept_.splice(kept_.begin(), kept_, it);
        return kept_.front().second;
      }
    }
  }
  auto unusable = [&](const std::string& why) {
    return SegmentUnusable("shared segment '" + handle.substr(0, 200) + "': " + why);
  };
  std::istringstream in(handle);
  std::string version, boot, tag;
  long long pid = 0, fd = 0;
  unsigned long long bytes = 0;
  if (!(in >> version >> pid >> fd >> boot >> tag >> bytes) || version != "v1" || pid <= 0 ||
      fd < 0 || tag.size() != 2 * kTagBytes || bytes < kHeaderBytes ||
      (bytes - kHeaderBytes) % sizeof(float) != 0 || !(in >> std::ws).eof()) {
    throw unusable("expected \"v1 <pid> <fd> <boot id> <tag of 32 hex digits> <bytes>\"");
  }
  if (boot != boot_id()) throw unusable("on another host (boot id " + boot_id() + " here)");
  std::shared_ptr<SegmentMapping> mapping(new SegmentMapping());
  try {
    mapping->memory_ = comm::shm::Mapping::open(static_cast<int>(pid), static_cast<int>(fd),
                                                kMemfdName, bytes, read_only_);
  } catch (const CommError& e) {
    throw unusable(e.what());
  }
  const unsigned char* base = mapping->memory_.data();
  if (hex(base, kTagBytes) != tag) throw unusable("it does not carry the tag named");
  mapping->values_ = {reinterpret_cast<float*>(mapping->memory_.data() + kHeaderBytes),
                      (bytes - kHeaderBytes) / sizeof(float)};
  std::lock_guard<std::mutex> lock(mutex_);
  kept_.emplace_front(handle, mapping);
  while (kept_.size() > kept_count_) kept_.pop_back();
  return mapping;
}

}  // namespace shoal::ps::detail
