#include "comm/shm/segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <sstream>
#include <utility>

#include "comm/shm/locality.h"
#include "core/hash.h"
#include "shoal/core/error.h"

namespace shoal::comm::shm {
namespace {

constexpr uint64_t kMagic = 0x6d68732d6c616f73ULL;  // "shoal-shm"
constexpr uint32_t kVersion = 3;
constexpr size_t kPage = 4096;

size_t round_up(size_t n, size_t to) {
  return (n + to - 1) / to * to;
}

// Where each part of a segment starts; creator and openers compute it from the same header.
struct SegmentLayout {
  size_t members, published, channels, rings, data, total;
  SegmentLayout(size_t k, size_t slot_bytes, size_t channel_bytes) {
    members = kPage;
    published = round_up(members + k * sizeof(MemberBlock), 128);
    channels = round_up(published + k * 2 * (2 * k + 2) * sizeof(int64_t), kPage);
    rings = round_up(channels + k * k * sizeof(ChannelBlock), kPage);
    data = round_up(rings + k * k * channel_bytes, kPage);
    total = data + 2 * k * slot_bytes;
  }
};
static_assert(sizeof(SegmentHeader) <= kPage, "the header fits its page");

using shoal::detail::hex;

std::string errno_text() {
  return std::strerror(errno);
}

// Opens a memfd through /proc that must hold `bytes` and be sealed against resizing; `refused`
// makes the CommError that names what was wrong.
template <typename Refused>
int open_sealed(const std::string& path, size_t bytes, const char* what, const Refused& refused,
                bool read_only = false) {
  const int fd = ::open(path.c_str(), (read_only ? O_RDONLY : O_RDWR) | O_CLOEXEC);
  if (fd < 0)
    throw refused("cannot open " + path + ": " + errno_text() + " (has its creator ended?)");
  struct stat st {};
  std::string wrong;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) ||
      static_cast<unsigned long long>(st.st_size) != bytes) {
    wrong = path + " is not a " + what + " of " + std::to_string(bytes) + " bytes";
  } else if (const int seals = fcntl(fd, F_GET_SEALS);
             seals < 0 ||
             (seals & (F_SEAL_SHRINK | F_SEAL_GROW)) != (F_SEAL_SHRINK | F_SEAL_GROW)) {
    wrong = path + " is not sealed against resizing";
  }
  if (!wrong.empty()) {
    ::close(fd);
    throw refused(wrong);
  }
  return fd;
}

}  // namespace

Segment Segment::create(int size, const SegmentSizes& requested) {
  if (size < 1)
    throw UsageError("shared memory: a group needs at least 1 member, got " + std::to_string(size));
  SegmentSizes sizes = requested;
  if (sizes.channel_bytes == 0) sizes.channel_bytes = default_channel_bytes(size);
  if (sizes.channel_bytes < 4096 || (sizes.channel_bytes & (sizes.channel_bytes - 1)) != 0 ||
      sizes.channel_bytes > (size_t{1} << 30)) {
    throw UsageError("shared memory: channel_bytes " + std::to_string(sizes.channel_bytes) +
                     " must be a power of two from 4096 to 2^30");
  }
  if (sizes.slot_bytes < 4096) {
    throw UsageError("shared memory: slot_bytes " + std::to_string(sizes.slot_bytes) +
                     " must be at least 4096");
  }
  const size_t slot_bytes = round_up(sizes.slot_bytes, 128);  // keeps every slot 128-byte aligned
  const SegmentLayout layout(size, slot_bytes, sizes.channel_bytes);
  unsigned char tag[16];
  if (getrandom(tag, sizeof(tag), 0) != static_cast<ssize_t>(sizeof(tag))) {
    throw CommError("shared memory: getrandom failed: " + errno_text());
  }
  Segment segment;
  segment.memory_ = Mapping::create(kMemfdPrefix + hex(tag, 8), layout.total);
  SegmentHeader* h = segment.header();
  h->magic = kMagic;
  h->version = kVersion;
  h->size = static_cast<uint32_t>(size);
  std::memcpy(h->tag, tag, sizeof(tag));
  h->slot_bytes = slot_bytes;
  h->channel_bytes = sizes.channel_bytes;
  h->total_bytes = layout.total;
  h->failed.store(0);
  h->next_chunk.store(0);
  segment.handle_ = "shm1 " + std::to_string(getpid()) + " " +
                    std::to_string(segment.memory_.fd()) + " " + locality_key() + " " +
                    hex(tag, sizeof(tag)) + " " + std::to_string(layout.total);
  return segment;
}

