/* One tensor-parallel rank of the dense TransformerLayer forward (reference/transformer_layer.h;
 * megatron/core/transformer/transformer_layer.py, attention.py, mlp.py), as a sequence of kernel
 * launches, GEMMs (the GEMM interface: cuBLASLt on the GPU) and collectives on one stream.
 *
 * Design: everything is enqueued on one stream with no host synchronisation, so the whole layer
 * can be captured into a CUDA graph. The fused linear_qkv output is the one buffer attention works
 * in: qk-layernorm and RoPE update the q/k heads in place, and the attention kernel reads q, k and
 * v (GQA: the group's head by index) from it directly, so no split/transpose copies exist. The
 * linear_qkv bias is fused into the GEMM epilogue (cuBLASLt BIAS); fc1's bias is fused with the
 * activation (cuBLASLt's GELU epilogue is the tanh form, Megatron's gelu is erf); the proj/fc2
 * biases stay in the bias-dropout-add, after the tensor-parallel reduction, as in Megatron.
 * Tensor parallelism as Megatron shards: column-parallel linear_qkv (by query groups) and fc1,
 * row-parallel linear_proj and fc2 followed by all-reduce, or with sequence parallelism an
 * all-gather before the column-parallel GEMM and a reduce-scatter after the row-parallel one. */
#pragma once

#include "optimized/activations.cuh"
#include "optimized/dot_product_attention.cuh"
#include "optimized/fused_bias_dropout.cuh"
#include "optimized/linear.cuh"
#include "optimized/mlp_backward.cuh"
#include "optimized/rotary_pos_embedding.cuh"
#include "optimized/runtime/collectives.h"
#include "optimized/runtime/gemm.h"
#include "optimized/torch_norm.cuh"
#include "optimized/transformer_layer_plan.h"

