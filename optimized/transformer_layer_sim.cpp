// The dense layer's kernel sequence compiled for the CUDA simulator (see transformer_layer.cuh).
#include "optimized/layer/backend_entries.h"
#include "optimized/transformer_layer.cuh"

namespace twin::opt::sim {
void rank_forward(const RankPlan& p, cudaStream_t stream) { rank_forward_impl(p, stream); }
void rank_backward(const RankPlan& p, const RankGrads& g, cudaStream_t stream) { rank_backward_impl(p, g, stream); }
std::size_t rank_backward_workspace_bytes(const RankPlan& p) { return rank_backward_workspace_bytes_impl(p); }
}  // namespace twin::opt::sim
