// The parameter server core's refusals (server_core.cpp and its parts, server_*.cpp): every one
// reads "parameter server: <what>: <text>". Inline here, not in each source's anonymous namespace,
// because the library is a unity build (Note [Unity build] in CMakeLists.txt).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "handler.h"
#include "shoal/core/error.h"

namespace shoal::ps::detail {

inline std::string prefix(const char* what) {
  return std::string("parameter server: ") + what + ": ";
}

[[noreturn]] inline void bad(const char* what, const std::string& text) {
  throw UsageError(prefix(what) + text);
}

// A table, chunk or row this server does not hold (NOT_FOUND on the wire, handler.h).
[[noreturn]] inline void not_here(const char* what, const std::string& text) {
  throw NotFoundError(prefix(what) + text);
}

inline std::string list_workers(const std::vector<int32_t>& workers) {
  std::string out;
  for (int32_t w : workers) out += (out.empty() ? "" : ", ") + std::to_string(w);
  return out.empty() ? "none" : out;
}

}  // namespace shoal::ps::detail