namespace twin::opt::TWIN_BACKEND {

// A row-parallel linear (linear_proj, fc2): y = x[s, b, in_local] @ w[h, in_local]^T summed over
// the tensor-parallel ranks: each rank's product goes to `partial` [s, b, h], then all-reduced
// into y [s, b, h], or with sequence parallelism reduce-scattered into this rank's y [s_local, b, h].
// With tp == 1 the product is y itself. The bias is left to the bias-dropout-add, as in Megatron.
inline void row_parallel_linear_forward(const RankPlan& p, const void* x, const void* w, std::int64_t in_local,
                                        void* partial, void* y, cudaStream_t st) {
  const std::int64_t n_local = std::int64_t(p.s_local()) * p.b, n_full = std::int64_t(p.s) * p.b;
  linear_forward(p.dt, x, w, nullptr, p.tp > 1 ? partial : y, n_full, in_local, p.h, st);
  if (p.tp == 1) return;
  // counts: the sum over ranks adds the tp partials one by one, rounding to T after each addition
  // (the threaded group's fixed order; NCCL rounds per hop likewise): tp - 1 stores.
  rounding_store(p.dt, p.tp - 1);
  if (p.sp)
    p.comm->reduce_scatter(partial, y, std::size_t(n_local) * p.h, p.dt, st);
  else
    p.comm->all_reduce(partial, y, std::size_t(n_full) * p.h, p.dt, st);
}

// The attention half of the layer, through pre_mlp_layernorm (and its SP all-gather): the part
// the dense layer and the MoE layer share.
inline void attention_forward_impl(const RankPlan& p, cudaStream_t st) {
  const DType dt = p.dt;
  const std::int64_t n_local = std::int64_t(p.s_local()) * p.b, n_full = std::int64_t(p.s) * p.b;
  const std::size_t esz = dtype_size(dt);
  auto tap = [&](TapPoint t) {
    if (p.on_tap) p.on_tap(t);
  };
  // ---- input_layernorm                                   // [s_local, b, h]
  norm_forward(p.rms, dt, p.x, p.ln1, p.ln1_w, p.ln1_b, NormRows::dense(n_local, p.h), p.eps, p.zero_centered_gamma,
               st);
  tap(TapPoint::InputLayernorm);
  if (p.sp) p.comm->all_gather(p.ln1, p.ln1_full, std::size_t(n_local) * p.h, dt, st);  // [s, b, h]

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
  AttnParams ap;
  ap.sq = ap.sk = p.s;
  ap.b = p.b;
  ap.np_local = p.np_local();
  ap.np_total = p.np;
  ap.head_offset = p.rank * p.np_local();
  ap.hn = hn;
  ap.alpha = p.alpha;
  ap.coeff = p.coeff;
  ap.softmax_fp32 = p.softmax_fp32;
  ap.mask = static_cast<MaskMode>(p.mask_mode);
  ap.mask_ptr = p.mask;
  ap.mask_b = p.mask_b;
  ap.mask_h = p.mask_h;
  ap.drop = DropoutArgs::make(p.attention_dropout, p.training, p.seed, p.offset_attention);
  dot_product_attention_forward(dt, p.qkv, QkvLayout{qw, gs, hpg}, p.ctx, ap, st);
  tap(TapPoint::CoreAttention);

  // ---- self_attention.linear_proj (row parallel; bias returned for the bda)   // [s_local, b, h]
  row_parallel_linear_forward(p, p.ctx, p.proj_w, std::int64_t(p.np_local()) * hn, p.proj_partial, p.proj, st);
  tap(TapPoint::LinearProj);

  // ---- self_attn_bda: h1 = residual + dropout(proj + bias)   // [s_local, b, h]
  const std::uint64_t element_base = p.sp ? std::uint64_t(p.rank) * std::uint64_t(n_local) * p.h : 0;
  bias_dropout_add_forward(dt, p.proj, p.proj_b, p.post_ln_residual ? p.ln1 : p.x, p.h1, n_local, p.h,
                           DropoutArgs::make(p.hidden_dropout, p.training, p.seed, p.offset_self_attn_bda),
                           element_base, st);

  // ---- pre_mlp_layernorm                                 // [s_local, b, h]
  norm_forward(p.rms, dt, p.h1, p.ln2, p.ln2_w, p.ln2_b, NormRows::dense(n_local, p.h), p.eps, p.zero_centered_gamma,
               st);
  tap(TapPoint::PreMlpLayernorm);
  if (p.sp) p.comm->all_gather(p.ln2, p.ln2_full, std::size_t(n_local) * p.h, dt, st);
}

// The dense MLP half: linear_fc1, activation, linear_fc2, mlp_bda.
inline void dense_mlp_forward_impl(const RankPlan& p, cudaStream_t st) {
  const DType dt = p.dt;
  const std::int64_t n_local = std::int64_t(p.s_local()) * p.b, n_full = std::int64_t(p.s) * p.b;
  auto tap = [&](TapPoint t) {
    if (p.on_tap) p.on_tap(t);
  };
  const std::uint64_t element_base = p.sp ? std::uint64_t(p.rank) * std::uint64_t(n_local) * p.h : 0;
  // ---- mlp: linear_fc1 (column parallel), bias + activation (+ GLU) fused, linear_fc2 (row parallel)
  const int f_l = p.ffn_local();
  const std::int64_t fc1_w = (p.glu ? 2 : 1) * std::int64_t(f_l);
  linear_forward(dt, p.sp ? p.ln2_full : p.ln2, p.fc1_w, nullptr, p.fc1, n_full, p.h, fc1_w, st);  // [s, b, fc1_w]
  tap(TapPoint::LinearFc1);
  bias_activation_forward(dt, p.fc1, p.fc1_b, p.act_out, n_full, f_l, static_cast<Act>(p.act), p.glu,
                          st);                                                        // [s, b, f_l]
  row_parallel_linear_forward(p, p.act_out, p.fc2_w, f_l, p.fc2_partial, p.fc2, st);  // [s_local, b, h]
  tap(TapPoint::LinearFc2);

  // ---- mlp_bda: out = h1 + dropout(fc2 + bias)           // [s_local, b, h]
  bias_dropout_add_forward(dt, p.fc2, p.fc2_b, p.post_ln_residual ? p.ln2 : p.h1, p.out, n_local, p.h,
                           DropoutArgs::make(p.hidden_dropout, p.training, p.seed, p.offset_mlp_bda), element_base, st);
}

inline void rank_forward_impl(const RankPlan& p, cudaStream_t st) {
  attention_forward_impl(p, st);
  dense_mlp_forward_impl(p, st);
}

}  // namespace twin::opt::TWIN_BACKEND
