#include "snapshot.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <iostream>
#include <set>
#include <sstream>

#include "../core/hash.h"
#include "shoal/core/error.h"
#include "core/log.h"

namespace shoal::ps::detail {
namespace {

// Note [Snapshot file format]: native byte order, as the shards' own bytes (Note [Shard snapshot
// format] in table.cpp):
//   "SHOALPS1"  int64 step  int32 index  int32 servers  int32 count
//   count x (int32 shard  int64 length  length bytes)
//   uint64 fnv1a of everything before it
// The name repeats step, index and servers so that a directory listing finds the newest file
// without opening the others.
constexpr char kSnapshotMagic[8] = {'S', 'H', 'O', 'A', 'L', 'P', 'S', '1'};

template <typename T>
void append(std::string& out, T value) {
  out.append(reinterpret_cast<const char*>(&value), sizeof(value));
}

template <typename T>
bool take(const std::string& in, size_t& at, T& value) {
  if (in.size() - at < sizeof(T)) return false;
  std::memcpy(&value, in.data() + at, sizeof(T));
  at += sizeof(T);
  return true;
}

std::string file_name(int64_t step, int index, int servers) {
  char name[96];
  std::snprintf(name, sizeof(name), "snapshot-%012lld-server-%d-of-%d.bin",
                static_cast<long long>(step), index, servers);
  return name;
}

struct FileName {
  int64_t step = 0;
  int index = 0;
  int servers = 0;
};

std::optional<FileName> parse_name(const std::string& name) {
  long long step = 0;
  int index = 0, servers = 0, end = 0;
  if (std::sscanf(name.c_str(), "snapshot-%lld-server-%d-of-%d.bin%n", &step, &index, &servers,
                  &end) != 3 ||
      static_cast<size_t>(end) != name.size()) {
    return std::nullopt;
  }
  return FileName{step, index, servers};
}

std::vector<std::string> list_dir(const std::string& dir) {
  std::vector<std::string> names;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return names;
  while (dirent* entry = ::readdir(d)) names.emplace_back(entry->d_name);
  ::closedir(d);
  return names;
}

[[noreturn]] void fail(const std::string& what, const std::string& path) {
  throw UsageError("parameter server snapshot: cannot " + what + " " + path + ": " +
                   std::strerror(errno) + "; expected a writable --ps-snapshot-dir");
}

void write_all(int fd, const std::string& bytes, const std::string& path) {
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) fail("write", path);
    done += static_cast<size_t>(n);
  }
}

// The shards of one file, or nullopt when the file is not a whole snapshot.
std::optional<std::map<int32_t, std::string>> read_file(const std::string& path,
                                                        const FileName& name) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  std::stringstream buffer;
  buffer << in.rdbuf();
  const std::string bytes = buffer.str();
  if (bytes.size() < sizeof(kSnapshotMagic) + sizeof(uint64_t)) return std::nullopt;
  const size_t body = bytes.size() - sizeof(uint64_t);
  uint64_t checksum = 0;
  std::memcpy(&checksum, bytes.data() + body, sizeof(checksum));
  if (checksum != shoal::detail::fnv1a(std::string_view(bytes.data(), body))) return std::nullopt;
  if (std::memcmp(bytes.data(), kSnapshotMagic, sizeof(kSnapshotMagic)) != 0) return std::nullopt;
  size_t at = sizeof(kSnapshotMagic);
  int64_t step = 0;
  int32_t index = 0, servers = 0, count = 0;
  if (!take(bytes, at, step) || !take(bytes, at, index) || !take(bytes, at, servers) ||
      !take(bytes, at, count) || step != name.step || index != name.index ||
      servers != name.servers || count < 0) {
    return std::nullopt;
  }
  std::map<int32_t, std::string> shards;
  for (int32_t i = 0; i < count; ++i) {
    int32_t shard = 0;
    int64_t length = 0;
    if (!take(bytes, at, shard) || !take(bytes, at, length) || length < 0 ||
        static_cast<uint64_t>(length) > body - at) {
      return std::nullopt;
    }
    shards.emplace(shard, bytes.substr(at, static_cast<size_t>(length)));
    at += static_cast<size_t>(length);
  }
  if (at != body) return std::nullopt;
  return shards;
}

}  // namespace

