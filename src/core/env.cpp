#include "shoal/core/env.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>

#include "shoal/core/error.h"

extern char** environ;

namespace shoal::env {

Environment current() {
  Environment env;
  for (char** entry = environ; entry != nullptr && *entry != nullptr; ++entry) {
    std::string text(*entry);
    auto eq = text.find('=');
    if (eq != std::string::npos) env.emplace(text.substr(0, eq), text.substr(eq + 1));
  }
  return env;
}

std::optional<std::string> get(const Environment& env, const std::string& name) {
  auto it = env.find(name);
  if (it == env.end()) return std::nullopt;
  return it->second;
}

std::optional<int64_t> get_int(const Environment& env, const std::string& name, int64_t min,
                               int64_t max) {
  auto text = get(env, name);
  if (!text) return std::nullopt;
  errno = 0;
  char* end = nullptr;
  long long value = std::strtoll(text->c_str(), &end, 10);
  if (text->empty() || errno != 0 || end == nullptr || *end != '\0') {
    throw UsageError(name + "='" + *text + "' is not an integer");
  }
  if (value < min || value > max) {
    std::string range = max >= INT32_MAX ? "at least " + std::to_string(min)
                                         : "in [" + std::to_string(min) + ", " + std::to_string(max) + "]";
    throw UsageError(name + "=" + *text + " is out of range: expected an integer " + range);
  }
  return value;
}

std::optional<bool> get_bool(const Environment& env, const std::string& name) {
  auto text = get(env, name);
  if (!text) return std::nullopt;
  std::string lower = *text;
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (lower == "1" || lower == "true" || lower == "yes" || lower == "on") return true;
  if (lower.empty() || lower == "0" || lower == "false" || lower == "no" || lower == "off") return false;
  throw UsageError(name + "='" + *text + "' is not a boolean: expected 1/0, true/false, yes/no or on/off");
}

}  // namespace shoal::env
