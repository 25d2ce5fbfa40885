// The library's front door: shoal::init() joins a job, forming its world with the part that
// knows how (runtime for a static job, the elastic part for an elastic one). It sits above both,
// so that neither reaches up to the other (docs/runtime.md, "Layers").
#include "shoal/init.h"

#include "elastic/join.h"
#include "runtime/world.h"

namespace shoal {

void init(const InitOptions& options) {
  runtime::Joining joining = runtime::prepare(options);
  if (joining.job.elastic) {
    runtime::start(elastic::join(joining));
  } else {
    runtime::start(std::move(joining), options);
  }
}

}  // namespace shoal
