/* The attention half of a layer on one tensor-parallel rank (input_layernorm -> self_attention ->
 * self_attn_bda -> pre_mlp_layernorm; megatron/core/transformer/transformer_layer.py
 * _forward_attention, attention.py), as kernel launches, GEMMs and collectives on one stream: the
 * device side of layer/attention_half.h, run by the dense layer (transformer_layer.cuh) and by the
 * MoE layer's router phase (moe/moe_layer.cuh), with its backward's arguments. The design (one
 * stream, no host synchronisation, q/k/v read in place from the fused linear_qkv output, Megatron's
 * tensor and sequence parallelism) is transformer_layer.cuh's. With multi_latent_attention the self
 * attention is MLA's (layer/mla_attention.cuh) in place of linear_qkv, qk-layernorm and RoPE. */
#pragma once

#include "optimized/attention_backward.cuh"
#include "optimized/dot_product_attention.cuh"
#include "optimized/fused_bias_dropout.cuh"
#include "optimized/layer/mla_attention.cuh"
#include "optimized/layer/rank_plan.h"
#include "optimized/linear.cuh"
#include "optimized/rotary_pos_embedding.cuh"
#include "optimized/runtime/collectives.h"
#include "optimized/runtime/gemm.h"
#include "optimized/torch_norm.cuh"

