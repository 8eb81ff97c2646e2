/* Multi-latent attention on one tensor-parallel rank (reference/multi_latent_attention.h;
 * megatron/core/transformer/multi_latent_attention.py MLASelfAttention), from input_layernorm's
 * output ln1 [n, h] (with SP all-gathered) to the core attention's output ctx [n, np_l * v], the
 * self attention of the attention half (layer/attention_half.cuh) in place of linear_qkv:
 *   q path:  q_compressed = linear_q_down_proj(ln1), q_layernorm, query = linear_q_up_proj(.)
 *            (or linear_q_proj(ln1)); RoPE on each head's last pe channels (MLA's reorder, mscale)
 *   kv path: kv_combined = linear_kv_down_proj(ln1) = [kv_compressed | k_pos_emb]; kv =
 *            linear_kv_up_proj(kv_layernorm(kv_compressed)); RoPE on k_pos_emb
 *   core attention over query, key = [k_no_pe | k_pos_emb per head], value (mla_key_value.cuh),
 *            softmax scale mscale_all^2 / sqrt(q_head)
 * Tensor parallelism as Megatron shards MLA: the up projections (and linear_q_proj) column
 * parallel by heads; the down projections are column parallel with their output gathered
 * (gather_from_tensor_model_parallel_region), which is their whole output on every rank: here each
 * rank computes it whole from the whole weight (the same values, no collective), and the backward
 * takes its rows' slice as Megatron's shard does. The latent norms act on the whole latent (under
 * SP Megatron normalises the rank's tokens: the same values per row). The backward's collectives:
 * the up projections' input gradients and k_pos_emb's (the sum over this rank's heads) all-reduced
 * (k_pos_emb's is the sum Megatron-LM #1699 leaves out: the twin computes the layer's gradient),
 * then each rank's down-projection slices' part of d ln1, summed by the caller's reduction. */
#pragma once

#include "optimized/dot_product_attention.cuh"
#include "optimized/layer/rank_plan.h"
#include "optimized/linear.cuh"
#include "optimized/mla_key_value.cuh"
#include "optimized/mla_rotary_pos_embedding.cuh"
#include "optimized/mlp_backward.cuh"  // copy_elements
#include "optimized/torch_norm.cuh"

