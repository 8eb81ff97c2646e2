/* The attention half of the dense layer's backward on one tensor-parallel rank (reference
 * TransformerLayer::backward's self_attn_bda, self_attention and input_layernorm steps,
 * SelfAttention::backward in reference/attention.cpp; megatron/core/transformer/transformer_layer.py,
 * attention.py and tensor_parallel/layers.py under autograd), from d h1, the gradient reaching the
 * attention half's output (mlp_half_backward's dhidden; n_local = the rank's rows: all n without
 * SP, its sequence slice with it):
 *   self_attn_bda:    d residual = d h1; d proj = dropout's backward of d h1;
 *                     d linear_proj.bias = sum_rows d proj (with SP summed over the ranks)
 *   linear_proj (row parallel): with SP d proj all-gathered to n rows; d ctx = d proj @ Wproj;
 *                     dWproj = d proj^T ctx (this rank's heads' columns)
 *   core_attention:   d q, d k, d v of this rank's heads written into d qkv, the fused linear_qkv
 *                     layout (the split's transpose is the layout itself: no copies), GQA's heads
 *                     summed per group
 *   RoPE:             rotary_pos_emb_backward on the q rows and the k rows of d qkv, addressed by
 *                     NormRows as the forward rotated them (v passes through)
 *   q/k_layernorm:    norm backward of the q rows and of the k rows on the forward's pre-norm copy
 *                     of linear_qkv's output, into d qkv_pre (v copied through); the weights' grads
 *                     sum over every head's rows (one norm of width hn shared by the heads), at
 *                     tp > 1 over the ranks' heads too (finalize_model_grads all-reduces them)
 *   linear_qkv (column parallel): d qkv.bias = sum_rows d qkv; dWqkv = d qkv^T ln1; d ln1 =
 *                     d qkv @ Wqkv (d qkv_pre in place of d qkv with qk-layernorm), each rank's
 *                     partial summed over the ranks (all-reduce, or with SP reduce-scatter)
 *   input_layernorm:  d x = norm backward(d ln1) + d residual (autograd's sum, stored in T); with
 *                     SP the norm's parameter grads summed over the ranks
 * Each step is the op's launcher (counting its rounding points: the parameter grads are leaves,
 * the data path goes on from where they branched and the end joins them all; q and k are parallel
 * branches through RoPE, as in the forward); nothing is synchronised, so the sequence can be
 * captured into a graph.
 *
 * With multi-latent attention the steps from core_attention to linear_qkv are MLA's
 * (mla_attention_backward, layer/mla_attention.cuh), ending in the same d ln1 partial.
 *
 * Not covered (attention_half_backward refuses it): apply_residual_connection_post_layernorm (the
 * residual would be ln1: its gradient joins d ln1 before the norm's backward). */
#pragma once

#include "optimized/dot_product_attention.cuh"
#include "optimized/fused_bias_dropout.cuh"
#include "optimized/layer/mla_attention.cuh"
#include "optimized/linear.cuh"
#include "optimized/mlp_backward.cuh"  // grad_sum
#include "optimized/rotary_pos_embedding.cuh"
#include "optimized/torch_norm.cuh"