void write_snapshot(const std::string& dir, int index, int servers, int64_t step,
                    const std::map<int32_t, std::string>& shards, int keep) {
  std::string bytes(kSnapshotMagic, sizeof(kSnapshotMagic));
  append(bytes, step);
  append(bytes, static_cast<int32_t>(index));
  append(bytes, static_cast<int32_t>(servers));
  append(bytes, static_cast<int32_t>(shards.size()));
  for (const auto& [shard, contents] : shards) {
    append(bytes, shard);
    append(bytes, static_cast<int64_t>(contents.size()));
    bytes += contents;
  }
  append(bytes, shoal::detail::fnv1a(bytes));

  // A crash leaves at most a temporary file, which the reader skips (and the next write of the
  // same name replaces); never a half-written file under the real name.
  const std::string path = dir + "/" + file_name(step, index, servers);
  const std::string temporary = path + ".tmp";
  const int fd = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail("create", temporary);
  try {
    write_all(fd, bytes, temporary);
    if (::fsync(fd) != 0) fail("fsync", temporary);
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
  if (::rename(temporary.c_str(), path.c_str()) != 0) fail("rename", temporary);
  // The rename itself is durable once the directory is.
  const int dir_fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd >= 0) {
    ::fsync(dir_fd);
    ::close(dir_fd);
  }

  std::vector<std::pair<int64_t, std::string>> own;
  for (const auto& name : list_dir(dir)) {
    const auto parsed = parse_name(name);
    if (parsed && parsed->index == index && parsed->servers == servers) {
      own.emplace_back(parsed->step, name);
    }
  }
  std::sort(own.rbegin(), own.rend());
  for (size_t i = static_cast<size_t>(std::max(keep, 1)); i < own.size(); ++i) {
    ::unlink((dir + "/" + own[i].second).c_str());
  }
}

std::optional<Snapshot> read_newest_snapshot(const std::string& dir,
                                             const std::vector<int32_t>& shards) {
  // step -> servers -> files: a step is complete for one server count at a time.
  std::map<int64_t, std::map<int, std::vector<std::pair<std::string, FileName>>>, std::greater<>>
      by_step;
  for (const auto& name : list_dir(dir)) {
    if (const auto parsed = parse_name(name)) {
      by_step[parsed->step][parsed->servers].emplace_back(dir + "/" + name, *parsed);
    }
  }
  for (const auto& [step, counts] : by_step) {
    for (const auto& [servers, files] : counts) {
      Snapshot snapshot;
      snapshot.step = step;
      const std::set<int32_t> wanted(shards.begin(), shards.end());
      for (const auto& [path, name] : files) {
        auto contents = read_file(path, name);
        if (!contents) continue;
        bool used = false;
        for (auto& [shard, bytes] : *contents) {
          if (wanted.count(shard) == 0 || snapshot.shards.count(shard) != 0) continue;
          snapshot.shards.emplace(shard, std::move(bytes));
          used = true;
        }
        if (used) snapshot.files.push_back(path);
      }
      if (snapshot.shards.size() == wanted.size()) return snapshot;
    }
  }
  return std::nullopt;
}

SnapshotWriter::SnapshotWriter(std::string dir, int64_t every, int index, int servers, bool restore)
    : dir_(std::move(dir)), every_(every), index_(index), servers_(servers), restore_(restore) {
  if (::mkdir(dir_.c_str(), 0755) != 0 && errno != EEXIST) {
    throw UsageError("--snapshot-dir " + dir_ + " cannot be created: " + std::strerror(errno) +
                     "; expected a writable directory");
  }
  thread_ = std::thread([this] { run(); });
}

SnapshotWriter::~SnapshotWriter() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  ready_.notify_all();
  thread_.join();
}

void SnapshotWriter::hand(int64_t step, std::map<int32_t, std::string> shards) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    pending_ = Pending{step, std::move(shards)};
  }
  ready_.notify_all();
}

void SnapshotWriter::run() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    ready_.wait(lock, [&] { return stop_ || pending_; });
    if (!pending_) return;  // stopping with nothing left to write
    Pending next = std::move(*pending_);
    pending_.reset();
    lock.unlock();
    try {
      write_snapshot(dir_, index_, servers_, next.step, next.shards);
    } catch (const std::exception& e) {
      log::error(e.what());
    }
    lock.lock();
  }
}

}  // namespace shoal::ps::detail
