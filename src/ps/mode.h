// The parameter servers' consistency mode as a user names it (docs/ps.md, "Consistency"): one
// parser for SHOAL_PS_MODE and `shoal ps-server --mode`, so that a job of one, the workers, the
// servers and `shoal run --servers` refuse a bad mode with the same line. Free of LibTorch: the
// `shoal` command includes it too.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <string>

#include "shoal/core/error.h"

namespace shoal::ps {

struct Mode {
  enum Kind { kSync, kBoundedStaleness, kAsync };
  Kind kind = kSync;
  int64_t staleness = 0;  // kBoundedStaleness: the bound, in steps
};

// "sync", "async" or "ssp:S"; anything else is a UsageError naming `source` ("SHOAL_PS_MODE" or
// "--mode") and the accepted values.
inline Mode parse_mode(const std::string& text, const std::string& source) {
  if (text == "sync") return {};
  if (text == "async") return {Mode::kAsync, 0};
  if (text.rfind("ssp:", 0) == 0 && text.size() > 4 && text.size() < 16 &&
      text.find_first_not_of("0123456789", 4) == std::string::npos) {
    return {Mode::kBoundedStaleness, std::stoll(text.substr(4))};
  }
  throw UsageError(source + "=" + text +
                   "; expected sync, async or ssp:S (bounded staleness of S steps)");
}

// The mode's name, as parse_mode reads it ("sync", "async", "ssp:S").
inline std::string mode_name(const Mode& mode) {
  switch (mode.kind) {
    case Mode::kSync:
      return "sync";
    case Mode::kAsync:
      return "async";
    case Mode::kBoundedStaleness:
      break;
  }
  return mode.staleness == 0 ? "sync" : "ssp:" + std::to_string(mode.staleness);
}

// The mode a worker trains in: SHOAL_PS_MODE when set (it overrides the program's choice), else
// `option` (ps::ServerOptions::mode), else sync.
inline Mode resolve_mode(const std::string& option) {
  const char* text = std::getenv("SHOAL_PS_MODE");
  if (text != nullptr && *text != '\0') return parse_mode(text, "SHOAL_PS_MODE");
  return option.empty() ? Mode{} : parse_mode(option, "ps::ServerOptions::mode");
}

// SHOAL_PS_MODE, sync when unset or empty.
inline Mode mode_from_environment() {
  const char* text = std::getenv("SHOAL_PS_MODE");
  return text == nullptr || *text == '\0' ? Mode{} : parse_mode(text, "SHOAL_PS_MODE");
}

}  // namespace shoal::ps
