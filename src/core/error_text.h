// The first line of an exception's message, for one-line errors that wrap another: c10's errors
// without their backtrace. For the library's sources (c10 is in their precompiled header).
#pragma once

#include <exception>
#include <string>

#include <c10/util/Exception.h>

namespace shoal {

inline std::string one_line(const std::exception& error) {
  const auto* c10_error = dynamic_cast<const c10::Error*>(&error);
  const std::string text = c10_error ? c10_error->what_without_backtrace() : error.what();
  return text.substr(0, text.find('\n'));
}

}  // namespace shoal