namespace twin::opt::TWIN_BACKEND {

// The row layouts MLA's RoPE rotates in place: each of the n * heads rows of `width` channels
// whose last pe channels hold the rotary part (the first rot_dim of them rotated).
inline NormRows mla_rope_rows(std::int64_t rows, int width, int pe) { return NormRows{rows, pe, 1, width, 0}; }

inline MlaOperandShape mla_operand_shape(const MlaShape& m, std::int64_t n, int np_local) {
  return MlaOperandShape{n, np_local, m.qk, m.pe, m.v};
}

// ln1 [n, h] -> p.ctx [n, np_l * v]; `tap` names where the rank's forward has produced a tap.
template <class Tap>
inline void mla_attention_forward(const RankPlan& p, const void* ln1, const AttnParams& ap, Tap&& tap,
                                  cudaStream_t st) {
  const MlaShape& m = p.mla;
  const MlaActivations& a = p.mla_acts;
  const DType dt = p.dt;
  const std::size_t es = dtype_size(dt);
  const std::int64_t n = std::int64_t(p.s) * p.b, qh = m.q_head(), kvw = m.kv_width();
  const int np_l = p.np_local();
  require(p.rot_dim > 0 && p.rot_dim <= m.pe && p.freqs,
          "mla_attention_forward: the RoPE angles must be [s, rot_dim], rot_dim <= qk_pos_emb_head_dim");
  tap(TapPoint::MlaRotaryPosEmb);
  const RoundingCount at_input = rounding_now();
  // ---- q path                                               // [n, np_l, q_head]
  if (m.q_lora) {
    linear_forward(dt, ln1, p.q_down_w, nullptr, a.q_compressed, n, p.h, m.q_lora, st);  // [n, q_lora]
    tap(TapPoint::MlaQDownProj);
    if (p.qk_layernorm) {
      norm_forward(p.rms, dt, a.q_compressed, a.q_normed, p.qln_w, p.qln_b, NormRows::dense(n, m.q_lora), p.eps,
                   p.zero_centered_gamma, st);
      tap(TapPoint::MlaQLayernorm);
    }
    linear_forward(dt, a.q_normed, p.q_up_w, nullptr, a.query, n, m.q_lora, np_l * qh, st);
  } else {
    linear_forward(dt, ln1, p.q_up_w, nullptr, a.query, n, p.h, np_l * qh, st);  // linear_q_proj
  }
  tap(TapPoint::MlaQUpProj);
  char* const query_pe = static_cast<char*>(a.query) + std::size_t(m.qk) * es;
  mla_rotary_pos_emb_forward(dt, query_pe, p.freqs, mla_rope_rows(n * np_l, qh, m.pe), std::int64_t(p.b) * np_l,
                             p.rot_dim, m.rope_mscale, st);
  const RoundingCount query_end = rounding_now();
  rounding_set(at_input);  // the kv path branches from the input as the q path did

  // ---- kv path                                              // [n, np_l, qk + v], k_pos_emb [n, pe]
  linear_forward(dt, ln1, p.kv_down_w, nullptr, a.kv_combined, n, p.h, kvw, st);  // [n, kv_lora + pe]
  tap(TapPoint::MlaKvDownProj);
  if (p.qk_layernorm) {
    norm_forward(p.rms, dt, a.kv_combined, a.kv_normed, p.kln_w, p.kln_b, NormRows{n, m.kv_lora, 1, kvw, 0}, p.eps,
                 p.zero_centered_gamma, st);
    tap(TapPoint::MlaKvLayernorm);
  }
  linear_forward(dt, Rows{a.kv_normed, kvw}, p.kv_up_w, RowsOut{a.kv}, n, m.kv_lora, np_l * (m.qk + m.v), st);
  tap(TapPoint::MlaKvUpProj);
  char* const k_pos_emb = static_cast<char*>(a.kv_combined) + std::size_t(m.kv_lora) * es;  // rows kvw apart
  mla_rotary_pos_emb_forward(dt, k_pos_emb, p.freqs, mla_rope_rows(n, kvw, m.pe), p.b, p.rot_dim, m.rope_mscale, st);
  rounding_join(query_end);

  // ---- core_attention over query, key | value (padded)       // [n, np_l * v]
  const MlaOperandShape os = mla_operand_shape(m, n, np_l);
  mla_key_value_forward(dt, a.kv, k_pos_emb, kvw, a.key_value, os, st);
  const AttnOperands ops = AttnOperands::from_q_kv(a.query, std::int64_t(p.b) * np_l * qh, a.key_value, p.b,
                                                   std::int64_t(np_l) * qh, static_cast<int>(qh), es);
  dot_product_attention_forward(dt, ops, a.context, ap, st);
  mla_context_forward(dt, a.context, p.ctx, os, st);
}

inline std::size_t mla_attention_backward_workspace_bytes(const AttentionHalfBackward& a) {
  const std::int64_t n = a.n();
  return std::max({norm_backward_workspace_bytes(a.rms, n, std::max(a.mla.q_lora, 1)),
                   norm_backward_workspace_bytes(a.rms, n, a.mla.kv_lora),
                   dot_product_attention_backward_workspace_bytes(a.attn)});
}

// From d ctx [n, np_l * v] (linear_proj's input gradient) to this rank's part of d ln1 [n, h]
// (`d_ln1_partial`, summed over the ranks by the caller), the parameter gradients as leaves.
inline void mla_attention_backward(const AttentionHalfBackward& a, GradLeaves& leaves, void* d_ln1_partial,
                                   cudaStream_t st) {
  const MlaShape& m = a.mla;
  const MlaActivations& f = a.mla_acts;
  const MlaGradScratch& g = a.d_mla;
  const DType dt = a.dt;
  const std::size_t es = dtype_size(dt);
  const std::int64_t n = a.n(), qh = m.q_head(), kvw = m.kv_width();
  const int np_l = a.np;
  require(f.query && f.key_value && f.kv && f.kv_combined && f.kv_normed && a.q_up_w && a.kv_down_w && a.kv_up_w &&
              g.d_context && g.d_query && g.d_key_value && g.d_kv && g.d_kv_latent && g.d_kv_combined && a.d_q_up_w &&
              a.d_kv_down_w && a.d_kv_up_w &&
              (!m.q_lora ||
               (f.q_compressed && f.q_normed && a.q_down_w && a.d_q_down_w && g.d_q_normed && g.d_q_compressed)),
          "mla_attention_backward: a required tensor is null");
  require(m.q_lora % a.tp.size == 0 && kvw % a.tp.size == 0,
          "mla_attention_backward: tp must divide q_lora_rank and kv_lora_rank + qk_pos_emb_head_dim");
  TensorParallel all_ranks = a.tp;  // the latent's gradients are whole on every rank: all-reduced, never scattered
  all_ranks.sp = false;
  const int r = a.tp.rank, tp = a.tp.size;

  // ---- core_attention: d query, d key | d value           // [n, np_l, q_head], [n, np_l, 2 q_head]
  const MlaOperandShape os = mla_operand_shape(m, n, np_l);
  mla_context_backward(dt, a.d_ctx, g.d_context, os, st);
  dot_product_attention_backward(dt,
                                 AttnOperands::from_q_kv(f.query, std::int64_t(a.b) * np_l * qh, f.key_value, a.b,
                                                         std::int64_t(np_l) * qh, static_cast<int>(qh), es),
                                 g.d_context,
                                 AttnGradOperands::from_q_kv(g.d_query, g.d_key_value, static_cast<int>(qh), es),
                                 a.softmax_stats, a.attn, a.workspace, a.workspace_bytes, st);
  const RoundingCount at_core = rounding_now();

  // ---- q path: RoPE's backward, the up projection, q_layernorm, this rank's rows of the down projection
  mla_rotary_pos_emb_backward(dt, static_cast<char*>(g.d_query) + std::size_t(m.qk) * es, a.freqs,
                              mla_rope_rows(n * np_l, qh, m.pe), std::int64_t(a.b) * np_l, a.rot_dim, m.rope_mscale,
                              st);
  const std::int64_t q_out = std::int64_t(np_l) * qh;
  const RoundingCount at_query = rounding_now();
  if (m.q_lora) {
    linear_backward_wgrad(dt, g.d_query, f.q_normed, a.d_q_up_w, n, m.q_lora, q_out, st);
    leaves.done(at_query);
    linear_backward_dgrad(dt, g.d_query, a.q_up_w, g.d_q_normed, n, m.q_lora, q_out, st);  // this rank's heads' part
    tp_reduce(all_ranks, dt, g.d_q_normed, g.d_q_normed, n, m.q_lora, st);
    if (a.qk_layernorm) {
      norm_backward(a.rms, dt, g.d_q_normed, f.q_compressed, g.d_q_compressed, a.qln_w, a.d_qln_w, a.d_qln_b,
                    NormRows::dense(n, m.q_lora), a.eps, a.zero_centered_gamma, a.workspace, a.workspace_bytes, st);
      leaves.done(rounding_now());  // the norm's parameter grads: whole on every rank (the latent is)
    }
    const std::int64_t rows_l = m.q_lora / tp;  // this rank's rows of linear_q_down_proj
    const Rows d_slice{static_cast<const char*>(g.d_q_compressed) + std::size_t(r * rows_l) * es, m.q_lora};
    const RoundingCount at_down = rounding_now();
    linear_backward_wgrad(dt, d_slice, Rows{a.ln1}, a.d_q_down_w, n, a.h, rows_l, st);
    leaves.done(at_down);
    linear_backward_dgrad(dt, d_slice, static_cast<const char*>(a.q_down_w) + std::size_t(r * rows_l) * a.h * es,
                          RowsOut{d_ln1_partial}, n, a.h, rows_l, false, st);
  } else {
    linear_backward_wgrad(dt, g.d_query, a.ln1, a.d_q_up_w, n, a.h, q_out, st);  // linear_q_proj
    leaves.done(at_query);
    linear_backward_dgrad(dt, Rows{g.d_query}, a.q_up_w, RowsOut{d_ln1_partial}, n, a.h, q_out, false, st);
  }
  const RoundingCount query_end = rounding_now();
  rounding_set(at_core);

  // ---- kv path: d kv and d k_pos_emb (the heads' sum), RoPE's backward, the up projection, kv_layernorm
  char* const d_k_pos_emb = static_cast<char*>(g.d_kv_latent) + std::size_t(m.kv_lora) * es;  // rows kvw apart
  mla_key_value_backward(dt, g.d_key_value, g.d_kv, d_k_pos_emb, kvw, os, st);
  mla_rotary_pos_emb_backward(dt, d_k_pos_emb, a.freqs, mla_rope_rows(n, kvw, m.pe), a.b, a.rot_dim, m.rope_mscale, st);
  const std::int64_t kv_out = std::int64_t(np_l) * (m.qk + m.v);
  const RoundingCount at_kv = rounding_now();
  linear_backward_wgrad(dt, Rows{g.d_kv}, Rows{f.kv_normed, kvw}, a.d_kv_up_w, n, m.kv_lora, kv_out, st);
  leaves.done(at_kv);
  linear_backward_dgrad(dt, Rows{g.d_kv}, a.kv_up_w, RowsOut{g.d_kv_latent, kvw}, n, m.kv_lora, kv_out, false, st);
  // d kv_normed and d k_pos_emb: this rank's heads' parts, summed over the ranks in one reduction
  tp_reduce(all_ranks, dt, g.d_kv_latent, g.d_kv_latent, n, kvw, st);
  if (a.qk_layernorm) {
    copy_elements(dt, g.d_kv_latent, g.d_kv_combined, n * kvw, st);  // k_pos_emb's columns; the rest overwritten
    norm_backward(a.rms, dt, g.d_kv_latent, f.kv_combined, g.d_kv_combined, a.kln_w, a.d_kln_w, a.d_kln_b,
                  NormRows{n, m.kv_lora, 1, kvw, 0}, a.eps, a.zero_centered_gamma, a.workspace, a.workspace_bytes, st);
    leaves.done(rounding_now());
  }
  // ---- this rank's rows of linear_kv_down_proj: its weight's grad, its part of d ln1 (added to the q path's)
  const std::int64_t rows_l = kvw / tp;
  const Rows d_slice{static_cast<const char*>(g.d_kv_combined) + std::size_t(r * rows_l) * es, kvw};
  const RoundingCount at_down = rounding_now();
  linear_backward_wgrad(dt, d_slice, Rows{a.ln1}, a.d_kv_down_w, n, a.h, rows_l, st);
  leaves.done(at_down);
  rounding_join(query_end);  // the sum with the q path's part
  linear_backward_dgrad(dt, d_slice, static_cast<const char*>(a.kv_down_w) + std::size_t(r * rows_l) * a.h * es,
                        RowsOut{d_ln1_partial}, n, a.h, rows_l, true, st);
}

}  // namespace twin::opt::TWIN_BACKEND
