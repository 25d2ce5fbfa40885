// shoal: distributed training for LibTorch programs. See README.md and docs/.
#pragma once

#include "shoal/checkpoint/checkpoint.h"
#include "shoal/comm/group.h"
#include "shoal/comm/store.h"
#include "shoal/comm/work.h"
#include "shoal/core/error.h"
#include "shoal/core/timeout.h"
#include "shoal/data/loader.h"
#include "shoal/data/torch_sampler.h"
#include "shoal/dp/data_parallel.h"
#include "shoal/elastic/state.h"
#include "shoal/runtime/init.h"
#include "shoal/runtime/job.h"
