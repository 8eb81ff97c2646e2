// The dense layer's kernel sequence compiled for the CUDA simulator (see transformer_layer.cuh).
#include "optimized/transformer_layer.cuh"

namespace twin::opt::sim {
void rank_forward(const RankPlan& p, cudaStream_t stream) { rank_forward_impl(p, stream); }
}  // namespace twin::opt::sim
