// The MoE layer's kernel sequence compiled for the CUDA simulator (see moe_layer.cuh).
#include "optimized/layer/backend_entries.h"
#include "optimized/moe/moe_layer.cuh"

namespace twin::opt::sim {
void moe_router_phase(MoEPlan& p, cudaStream_t stream) { moe_router_phase_impl(p, stream); }
void moe_expert_compute(MoEPlan& p, cudaStream_t stream) { moe_expert_compute_impl(p, stream); }
void moe_postprocess(MoEPlan& p, cudaStream_t stream) { moe_postprocess_impl(p, stream); }
}  // namespace twin::opt::sim
