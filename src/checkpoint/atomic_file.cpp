#include "atomic_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "shoal/core/error.h"

namespace shoal::checkpoint {
namespace {

// An owned file descriptor. (launch/fd.h has one too, but launch is a higher layer.)
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  // Closes now, reporting the error: on some filesystems (NFS) a failed write surfaces only here.
  int close() { return ::close(std::exchange(fd_, -1)); }

 private:
  int fd_;
};

// Removes the temporary file unless the rename took it.
class TemporaryFile {
 public:
  explicit TemporaryFile(std::string path) : path_(std::move(path)) {}
  TemporaryFile(const TemporaryFile&) = delete;
  TemporaryFile& operator=(const TemporaryFile&) = delete;
  ~TemporaryFile() {
    if (!path_.empty()) ::unlink(path_.c_str());
  }
  const std::string& path() const { return path_; }
  void release() { path_.clear(); }

 private:
  std::string path_;
};

std::string os_error(int error) { return std::strerror(error); }

std::string directory_of(const std::string& path) {
  const auto slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

// Raises for the failed system call whose errno is `error`. Callers read errno before building
// any string: an allocation may change it.
[[noreturn]] void fail(const std::string& path, const std::string& what, int error) {
  throw UsageError("checkpoint " + path + ": " + what + ": " + os_error(error));
}

}  // namespace

std::string temporary_path(const std::string& path) { return path + ".tmp-" + std::to_string(::getpid()); }

void write_file_atomically(const std::string& path, const std::vector<std::string_view>& parts) {
  const std::string temporary_name = temporary_path(path);
  Fd fd(::open(temporary_name.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  // Nothing was created, so there is nothing to remove yet.
  if (!fd.valid()) {
    const int error = errno;
    fail(path, "cannot create " + temporary_name + " (expected a writable directory)", error);
  }
  TemporaryFile temporary(temporary_name);
  size_t total = 0, written = 0;
  for (auto part : parts) total += part.size();
  for (auto part : parts) {
    while (!part.empty()) {
      const ssize_t n = ::write(fd.get(), part.data(), part.size());
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        const int error = n < 0 ? errno : EIO;
        fail(path, "writing " + temporary.path() + " failed after " + std::to_string(written) + " of " +
                       std::to_string(total) + " bytes",
             error);
      }
      part.remove_prefix(static_cast<size_t>(n));
      written += static_cast<size_t>(n);
    }
  }
  // Without the fsync a power loss after the rename could leave `path` naming a file whose
  // blocks never reached the disk.
  if (::fsync(fd.get()) != 0) {
    const int error = errno;
    fail(path, "fsync of " + temporary.path() + " failed", error);
  }
  if (fd.close() != 0) {
    const int error = errno;
    fail(path, "closing " + temporary.path() + " failed", error);
  }
  if (::rename(temporary.path().c_str(), path.c_str()) != 0) {
    const int error = errno;
    fail(path, "cannot rename " + temporary.path() + " to it", error);
  }
  temporary.release();
  // The rename is durable only once the directory is: without this fsync a power loss could
  // bring back the old file (or none).
  const std::string directory = directory_of(path);
  Fd dir(::open(directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  // EINVAL: the filesystem can't sync directories (some FUSE and network filesystems); the
  // rename is then as durable as that filesystem makes it.
  if (!dir.valid() || (::fsync(dir.get()) != 0 && errno != EINVAL)) {
    const int error = errno;
    fail(path, "it was written, but the fsync of its directory " + directory + " failed", error);
  }
}

std::string read_whole_file(const std::string& path) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) {
    const int error = errno;
    fail(path, "cannot open it (expected a file written by shoal::save)", error);
  }
  struct stat status {};
  if (::fstat(fd.get(), &status) != 0) {
    const int error = errno;
    fail(path, "cannot stat it", error);
  }
  if (S_ISDIR(status.st_mode)) {
    throw UsageError("checkpoint " + path + " is a directory; expected a file written by shoal::save");
  }
  // The size is a hint only: reading on to the end also works for files that report none.
  std::string content(static_cast<size_t>(std::max<off_t>(status.st_size, 0)), '\0');
  size_t got = 0;
  char more[1 << 16];
  for (;;) {
    const bool full = got == content.size();
    const ssize_t n = full ? ::read(fd.get(), more, sizeof(more)) : ::read(fd.get(), &content[got], content.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int error = errno;
      fail(path, "reading it failed after " + std::to_string(got) + " bytes", error);
    }
    if (n == 0) break;
    if (full) content.append(more, static_cast<size_t>(n));
    got += static_cast<size_t>(n);
  }
  content.resize(got);
  return content;
}

}  // namespace shoal::checkpoint
