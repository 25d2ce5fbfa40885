// Precompiled header for the library: LibTorch and c10d are most of every translation unit's
// compile time (~10 s each on 2 cores), so they are parsed once.
#pragma once
#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
