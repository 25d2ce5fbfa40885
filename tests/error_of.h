// The message of the exception of type E that `body` throws (a UsageError unless told), for
// tests that compare an error's text: EXPECT_EQ(error_of([&] { ... }), "what went wrong; ...").
// A body that throws nothing is a test failure and gives "".
#pragma once

#include <functional>
#include <string>

#include <gtest/gtest.h>

#include "shoal/core/error.h"

namespace shoal::testing {

template <typename E = UsageError>
std::string error_of(const std::function<void()>& body) {
  try {
    body();
  } catch (const E& e) {
    return e.what();
  }
  ADD_FAILURE() << "no exception of the expected type";
  return "";
}

}  // namespace shoal::testing
