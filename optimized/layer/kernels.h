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
