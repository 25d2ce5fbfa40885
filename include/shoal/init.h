// Joining the job: the one call a program adds to become distributed (DataParallel and the
// samplers make it themselves when the program has not, except in an elastic job).
#pragma once

#include "shoal/runtime/init.h"

namespace shoal {

// Joins the job that started this process (shoal run, torchrun, Open MPI, Slurm), or makes a
// job of one when nothing did; in an elastic job (shoal run --min/--max), its first round. Call
// once, before anything else of shoal's. A second call raises UsageError. See docs/runtime.md.
void init(const InitOptions& options = {});

}  // namespace shoal
