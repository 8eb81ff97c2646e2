// The entry points each backend compiles (twin::opt::sim always, twin::opt::cuda with nvcc),
// declared once for both. Read only by the backend boundary: layer/kernels.cpp, which puts them in
// each backend's LayerKernels, and the entry files that define them (*_sim.cpp, *_cuda.cu).
#pragma once

#include "optimized/layer/kernels.h"
#include "optimized/moe/moe_transformer_layer_plan.h"
#include "optimized/layer/rank_plan.h"

#define TWIN_LAYER_BACKEND_ENTRIES(ns)                                                  \
  namespace twin::opt::ns {                                                             \
  void rank_forward(const RankPlan& p, cudaStream_t stream);                            \
  void rank_backward(const RankPlan& p, const RankGrads& g, cudaStream_t stream);       \
  std::size_t rank_backward_workspace_bytes(const RankPlan& p);                         \
  void moe_router_phase(MoEPlan& p, cudaStream_t stream);                               \
  void moe_expert_compute(MoEPlan& p, cudaStream_t stream);                             \
  void moe_postprocess(MoEPlan& p, cudaStream_t stream);                                \
  void moe_backward_postprocess(const MoEPlan& p, MoEGrads& g, cudaStream_t stream);    \
  void moe_backward_expert_compute(const MoEPlan& p, MoEGrads& g, cudaStream_t stream); \
  void moe_backward_router(const MoEPlan& p, MoEGrads& g, cudaStream_t stream);         \
  std::size_t moe_rank_backward_workspace_bytes(const MoEPlan& p);                      \
  OpLaunchers op_launchers();                                                           \
  }
TWIN_LAYER_BACKEND_ENTRIES(sim)
#if TWIN_HAVE_CUDA
TWIN_LAYER_BACKEND_ENTRIES(cuda)
#endif
#undef TWIN_LAYER_BACKEND_ENTRIES
