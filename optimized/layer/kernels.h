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

#include "core/dtype.h"
#include "optimized/layer/kernel_args.h"
#include "optimized/runtime/device.h"  // rt::Backend

namespace twin::opt {

struct RankPlan;
struct RankGrads;
struct MoEPlan;
struct MoEGrads;

// One backend's single-op launchers (the .cuh of each op), for a layer whose host side launches
// its ops one at a time (Retro's layers, with taps and reshuffles between them). Each throws
// std::invalid_argument naming the op for arguments it cannot take.
struct OpLaunchers {
  void (*norm_forward)(bool rms, DType, const void* x, void* y, const void* weight, const void* bias, const NormRows&,
                       double eps, bool zero_centered_gamma, cudaStream_t);
  // y [rows, out] = x [rows, in] W^T (+ bias in the epilogue when not null)
  void (*linear_forward)(DType, const void* x, const void* weight, const void* bias, void* y, std::int64_t rows,
                         std::int64_t in, std::int64_t out, cudaStream_t);
  void (*dot_product_attention_forward)(DType, const AttnOperands&, void* context, const AttnParams&, cudaStream_t);
  void (*bias_dropout_add_forward)(DType, const void* x, const void* bias, const void* residual, void* out,
                                   std::int64_t n_rows, int h, const DropoutArgs&, std::uint64_t element_base,
                                   cudaStream_t);
  void (*bias_activation_forward)(DType, const void* in, const void* bias, void* out, std::int64_t n, int f, Act,
                                  bool glu, cudaStream_t);
  void (*retro_gather_rows)(DType, const void* x, void* out, const RetroMapArgs&, std::int64_t in_rows, int d,
                            cudaStream_t);
  void (*retro_decoder_bias_dropout_add)(DType, const void* x, const void* bias, const void* residual, void* out,
                                         const RetroMapArgs& unchunk, int d, const DropoutArgs&, cudaStream_t);
  void (*retro_encoder_bias_dropout_add)(DType, const void* x, const void* bias, const void* residual, void* out,
                                         std::int64_t r, std::int64_t N, std::int64_t k, int d, const DropoutArgs&,
                                         cudaStream_t);
  // ---- backward: each the gradient of the forward op of its name (workspaces as their *_bytes say)
  void (*norm_backward)(bool rms, DType, const void* dy, const void* x, void* dx, const void* weight, void* dweight,
                        void* dbias, const NormRows&, double eps, bool zero_centered_gamma, void* workspace,
                        std::size_t workspace_bytes, cudaStream_t);
  std::size_t (*norm_backward_workspace_bytes)(bool rms, std::int64_t n_rows, int width);
  // dx [rows, in] = dy [rows, out] W; dW [out, in] = dy^T x; db [out] = the column sums of dy.
  void (*linear_backward_dgrad)(DType, const void* dy, const void* weight, void* dx, std::int64_t rows, std::int64_t in,
                                std::int64_t out, cudaStream_t);
  void (*linear_backward_wgrad)(DType, const void* dy, const void* x, void* dweight, std::int64_t rows, std::int64_t in,
                                std::int64_t out, cudaStream_t);
  void (*linear_backward_bias)(DType, const void* dy, void* dbias, std::int64_t rows, std::int64_t out, void* workspace,
                               std::size_t workspace_bytes, cudaStream_t);
  std::size_t (*linear_backward_bias_workspace_bytes)(std::int64_t rows, std::int64_t out);
  void (*dot_product_attention_backward)(DType, const AttnOperands&, const void* dcontext, const AttnGradOperands&,
                                         const float* softmax_stats, const AttnParams&, void* workspace,
                                         std::size_t workspace_bytes, cudaStream_t);
  std::size_t (*dot_product_attention_backward_workspace_bytes)(const AttnParams&);
  void (*bias_dropout_add_backward)(DType, const void* dout, void* dx, void* dresidual, void* dbias,
                                    std::int64_t n_rows, int h, const DropoutArgs&, std::uint64_t element_base,
                                    void* workspace, std::size_t workspace_bytes, cudaStream_t);
  // out = a + b, stored in dt (a gradient reaching a tensor used twice; out may be a or b)
  void (*grad_sum)(DType, const void* a, const void* b, void* out, std::int64_t n, cudaStream_t);
  void (*retro_scatter_rows)(DType, const void* dy, void* out, const RetroMapArgs&, std::int64_t in_rows, int d,
                             cudaStream_t);
  // A layer's attention half (input_layernorm .. self_attn_bda) and MLP half (pre_mlp_layernorm ..
  // mlp_bda) backward, as the dense layer runs them.
  void (*attention_half_backward)(const AttentionHalfBackward&, cudaStream_t);
  std::size_t (*attention_half_backward_workspace_bytes)(const AttentionHalfBackward&);
  void (*mlp_half_backward)(const MlpHalfBackward&, cudaStream_t);
  std::size_t (*mlp_half_backward_workspace_bytes)(bool rms, std::int64_t n, int h, int ffn, bool glu);
};

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
  // The MoE layer's backward on one rank in its three phases (moe_layer_backward.cuh), and the
  // workspace it needs.
  void (*moe_backward_postprocess)(const MoEPlan&, MoEGrads&, cudaStream_t);
  void (*moe_backward_expert_compute)(const MoEPlan&, MoEGrads&, cudaStream_t);
  void (*moe_backward_router)(const MoEPlan&, MoEGrads&, cudaStream_t);
  std::size_t (*moe_rank_backward_workspace_bytes)(const MoEPlan&);
  // Single ops, for the layers that launch them one by one (op_launchers.cuh).
  OpLaunchers ops;
};

// The table of `backend`; ConfigError when this build has no such backend.
const LayerKernels& layer_kernels(rt::Backend backend);

}  // namespace twin::opt
