// How shoal::init() joins an elastic job: the elastic part forms the job's first round
// (src/elastic/world.h). Internal to shoal; the library's front door (src/init.cpp) calls it.
#pragma once

#include "runtime/world.h"

namespace shoal::elastic {

// The first round this worker is part of, for the job `discovered` describes.
runtime::Round join(const runtime::Joining& joining);

}  // namespace shoal::elastic
