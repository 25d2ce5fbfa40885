// One logger for what shoal's own processes and threads report as they run: the queue's scheduler
// and agents, the parameter servers, the elastic layer's rounds, the timeline's writer. Each
// message is one line on stderr, as before there was a logger (the text is the caller's), shown
// when its level is at least SHOAL_LOG_LEVEL's: debug, info (the default), warn, error or off.
// What a command prints as its answer or its error (`shoal queue ls`, "shoal run: ...") is its
// output, not a log line, and is always printed. docs/runtime.md, "Logging".
#pragma once

#include <sstream>
#include <string>

namespace shoal::log {

enum class Level { kDebug, kInfo, kWarn, kError, kOff };

// The level in force: SHOAL_LOG_LEVEL, read once per process. SHOAL_ELASTIC_DEBUG=1, the older
// switch for the rendezvous' phases, is debug when SHOAL_LOG_LEVEL is unset. Another value is
// reported once on stderr and taken as info.
Level level();
// Whether a message of `level` is shown (to skip building one that is not).
bool enabled(Level level);

// The parts written one after another, as `std::cerr << a << b` writes them.
template <typename... Parts>
std::string line(const Parts&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  return out.str();
}

void debug(const std::string& line);
void info(const std::string& line);
void warn(const std::string& line);
void error(const std::string& line);

}  // namespace shoal::log
