#include "core/log.h"

#include <cstdio>
#include <cstdlib>
#include <memory>

#include <spdlog/logger.h>
#include <spdlog/sinks/stdout_sinks.h>

namespace shoal::log {
namespace {

Level read_level() {
  const char* text = std::getenv("SHOAL_LOG_LEVEL");
  if (text == nullptr || *text == '\0') {
    const char* elastic = std::getenv("SHOAL_ELASTIC_DEBUG");
    const bool debug = elastic != nullptr && *elastic != '\0' && std::string(elastic) != "0";
    return debug ? Level::kDebug : Level::kInfo;
  }
  const std::string value = text;
  if (value == "debug") return Level::kDebug;
  if (value == "info") return Level::kInfo;
  if (value == "warn") return Level::kWarn;
  if (value == "error") return Level::kError;
  if (value == "off") return Level::kOff;
  std::fprintf(stderr, "shoal: SHOAL_LOG_LEVEL=%s; expected debug, info, warn, error or off (info is used)\n",
               text);
  return Level::kInfo;
}

spdlog::level::level_enum to_spdlog(Level level) {
  switch (level) {
    case Level::kDebug:
      return spdlog::level::debug;
    case Level::kInfo:
      return spdlog::level::info;
    case Level::kWarn:
      return spdlog::level::warn;
    case Level::kError:
      return spdlog::level::err;
    case Level::kOff:
      break;
  }
  return spdlog::level::off;
}

// Not in spdlog's registry: each program and library that links this file has its own, and a
// second logger of the same name in the registry would be refused.
spdlog::logger& logger() {
  static const std::shared_ptr<spdlog::logger> instance = [] {
    auto made = std::make_shared<spdlog::logger>(
        "shoal", std::make_shared<spdlog::sinks::stderr_sink_mt>());
    made->set_pattern("%v");  // the caller's line as it is
    made->set_level(to_spdlog(level()));
    made->flush_on(spdlog::level::debug);  // every line at once, as stderr's own writes were
    return made;
  }();
  return *instance;
}

}  // namespace

Level level() {
  static const Level value = read_level();
  return value;
}

bool enabled(Level wanted) {
  return wanted != Level::kOff && wanted >= level();
}

void debug(const std::string& line) {
  if (enabled(Level::kDebug)) logger().debug(line);
}
void info(const std::string& line) {
  if (enabled(Level::kInfo)) logger().info(line);
}
void warn(const std::string& line) {
  if (enabled(Level::kWarn)) logger().warn(line);
}
void error(const std::string& line) {
  if (enabled(Level::kError)) logger().error(line);
}

}  // namespace shoal::log
