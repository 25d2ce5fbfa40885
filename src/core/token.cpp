#include "core/token.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>

#include "shoal/core/error.h"

namespace shoal {

std::string random_hex(int digits) {
  std::random_device device;
  std::uniform_int_distribution<int> digit(0, 15);
  std::string text;
  for (int i = 0; i < digits; ++i) text += "0123456789abcdef"[digit(device)];
  return text;
}

std::string make_token() { return random_hex(32); }

void write_token_file(const std::string& path, const std::string& token) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    throw UsageError("cannot create the job's token file " + path + ": " + std::strerror(errno) +
                     "; expected a path that does not exist yet");
  }
  const std::string line = token + "\n";
  const bool written = ::write(fd, line.data(), line.size()) == static_cast<ssize_t>(line.size());
  ::close(fd);
  if (!written) {
    ::unlink(path.c_str());
    throw UsageError("cannot write the job's token file " + path);
  }
}

std::string read_token_file(const std::string& path, const std::string& described_as) {
  struct stat info {};
  if (::stat(path.c_str(), &info) != 0) {
    throw UsageError(described_as + "=" + path + " cannot be read (" + std::strerror(errno) +
                     "); expected the job's token file");
  }
  if ((info.st_mode & 077) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof(mode), "%03o", static_cast<unsigned>(info.st_mode & 0777));
    throw UsageError(described_as + "=" + path + " can be read by other users (mode " + mode +
                     "); expected mode 600");
  }
  std::ifstream file(path);
  std::string token;
  std::getline(file, token);
  if (token.empty()) throw UsageError(described_as + "=" + path + " is empty; expected the job's token");
  return token;
}

}  // namespace shoal
