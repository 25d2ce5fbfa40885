// Reading configuration from the environment with errors that name the variable.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>

namespace shoal::env {

// A snapshot of environment variables. Job discovery takes one of these rather than reading
// the process environment, so every launcher's conventions can be tested in one process.
using Environment = std::map<std::string, std::string>;

Environment current();

std::optional<std::string> get(const Environment& env, const std::string& name);

// The integer value of `name`, or nullopt when unset. A value that is not an integer (or is
// outside [min, max]) raises UsageError naming the variable, its value and what was expected.
std::optional<int64_t> get_int(const Environment& env, const std::string& name,
                               int64_t min = INT64_MIN, int64_t max = INT64_MAX);

// "1", "true", "yes", "on" (any case) are true; "0", "false", "no", "off", "" false; else UsageError.
std::optional<bool> get_bool(const Environment& env, const std::string& name);

}  // namespace shoal::env
