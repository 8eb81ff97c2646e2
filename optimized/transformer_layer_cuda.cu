// The dense layer's kernel sequence compiled by nvcc for the GPU (see transformer_layer.cuh).
#include "optimized/transformer_layer.cuh"

namespace twin::opt::cuda {
void rank_forward(const RankPlan& p, cudaStream_t stream) { rank_forward_impl(p, stream); }
}  // namespace twin::opt::cuda
