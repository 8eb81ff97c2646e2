// The seam between the optimized Retro decoder's public classes (retro_layer.cpp) and its
// per-backend kernel sequences (retro_layer_impl.cuh, compiled for the simulator and by nvcc).
#pragma once

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "optimized/retro/retro_layer.h"

namespace twin::opt::retro::detail {

// A built layer or block of one backend.
struct Runner {
  virtual ~Runner() = default;
  virtual RetroOutput forward(const Tensor& hidden_states, const Tensor* context, const Tensor* context_mask,
                              const RetroForwardOptions& options) = 0;
};

}  // namespace twin::opt::retro::detail
