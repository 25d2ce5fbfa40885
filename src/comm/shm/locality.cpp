#include "comm/shm/locality.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>

#include "shoal/core/error.h"

namespace shoal::comm::shm {
namespace {

std::string namespace_inode(const char* kind) {
  const std::string path = std::string("/proc/self/ns/") + kind;
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    throw CommError("shared memory: cannot stat " + path + ": " + std::strerror(errno) +
                    " (expected /proc to be mounted)");
  }
  return std::to_string(static_cast<unsigned long long>(st.st_ino));
}

}  // namespace

const std::string& boot_id() {
  static const std::string id = [] {
    std::ifstream in("/proc/sys/kernel/random/boot_id");
    std::string line;
    std::getline(in, line);
    if (line.size() != 36) {
      throw CommError("shared memory: /proc/sys/kernel/random/boot_id gave '" + line +
                      "', expected a 36-character UUID");
    }
    return line;
  }();
  return id;
}

// Not cached: a process may move to another namespace (setns, unshare) after asking once.
std::string locality_key() {
  return boot_id() + "/net:" + namespace_inode("net") + "/pid:" + namespace_inode("pid") +
         "/uid:" + std::to_string(::geteuid());
}

}  // namespace shoal::comm::shm
