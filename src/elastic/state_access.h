// What run() does to a State beside the program's calls: back to the last commit, sharing the
// newest commit after a new round, and ending what commit() left in flight. Internal to shoal
// (and its tests), so that a program sees only commit() and its accessors.
#pragma once

#include "shoal/elastic/state.h"

namespace shoal::elastic {

struct StateAccess {
  static void restore(State& state) { state.restore(); }
  static void sync(State& state) { state.sync(); }
  static void finish(State& state) { state.finish(); }
};

}  // namespace shoal::elastic
