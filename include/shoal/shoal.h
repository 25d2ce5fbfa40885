// shoal: distributed training for LibTorch programs. This header brings in all of shoal's API,
// as <torch/torch.h> does LibTorch's (and it includes <torch/torch.h>): init() and the world,
// DataParallel, the data loader, checkpoints, elastic jobs, global tensors (shoal::global, with
// its ops and nn layers), pipelines and parameter servers (shoal::ps). A part's own header, e.g.
// <shoal/global/ops.h>, brings in only that part. See docs/getting-started.md.
#pragma once

#include "shoal/checkpoint/checkpoint.h"
#include "shoal/comm/address.h"
#include "shoal/comm/group.h"
#include "shoal/comm/store.h"
#include "shoal/comm/work.h"
#include "shoal/core/error.h"
#include "shoal/core/timeout.h"
#include "shoal/data/loader.h"
#include "shoal/data/torch_sampler.h"
#include "shoal/dp/data_parallel.h"
#include "shoal/dp/grad_scaler.h"
#include "shoal/dp/recompute.h"
#include "shoal/elastic/state.h"
#include "shoal/global/nn.h"
#include "shoal/global/ops.h"
#include "shoal/global/placement.h"
#include "shoal/global/tensor.h"
#include "shoal/init.h"
#include "shoal/pipeline/pipeline.h"
#include "shoal/ps/ps.h"
#include "shoal/runtime/init.h"
#include "shoal/runtime/job.h"