namespace twin::opt::TWIN_BACKEND {

// This rank's place in the tensor-parallel group.
inline TensorParallel tensor_parallel(const RankPlan& p) { return TensorParallel{p.tp, p.rank, p.sp, p.comm}; }

// A row-parallel linear (linear_proj, fc2): y = x[s, b, in_local] @ w[h, in_local]^T summed over
// the tensor-parallel ranks: each rank's product goes to `partial` [s, b, h], then all-reduced
// into y [s, b, h], or with sequence parallelism reduce-scattered into this rank's y [s_local, b, h].
// With tp == 1 the product is y itself. The bias is left to the bias-dropout-add, as in Megatron.
inline void row_parallel_linear_forward(const RankPlan& p, const void* x, const void* w, std::int64_t in_local,
                                        void* partial, void* y, cudaStream_t st) {
  const std::int64_t n_full = std::int64_t(p.s) * p.b;
  linear_forward(p.dt, x, w, nullptr, p.tp > 1 ? partial : y, n_full, in_local, p.h, st);
  tp_reduce(tensor_parallel(p), p.dt, partial, y, n_full, p.h, st);
}

// The core attention's parameters of this rank (the forward's and the backward's).
inline AttnParams attention_params(const RankPlan& p) {
  AttnParams ap;
  ap.sq = ap.sk = p.s;
  ap.b = p.b;
  ap.np_local = p.np_local();
  ap.np_total = p.np;
  ap.head_offset = p.rank * p.np_local();
  ap.hn = p.hn;
  ap.alpha = p.alpha;
  ap.coeff = p.coeff;
  ap.softmax_fp32 = p.softmax_fp32;
  ap.mask = p.mask_mode;
  ap.mask_ptr = p.mask;
  ap.mask_b = p.mask_b;
  ap.mask_h = p.mask_h;
  ap.drop = DropoutArgs::make(p.attention_dropout, p.training, p.seed, p.offset_attention);
  ap.softmax_stats = p.softmax_stats;
  return ap;
}

// The self attention with linear_qkv: linear_qkv, qk-layernorm, RoPE, core_attention, from
// input_layernorm's output to ctx [s, b, np_l * hn].
template <class Tap>
inline void self_attention_qkv_forward(const RankPlan& p, Tap&& tap, cudaStream_t st) {
  const DType dt = p.dt;
  const std::int64_t n_full = std::int64_t(p.s) * p.b;
  const std::size_t esz = dtype_size(dt);
  // ---- self_attention.linear_qkv (bias in the epilogue)  // [s, b, ng_l * (hpg + 2) * hn]
  const std::int64_t qw = p.qkv_width();
  linear_forward(dt, p.sp ? p.ln1_full : p.ln1, p.qkv_w, p.qkv_b, p.qkv, n_full, p.h, qw, st);
  tap(TapPoint::LinearQkv);

  const int hpg = p.hpg(), hn = p.hn;
  const std::int64_t gs = std::int64_t(hpg + 2) * hn;
  // q heads: hpg per group; k head: one per group, after the group's q heads
  const NormRows q_rows{n_full * p.ng_local() * hpg, hn, hpg, gs, hn};
  const NormRows k_rows{n_full * p.ng_local(), hn, 1, gs, 0};
  char* qkv = static_cast<char*>(p.qkv);
  void* k_base = qkv + std::size_t(hpg) * hn * esz;
  // q and k are parallel branches from linear_qkv: neither inherits the other's rounding points.
  if (p.qk_layernorm) {
    if (p.qkv_pre_norm) copy_elements(dt, p.qkv, p.qkv_pre_norm, n_full * qw, st);  // the norms' backward reads it
    const RoundingCount at_split = rounding_now();
    norm_forward(p.rms, dt, qkv, qkv, p.qln_w, p.qln_b, q_rows, p.eps, p.zero_centered_gamma, st);
    const RoundingCount query_path = rounding_now();
    rounding_set(at_split);
    norm_forward(p.rms, dt, k_base, k_base, p.kln_w, p.kln_b, k_rows, p.eps, p.zero_centered_gamma, st);
    rounding_join(query_path);
    tap(TapPoint::QkLayernorm);
  }
  if (p.rot_dim > 0) {
    const RoundingCount at_split = rounding_now();
    rotary_pos_emb_forward(dt, qkv, p.freqs, q_rows, std::int64_t(p.b) * p.ng_local() * hpg, p.rot_dim,
                           p.rope_interleaved, st);
    const RoundingCount query_path = rounding_now();
    rounding_set(at_split);
    rotary_pos_emb_forward(dt, k_base, p.freqs, k_rows, std::int64_t(p.b) * p.ng_local(), p.rot_dim, p.rope_interleaved,
                           st);
    rounding_join(query_path);
  }

  // ---- core_attention                                    // [s, b, np_l * hn]
  dot_product_attention_forward(dt, p.qkv, QkvLayout{qw, gs, hpg}, p.ctx, attention_params(p), st);
}

// The attention half of the layer, through pre_mlp_layernorm (and its SP all-gather): the part
// the dense layer and the MoE layer share.
inline void attention_forward_impl(const RankPlan& p, cudaStream_t st) {
  const DType dt = p.dt;
  const std::int64_t n_local = std::int64_t(p.s_local()) * p.b, n_full = std::int64_t(p.s) * p.b;
  auto tap = [&](TapPoint t) {
    if (p.on_tap) p.on_tap(t);
  };
  // ---- input_layernorm                                   // [s_local, b, h]
  norm_forward(p.rms, dt, p.x, p.ln1, p.ln1_w, p.ln1_b, NormRows::dense(n_local, p.h), p.eps, p.zero_centered_gamma,
               st);
  tap(TapPoint::InputLayernorm);
  if (p.sp) p.comm->all_gather(p.ln1, p.ln1_full, std::size_t(n_local) * p.h, dt, st);  // [s, b, h]

  if (p.mla.on) {
    // ---- self_attention: multi-latent attention (layer/mla_attention.cuh)   // [s, b, np_l * v]
    mla_attention_forward(p, p.sp ? p.ln1_full : p.ln1, attention_params(p), tap, st);
  } else {
    self_attention_qkv_forward(p, tap, st);
  }
  tap(TapPoint::CoreAttention);

  // ---- self_attention.linear_proj (row parallel; bias returned for the bda)   // [s_local, b, h]
  row_parallel_linear_forward(p, p.ctx, p.proj_w, p.ctx_width(), p.proj_partial, p.proj, st);
  tap(TapPoint::LinearProj);

  // ---- self_attn_bda: h1 = residual + dropout(proj + bias)   // [s_local, b, h]
  const std::uint64_t element_base = tensor_parallel(p).element_base(n_full, p.h);
  bias_dropout_add_forward(dt, p.proj, p.proj_b, p.post_ln_residual ? p.ln1 : p.x, p.h1, n_local, p.h,
                           DropoutArgs::make(p.hidden_dropout, p.training, p.seed, p.offset_self_attn_bda),
                           element_base, st);

  // ---- pre_mlp_layernorm                                 // [s_local, b, h]
  norm_forward(p.rms, dt, p.h1, p.ln2, p.ln2_w, p.ln2_b, NormRows::dense(n_local, p.h), p.eps, p.zero_centered_gamma,
               st);
  tap(TapPoint::PreMlpLayernorm);
  if (p.sp) p.comm->all_gather(p.ln2, p.ln2_full, std::size_t(n_local) * p.h, dt, st);
}

// The attention half's backward (attention_backward.cuh) on the forward's kept buffers.
inline AttentionHalfBackward attention_half_backward_args(const RankPlan& p, const RankGrads& g) {
  AttentionHalfBackward a;
  a.dt = p.dt;
  a.s = p.s;
  a.b = p.b;
  a.h = p.h;
  a.np = p.np_local();
  a.ng = p.ng_local();
  a.hn = p.hn;
  a.rms = p.rms;
  a.zero_centered_gamma = p.zero_centered_gamma;
  a.eps = p.eps;
  a.rot_dim = p.rot_dim;
  a.rope_interleaved = p.rope_interleaved;
  a.freqs = p.freqs;
  a.attn = attention_params(p);
  a.drop = DropoutArgs::make(p.hidden_dropout, p.training, p.seed, p.offset_self_attn_bda);
  a.qk_layernorm = p.qk_layernorm;
  a.post_ln_residual = p.post_ln_residual;
  a.mla = p.mla;
  a.mla_acts = p.mla_acts;
  a.q_down_w = p.q_down_w;
  a.q_up_w = p.q_up_w;
  a.kv_down_w = p.kv_down_w;
  a.kv_up_w = p.kv_up_w;
  a.d_q_down_w = g.q_down_w;
  a.d_q_up_w = g.q_up_w;
  a.d_kv_down_w = g.kv_down_w;
  a.d_kv_up_w = g.kv_up_w;
  a.d_mla = g.mla;
  a.tp = tensor_parallel(p);
  a.x = p.x;
  a.ln1 = p.ln1_full;
  a.qkv = p.qkv;
  a.qkv_pre_norm = p.qkv_pre_norm;
  a.ctx = p.ctx;
  a.softmax_stats = p.softmax_stats;
  a.ln1_w = p.ln1_w;
  a.qkv_w = p.qkv_w;
  a.qkv_b = p.qkv_b;
  a.proj_w = p.proj_w;
  a.proj_bias = p.proj_b != nullptr;
  a.qln_w = p.qln_w;
  a.qln_b = p.qln_b;
  a.kln_w = p.kln_w;
  a.kln_b = p.kln_b;
  a.dh1 = g.dh1;
  a.dx = g.dx;
  a.d_ln1_w = g.ln1_w;
  a.d_ln1_b = g.ln1_b;
  a.d_qkv_w = g.qkv_w;
  a.d_qkv_b = g.qkv_b;
  a.d_proj_w = g.proj_w;
  a.d_proj_b = g.proj_b;
  a.d_qln_w = g.qln_w;
  a.d_qln_b = g.qln_b;
  a.d_kln_w = g.kln_w;
  a.d_kln_b = g.kln_b;
  a.d_proj = g.d_proj;
  a.d_ctx = g.d_ctx;
  a.d_qkv = g.d_qkv;
  a.d_qkv_pre = g.d_qkv_pre;
  a.d_ln1 = g.d_ln1;
  a.d_ln1_partial = g.d_ln1_partial;
  a.d_proj_full = g.d_proj_full;
  a.workspace = g.workspace;
  a.workspace_bytes = g.workspace_bytes;
  return a;
}

}  // namespace twin::opt::TWIN_BACKEND