Segment Segment::open(const std::string& handle, int size) {
  auto refused = [&](const std::string& why) {
    return CommError("shared memory: segment '" + handle.substr(0, 240) + "' refused: " + why);
  };
  std::istringstream in(handle);
  std::string version, key, tag;
  long long pid = 0, fd = -1;
  unsigned long long bytes = 0;
  if (!(in >> version >> pid >> fd >> key >> tag >> bytes) || version != "shm1" || pid <= 0 ||
      fd < 0 || tag.size() != 32 || !(in >> std::ws).eof()) {
    throw refused("expected \"shm1 <pid> <fd> <locality key> <tag of 32 hex digits> <bytes>\"");
  }
  if (key != locality_key()) {
    throw refused("made where the locality key is " + key + ", here it is " + locality_key());
  }
  const std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
  Segment segment;
  const int opened = open_sealed(path, bytes, "segment", refused);
  segment.memory_.fd_ = opened;
  segment.memory_.map(opened, bytes);
  const SegmentHeader* h = segment.header();
  // The tag first: a segment of another job says nothing else that is worth reading.
  if (hex(h->tag, sizeof(h->tag)) != tag) {
    throw refused(path + " carries tag " + hex(h->tag, sizeof(h->tag)) +
                  ", not the group's (a segment of another group or job)");
  }
  if (h->magic != kMagic || h->version != kVersion) {
    throw refused(path + " has version " + std::to_string(h->version) + ", expected " +
                  std::to_string(kVersion));
  }
  if (static_cast<int>(h->size) != size) {
    throw refused("it is for " + std::to_string(h->size) + " members, the group has " +
                  std::to_string(size));
  }
  if (SegmentLayout(h->size, h->slot_bytes, h->channel_bytes).total != bytes || h->total_bytes != bytes) {
    throw refused("its header does not describe its " + std::to_string(bytes) + " bytes");
  }
  return segment;
}

Mapping Mapping::create(const std::string& name, size_t bytes) {
  Mapping mapping;
  mapping.fd_ = memfd_create(name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (mapping.fd_ < 0) throw CommError("shared memory: memfd_create failed: " + errno_text());
  if (ftruncate(mapping.fd_, static_cast<off_t>(bytes)) != 0 ||
      fcntl(mapping.fd_, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    throw CommError("shared memory: cannot size and seal a memfd of " + std::to_string(bytes) +
                    " bytes: " + errno_text());
  }
  mapping.map(mapping.fd_, bytes);
  return mapping;
}

Mapping Mapping::open(int pid, int fd, const std::string& name, size_t bytes, bool read_only) {
  const std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
  auto refused = [&](const std::string& why) {
    return CommError("shared memory: buffer " + path + " refused: " + why);
  };
  // The name first: a reused fd number of another file says nothing else worth reading.
  char link[256];
  const ssize_t n = readlink(path.c_str(), link, sizeof(link) - 1);
  const std::string expected = "/memfd:" + name + " (deleted)";
  if (n < 0) throw refused("cannot read the link: " + errno_text() + " (has its creator ended?)");
  if (std::string(link, static_cast<size_t>(n)) != expected) {
    throw refused("it is " + std::string(link, static_cast<size_t>(n)) + ", expected " + expected);
  }
  Mapping mapping;
  mapping.fd_ = open_sealed(path, bytes, "shared buffer", refused, read_only);
  mapping.map(mapping.fd_, bytes, read_only);
  mapping.close_fd();  // the mapping keeps the memory; only the creator's fd is ever opened
  return mapping;
}

void Mapping::map(int fd, size_t bytes, bool read_only) {
  void* base =
      mmap(nullptr, bytes, read_only ? PROT_READ : PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) {
    throw CommError("shared memory: cannot map " + std::to_string(bytes) +
                    " bytes: " + errno_text());
  }
  base_ = base;
  bytes_ = bytes;
}

Mapping::Mapping(Mapping&& other) noexcept {
  *this = std::move(other);
}

Mapping& Mapping::operator=(Mapping&& other) noexcept {
  if (this != &other) {
    release();
    fd_ = std::exchange(other.fd_, -1);
    base_ = std::exchange(other.base_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

Mapping::~Mapping() {
  release();
}

void Mapping::close_fd() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

void Mapping::release() {
  if (base_ != nullptr) munmap(base_, bytes_);
  close_fd();
  base_ = nullptr;
}

std::string Segment::buffer_name(int64_t id) const {
  return kMemfdPrefix + hex(header()->tag, 8) + "-" + std::to_string(id);
}

MemberBlock* Segment::member(int m) const {
  const SegmentLayout l(header()->size, header()->slot_bytes, header()->channel_bytes);
  return reinterpret_cast<MemberBlock*>(reinterpret_cast<char*>(memory_.data()) + l.members) + m;
}

int64_t* Segment::published(int m) const {
  const size_t k = header()->size;
  const SegmentLayout l(k, header()->slot_bytes, header()->channel_bytes);
  return reinterpret_cast<int64_t*>(reinterpret_cast<char*>(memory_.data()) + l.published) +
         m * 2 * (2 * k + 2);
}

ChannelBlock* Segment::channel(int from, int to) const {
  const size_t k = header()->size;
  const SegmentLayout l(k, header()->slot_bytes, header()->channel_bytes);
  return reinterpret_cast<ChannelBlock*>(reinterpret_cast<char*>(memory_.data()) + l.channels) +
         from * k + to;
}

unsigned char* Segment::ring(int from, int to) const {
  const size_t k = header()->size;
  const SegmentLayout l(k, header()->slot_bytes, header()->channel_bytes);
  return memory_.data() + l.rings + (from * k + to) * header()->channel_bytes;
}

unsigned char* Segment::slot(int buffer, int m) const {
  const size_t k = header()->size;
  const SegmentLayout l(k, header()->slot_bytes, header()->channel_bytes);
  return memory_.data() + l.data + (buffer * k + m) * header()->slot_bytes;
}

}  // namespace shoal::comm::shm