namespace twin::opt::TWIN_BACKEND {

inline std::size_t attention_half_backward_workspace_bytes(const AttentionHalfBackward& a) {
  if (a.mla.on)
    return std::max({norm_backward_workspace_bytes(a.rms, a.n(), a.h), column_sum_workspace_bytes(1, a.n(), a.h),
                     mla_attention_backward_workspace_bytes(a)});
  return std::max({norm_backward_workspace_bytes(a.rms, a.n(), a.h), column_sum_workspace_bytes(1, a.n(), a.h),
                   norm_backward_workspace_bytes(a.rms, a.q_rows().n_rows, a.hn),
                   norm_backward_workspace_bytes(a.rms, a.k_rows().n_rows, a.hn),
                   column_sum_workspace_bytes(1, a.n(), static_cast<int>(a.qkv_width())),
                   dot_product_attention_backward_workspace_bytes(a.attn)});
}

// The self attention with linear_qkv, backward: from d ctx to this rank's part of d ln1
// (`d_ln1_partial`, summed over the ranks by the caller), the parameter gradients as leaves.
inline void self_attention_qkv_backward(const AttentionHalfBackward& a, GradLeaves& leaves, void* d_ln1_partial,
                                        cudaStream_t st) {
  const DType dt = a.dt;
  const std::int64_t n = a.n(), qw = a.qkv_width();
  // ---- core_attention: d q, d k, d v into d qkv (the fused layout)      // [n, qw]
  const QkvLayout lay = a.layout();
  dot_product_attention_backward(dt, a.qkv, lay, a.d_ctx, a.d_qkv, a.softmax_stats, a.attn, a.workspace,
                                 a.workspace_bytes, st);
  // ---- RoPE backward on the q rows and the k rows of d qkv, in place (v passes through)
  // d q and d k are parallel branches through RoPE and qk-layernorm: neither inherits the other's
  // rounding points.
  const NormRows q_rows = a.q_rows(), k_rows = a.k_rows();
  const std::size_t k_off = a.k_offset_bytes();
  auto at = [](const void* base, std::size_t off) { return static_cast<const char*>(base) + off; };
  const RoundingCount at_split = rounding_now();
  RoundingCount query_path = at_split, key_path = at_split;
  if (a.rot_dim > 0) {
    rotary_pos_emb_backward(dt, a.d_qkv, a.freqs, q_rows, std::int64_t(a.b) * a.ng * a.hpg(), a.rot_dim,
                            a.rope_interleaved, st);
    query_path = rounding_now();
    rounding_set(at_split);
    rotary_pos_emb_backward(dt, static_cast<char*>(a.d_qkv) + k_off, a.freqs, k_rows, std::int64_t(a.b) * a.ng,
                            a.rot_dim, a.rope_interleaved, st);
    key_path = rounding_now();
  }
  // ---- q_layernorm / k_layernorm: their backward into d qkv_pre, v passing through  // [n, qw]
  void* d_linear_qkv = a.d_qkv;  // the gradient of linear_qkv's output
  if (a.qk_layernorm) {
    copy_elements(dt, a.d_qkv, a.d_qkv_pre, n * qw, st);  // v's columns; q and k's are overwritten
    rounding_set(query_path);
    norm_backward(a.rms, dt, a.d_qkv, a.qkv_pre_norm, a.d_qkv_pre, a.qln_w, a.d_qln_w, a.d_qln_b, q_rows, a.eps,
                  a.zero_centered_gamma, a.workspace, a.workspace_bytes, st);
    tp_sum_param_grads(a.tp, dt, {a.d_qln_w, a.d_qln_b}, a.hn, leaves, st);  // each rank: its heads
    query_path = rounding_now();
    rounding_set(key_path);
    norm_backward(a.rms, dt, at(a.d_qkv, k_off), at(a.qkv_pre_norm, k_off), static_cast<char*>(a.d_qkv_pre) + k_off,
                  a.kln_w, a.d_kln_w, a.d_kln_b, k_rows, a.eps, a.zero_centered_gamma, a.workspace, a.workspace_bytes,
                  st);
    tp_sum_param_grads(a.tp, dt, {a.d_kln_w, a.d_kln_b}, a.hn, leaves, st);
    key_path = rounding_now();
    d_linear_qkv = a.d_qkv_pre;
  }
  rounding_set(key_path);
  rounding_join(query_path);
  const RoundingCount at_qkv = rounding_now();
  // ---- linear_qkv (column parallel): bias, weight (leaves), then d ln1  // [n_local, h], [qw, h]
  if (a.qkv_b) {
    require(a.d_qkv_b != nullptr, "attention_half_backward: linear_qkv has a bias but d_qkv_b is null");
    linear_backward_bias(dt, d_linear_qkv, a.d_qkv_b, n, qw, a.workspace, a.workspace_bytes, st);
    leaves.done(at_qkv);
  }
  linear_backward_wgrad(dt, d_linear_qkv, a.ln1, a.d_qkv_w, n, a.h, qw, st);
  leaves.done(at_qkv);
  linear_backward_dgrad(dt, d_linear_qkv, a.qkv_w, d_ln1_partial, n, a.h, qw, st);
}

inline void attention_half_backward(const AttentionHalfBackward& a, cudaStream_t st) {
  const std::string why = attention_half_backward_unsupported(a.post_ln_residual);
  require(why.empty(), "attention_half_backward: not supported: " + why);
  require(a.s > 0 && a.b > 0 && a.h > 0 && a.np > 0 && a.ng > 0 && a.np % a.ng == 0 && a.hn > 0 && a.tp.size >= 1 &&
              (!a.tp.sp || a.n() % a.tp.size == 0),
          "attention_half_backward: bad shape");
  require(a.attn.sq == a.s && a.attn.sk == a.s && a.attn.b == a.b && a.attn.np_local == a.np && a.attn.hn == a.hn,
          "attention_half_backward: the attention params' shape differs from the layer's");
  require(a.x && a.ln1 && a.ctx && a.softmax_stats && a.ln1_w && a.proj_w && a.dh1 && a.dx && a.d_ln1_w && a.d_proj_w &&
              a.d_proj && a.d_ctx && a.d_ln1 && (a.mla.on || (a.qkv && a.qkv_w && a.d_qkv_w && a.d_qkv)),
          "attention_half_backward: a required tensor is null");
  require((a.tp.size == 1 || a.d_ln1_partial) && (!a.tp.sp || a.d_proj_full),
          "attention_half_backward: tensor parallelism needs d_ln1_partial (and with SP d_proj_full)");
  require(!a.rms || !a.d_ln1_b, "attention_half_backward: RMSNorm has no bias");
  require(a.rot_dim == 0 || a.freqs, "attention_half_backward: RoPE without its angles");
  require(a.mla.on || !a.qk_layernorm ||
              (a.qkv_pre_norm && a.qln_w && a.kln_w && a.d_qln_w && a.d_kln_w && a.d_qkv_pre &&
               (a.rms || (a.d_qln_b && a.d_kln_b))),
          "attention_half_backward: qk_layernorm needs the pre-norm qkv, its weights and their grads");
  const DType dt = a.dt;
  const std::int64_t n = a.n(), n_local = a.n_local(), ctx_w = a.ctx_width();
  const RoundingCount at_input = rounding_now();
  GradLeaves leaves(at_input);
  // ---- self_attn_bda: d residual = dh1 (used below); d proj, d linear_proj.bias   // [n_local, h]
  bias_dropout_add_backward(dt, a.dh1, a.d_proj, nullptr, nullptr, n_local, a.h, a.drop, a.tp.element_base(n, a.h),
                            nullptr, 0, st);
  const RoundingCount at_proj = rounding_now();
  if (a.proj_bias) {
    require(a.d_proj_b != nullptr, "attention_half_backward: linear_proj has a bias but d_proj_b is null");
    linear_backward_bias(dt, a.d_proj, a.d_proj_b, n_local, a.h, a.workspace, a.workspace_bytes, st);
    if (a.tp.sp) tp_sum_param_grads(a.tp, dt, {a.d_proj_b}, a.h, leaves, st);  // each rank summed its rows
    leaves.done(at_proj);
  }
  // ---- linear_proj (row parallel)                                       // [n, np * hn], [h, np * hn]
  const void* d_proj = tp_gather_rows(a.tp, dt, a.d_proj, a.d_proj_full, n, a.h, st);  // [n, h]
  linear_backward_wgrad(dt, d_proj, a.ctx, a.d_proj_w, n, ctx_w, a.h, st);
  leaves.done(at_proj);
  linear_backward_dgrad(dt, d_proj, a.proj_w, a.d_ctx, n, ctx_w, a.h, st);
  void* const d_ln1_partial = a.tp.size > 1 ? a.d_ln1_partial : a.d_ln1;
  if (a.mla.on)
    mla_attention_backward(a, leaves, d_ln1_partial, st);
  else
    self_attention_qkv_backward(a, leaves, d_ln1_partial, st);
  tp_reduce(a.tp, dt, d_ln1_partial, a.d_ln1, n, a.h, st);
  // ---- input_layernorm, then the residual's gradient added             // [n_local, h]
  norm_backward(a.rms, dt, a.d_ln1, a.x, a.dx, a.ln1_w, a.d_ln1_w, a.d_ln1_b, NormRows::dense(n_local, a.h), a.eps,
                a.zero_centered_gamma, a.workspace, a.workspace_bytes, st);
  if (a.tp.sp)  // each rank's rows gave a part of the norm's parameter grads
    tp_sum_param_grads(a.tp, dt, {a.d_ln1_w, a.d_ln1_b}, a.h, leaves, st);
  rounding_join(at_input);  // the residual path: dh1 as it came in
  grad_sum(dt, a.dx, a.dh1, a.dx, n_local * a.h, st);
  leaves.join_all();
}

}  // namespace twin::opt::TWIN_BACKEND
