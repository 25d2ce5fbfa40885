// shoal's logger (src/core/log.h): SHOAL_LOG_LEVEL hides the levels below it, the lines are the
// callers' text as it is, and a value it does not know is said once and taken as info. The level
// is read once per process, so each case runs in a forked child whose stderr is a pipe.
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

#include <gtest/gtest.h>

#include "core/log.h"

namespace {

// What a child with these two variables (nullptr: unset) writes on stderr when it logs one line
// at each level.
std::string logged(const char* level, const char* elastic_debug) {
  int pipe_fds[2];
  if (::pipe(pipe_fds) != 0) return "pipe failed";
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(pipe_fds[1], STDERR_FILENO);
    ::close(pipe_fds[0]);
    ::close(pipe_fds[1]);
    if (level)
      ::setenv("SHOAL_LOG_LEVEL", level, 1);
    else
      ::unsetenv("SHOAL_LOG_LEVEL");
    if (elastic_debug)
      ::setenv("SHOAL_ELASTIC_DEBUG", elastic_debug, 1);
    else
      ::unsetenv("SHOAL_ELASTIC_DEBUG");
    namespace log = shoal::log;
    log::debug("d {} 100%");  // braces and percent signs are text, not a format
    log::info(log::line("i ", 1, ' ', 2.5));
    log::warn("w");
    log::error("e");
    std::_Exit(0);
  }
  ::close(pipe_fds[1]);
  std::string out;
  char buffer[256];
  for (ssize_t n; (n = ::read(pipe_fds[0], buffer, sizeof(buffer))) > 0;) out.append(buffer, n);
  ::close(pipe_fds[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return out;
}

TEST(Log, TheLevelHidesLowerLinesAndTheTextIsTheCallers) {
  EXPECT_EQ(logged(nullptr, nullptr), "i 1 2.5\nw\ne\n");
  EXPECT_EQ(logged("info", nullptr), "i 1 2.5\nw\ne\n");
  EXPECT_EQ(logged("debug", nullptr), "d {} 100%\ni 1 2.5\nw\ne\n");
  EXPECT_EQ(logged("warn", nullptr), "w\ne\n");
  EXPECT_EQ(logged("error", nullptr), "e\n");
  EXPECT_EQ(logged("off", nullptr), "");
}

TEST(Log, ElasticDebugIsDebugWhenNoLevelIsSet) {
  EXPECT_EQ(logged(nullptr, "1"), "d {} 100%\ni 1 2.5\nw\ne\n");
  EXPECT_EQ(logged(nullptr, "0"), "i 1 2.5\nw\ne\n");
  EXPECT_EQ(logged("warn", "1"), "w\ne\n");  // the level, when set, decides
}

TEST(Log, AnUnknownLevelIsSaidOnceAndTakenAsInfo) {
  EXPECT_EQ(logged("verbose", nullptr),
            "shoal: SHOAL_LOG_LEVEL=verbose; expected debug, info, warn, error or off (info is "
            "used)\ni 1 2.5\nw\ne\n");
}

}  // namespace
