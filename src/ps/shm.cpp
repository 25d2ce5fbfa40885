#include "shm.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>

namespace shoal::ps::detail {
namespace {

// The tag, then room to keep the values 64-byte aligned.
constexpr size_t kHeaderBytes = 64;
constexpr size_t kTagBytes = 16;

std::string hex(const unsigned char* bytes, size_t n) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (size_t i = 0; i < n; ++i) {
    out += digits[bytes[i] >> 4];
    out += digits[bytes[i] & 15];
  }
  return out;
}

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
  segment->bytes_ = kHeaderBytes + floats * sizeof(float);
  segment->fd_ = memfd_create("shoal-ps", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (segment->fd_ < 0) return nullptr;
  if (ftruncate(segment->fd_, static_cast<off_t>(segment->bytes_)) != 0 ||
      fcntl(segment->fd_, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    return nullptr;
  }
  void* base = mmap(nullptr, segment->bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, segment->fd_, 0);
  if (base == MAP_FAILED) return nullptr;
  segment->base_ = base;
  unsigned char tag[kTagBytes];
  std::random_device random;
  for (auto& byte : tag) byte = static_cast<unsigned char>(random());
  std::memcpy(base, tag, kTagBytes);
  segment->values_ = {reinterpret_cast<float*>(static_cast<char*>(base) + kHeaderBytes), floats};
  segment->handle_ = "v1 " + std::to_string(getpid()) + " " + std::to_string(segment->fd_) + " " +
                     boot_id() + " " + hex(tag, kTagBytes) + " " + std::to_string(segment->bytes_);
  return segment;
}

SharedSegment::~SharedSegment() {
  if (base_ != nullptr) munmap(base_, bytes_);
  if (fd_ >= 0) close(fd_);
}

SegmentMapping::~SegmentMapping() {
  if (base_ != nullptr) munmap(base_, bytes_);
  if (fd_ >= 0) close(fd_);
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
  const std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
  std::shared_ptr<SegmentMapping> mapping(new SegmentMapping());
  mapping->fd_ = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (mapping->fd_ < 0) throw unusable("cannot open " + path + ": " + std::strerror(errno));
  struct stat st {};
  if (fstat(mapping->fd_, &st) != 0 || !S_ISREG(st.st_mode) ||
      static_cast<unsigned long long>(st.st_size) != bytes) {
    throw unusable(path + " is not a segment of " + std::to_string(bytes) + " bytes");
  }
  const int seals = fcntl(mapping->fd_, F_GET_SEALS);
  if (seals < 0 || (seals & F_SEAL_SHRINK) == 0) {
    throw unusable(path + " is not sealed against shrinking");
  }
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, mapping->fd_, 0);
  if (base == MAP_FAILED) throw unusable("cannot map " + path + ": " + std::strerror(errno));
  mapping->base_ = base;
  mapping->bytes_ = bytes;
  if (hex(static_cast<const unsigned char*>(base), kTagBytes) != tag) {
    throw unusable(path + " does not carry the tag named");
  }
  mapping->values_ = {reinterpret_cast<float*>(static_cast<char*>(base) + kHeaderBytes),
                      (bytes - kHeaderBytes) / sizeof(float)};
  std::lock_guard<std::mutex> lock(mutex_);
  kept_.emplace_front(handle, mapping);
  if (kept_.size() > kKept) kept_.pop_back();
  return mapping;
}

}  // namespace shoal::ps::detail
