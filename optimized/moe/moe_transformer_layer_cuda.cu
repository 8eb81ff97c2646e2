// The MoE layer's kernel sequence compiled by nvcc for the GPU (see moe_layer.cuh).
#include "optimized/layer/backend_entries.h"
#include "optimized/moe/moe_layer.cuh"
#include "optimized/moe/moe_layer_backward.cuh"

namespace twin::opt::cuda {
void moe_router_phase(MoEPlan& p, cudaStream_t stream) { moe_router_phase_impl(p, stream); }
void moe_expert_compute(MoEPlan& p, cudaStream_t stream) { moe_expert_compute_impl(p, stream); }
void moe_postprocess(MoEPlan& p, cudaStream_t stream) { moe_postprocess_impl(p, stream); }
void moe_backward_postprocess(const MoEPlan& p, MoEGrads& g, cudaStream_t stream) {
  moe_backward_postprocess_impl(p, g, stream);
}
void moe_backward_expert_compute(const MoEPlan& p, MoEGrads& g, cudaStream_t stream) {
  moe_backward_expert_compute_impl(p, g, stream);
}
void moe_backward_router(const MoEPlan& p, MoEGrads& g, cudaStream_t stream) { moe_backward_router_impl(p, g, stream); }
std::size_t moe_rank_backward_workspace_bytes(const MoEPlan& p) { return moe_rank_backward_workspace_bytes_impl(p); }
}  // namespace twin::opt::cuda
