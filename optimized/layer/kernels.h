// The backend boundary: each backend's kernel sequences (compiled once for the CUDA simulator and
// once by nvcc) behind one table, so the host side of every layer (compiled once) calls
// layer_kernels(backend).<sequence> and never names a backend. The entry points each backend
// defines are declared in backend_entries.h, read only by the boundary (kernels.cpp and the
// per-backend entry files).
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>  // cudaStream_t (the toolkit's type; the simulator's streams are handles too)

#include "core/config.h"
#include "core/tensor.h"
#include "optimized/retro/retro_layer.h"  // RetroLayerKind
#include "optimized/runtime/device.h"     // rt::Backend

namespace twin::opt {

struct RankPlan;
struct RankGrads;
struct MoEPlan;
namespace retro::detail {
struct Runner;
}

struct LayerKernels {
  // The dense layer (transformer_layer.cuh): one rank's forward and backward.
  void (*rank_forward)(const RankPlan&, cudaStream_t);
  void (*rank_backward)(const RankPlan&, const RankGrads&, cudaStream_t);
  std::size_t (*rank_backward_workspace_bytes)(const RankPlan&);
  // The MoE layer's three phases on one rank (moe_layer.cuh; the router phase runs the attention
  // half first).
  void (*moe_router_phase)(MoEPlan&, cudaStream_t);
  void (*moe_expert_compute)(MoEPlan&, cudaStream_t);
  void (*moe_postprocess)(MoEPlan&, cudaStream_t);
  // The Retro decoder (retro_layer_impl.cuh): a built layer or block, its parameters' keys and
  // shapes, what it does not implement.
  std::unique_ptr<retro::detail::Runner> (*make_retro_layer)(const TransformerConfig&,
                                                             const std::map<std::string, Tensor>&,
                                                             retro::RetroLayerKind, int layer_number);
  std::unique_ptr<retro::detail::Runner> (*make_retro_block)(const TransformerConfig&,
                                                             const std::map<std::string, Tensor>&,
                                                             const std::vector<retro::RetroLayerKind>&);
  std::vector<std::pair<std::string, Shape>> (*retro_param_shapes)(const TransformerConfig&, retro::RetroLayerKind);
  std::string (*retro_unsupported)(const TransformerConfig&);
};

// The table of `backend`; ConfigError when this build has no such backend.
const LayerKernels& layer_kernels(rt::Backend backend);

}  // namespace twin::opt
