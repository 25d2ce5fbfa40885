// How the job's world is formed and changes. Internal to shoal: the library's front door
// (src/init.cpp) forms the first world, the elastic part re-forms it, DataParallel follows it. A
// program uses shoal::world() and elastic::State's reset callbacks instead.
#pragma once

#include <functional>

#include <string>

#include "shoal/comm/group.h"
#include "shoal/core/env.h"
#include "shoal/core/timeout.h"
#include "shoal/runtime/init.h"
#include "shoal/runtime/job.h"

namespace shoal::runtime {

// One round of the job: who is in it and their group, which becomes shoal::world(). A static job
// has one round; an elastic job's rounds are formed by the elastic part. (Named so that "world"
// means one thing: the group shoal::world() returns.)
struct Round {
  JobSpec job;  // rank, world size and local rank in this round
  comm::Group group;
};

// What init() learned before the world exists.
struct Joining {
  JobSpec job;  // as discover_job found it
  env::Environment env;
  Duration connect_timeout{0};
  Duration timeout{0};  // the collectives' default
};

// The first half of shoal::init(): UsageError when it was called before or the job is
// malformed (told to the job's store when there is one); sets this process's threads and its
// timeline.
Joining prepare(const InitOptions& options);
// The second half for an elastic job: makes `round`, its first (formed by the elastic part), the
// job's world.
void start(Round round);
// The second half for a job that is not elastic: forms its world through the job's store and
// Gloo (or a world of one, for a job of one or one whose workers share no group).
void start(Joining joining, const InitOptions& options);

// For the parts that join the job when the program has not (DataParallel, the samplers):
// shoal::init()'s work for a job that is not elastic. UsageError naming `who` in an elastic job,
// whose first round only shoal::init() joins (it is above the elastic part that forms rounds).
void join_implicitly(const std::string& who);

// Makes `round`'s group the job's world (an elastic job's next round), then calls the listeners.
void replace_world(Round round);

// Called, in order of registration, after each replace_world. Returns an id for remove.
int add_world_listener(std::function<void()> listener);
void remove_world_listener(int id);

}  // namespace shoal::runtime
