// How the world changes in an elastic job. For shoal's own parts: the elastic part forms and
// re-forms the world, DataParallel follows it. A program uses shoal::world() and
// elastic::State's reset callbacks instead.
#pragma once

#include <functional>

#include "shoal/comm/group.h"
#include "shoal/core/env.h"
#include "shoal/core/timeout.h"
#include "shoal/runtime/job.h"

namespace shoal::runtime {

struct World {
  JobSpec job;  // rank, world size and local rank in this round
  comm::Group group;
};

// How init() joins an elastic job. The elastic part (a higher layer) registers it when the
// library loads; init() calls it with the job discover_job found, the environment, the connect
// timeout and the collectives' default timeout.
using ElasticJoin = std::function<World(const JobSpec& discovered, const env::Environment& env,
                                        Duration connect_timeout, Duration timeout)>;
void register_elastic_join(ElasticJoin join);

// Makes `world` the job's world (an elastic job's next round), then calls the listeners.
void replace_world(World world);

// Called, in order of registration, after each replace_world. Returns an id for remove.
int add_world_listener(std::function<void()> listener);
void remove_world_listener(int id);

// Note [Copying a commit in the background]
// elastic::State::commit() copies the parameters and the optimizer's state, which only the
// optimizer's step changes. While some part promises to call before_parameters_change() ahead of
// every such change (DataParallel does, at the end of each synchronized backward, before the
// program's optimizer.step()), commit() leaves the copy to a background thread, which then
// overlaps the next step's forward and backward; before_parameters_change() waits for it.
void before_parameters_change();
// A waiter is called by before_parameters_change(); returns an id for remove.
int add_parameter_waiter(std::function<void()> wait);
void remove_parameter_waiter(int id);
// DataParallel counts itself in (+1) and out (-1); commit() copies in the background only while
// the count is positive.
void count_parameter_change_announcer(int delta);
bool parameter_changes_announced();
// DataParallel counts each backward whose all-reduce completed: the optimizer's step may follow
// and change the parameters (elastic::State's Note [Commits without copies]).
void count_synchronized_backward();
uint64_t synchronized_backwards();

}  // namespace shoal::runtime
