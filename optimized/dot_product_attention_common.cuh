/* What the core attention's kernels share (dot_product_attention.cuh): the tiling constants, the
 * operands and parameters, and the per-pair helpers every kernel computes a score, its mask and its
 * softmax output with (the same instructions in each: the same bits wherever a pair is recomputed).
 */
#pragma once

#include <type_traits>

#include "optimized/layer/kernel_types.h"  // MaskMode, kMaxHeadDim
#include "philox.cuh"

namespace twin::opt::TWIN_BACKEND {

constexpr int kAttnBQ = 16;  // query rows per block
constexpr int kAttnBK = 32;  // keys per tile (one per lane)
constexpr int kAttnWarps = 4;
constexpr int kAttnRowsPerWarp = kAttnBQ / kAttnWarps;
constexpr int kAttnMaxHeadDim = kMaxHeadDim;
constexpr int kAttnMaxChunks = kAttnMaxHeadDim / 32;

// Whether the score of query row i and key j (batch bi, global head h_global) is masked.
__device__ inline bool attn_masked(const AttnParams& p, int bi, int h_global, int i, int j) {
  if (p.mask == MaskMode::Causal) return j > i;
  if (p.mask == MaskMode::Explicit) {
    const std::int64_t mb = p.mask_b == 1 ? 0 : bi, mh = p.mask_h == 1 ? 0 : h_global;
    return p.mask_ptr[((mb * p.mask_h + mh) * p.sq + i) * std::int64_t(p.sk) + j] != 0;
  }
  return false;
}

// The score of query row i and key j from their fp32-accumulated dot product q . k: Megatron's
// baddbmm output (alpha inside) stored in T, the layer-scaling coefficient, the mask.
template <class T>
__device__ inline float attn_score_from_dot(float dot, const AttnParams& p, int bi, int h_global, int i, int j,
                                            float fill) {
  float s = round_to<T>(p.alpha * dot);                  // rounds: baddbmm output (alpha inside), T
  if (p.coeff != 0.0f) s = s * p.coeff;                  // rounds: input * scale, fp32
  return attn_masked(p, bi, h_global, i, j) ? fill : s;  // masked_fill_(mask, -10000.0)
}

// a . b over hn values of shared memory, accumulated in fp32 in column order: one instruction
// sequence for every score (forward and backward) and every d probs = d context . v.
__device__ inline float attn_dot(const float* a, const float* b, int hn) {
  float dot = 0.0f;
  for (int c = 0; c < hn; ++c) dot += a[c] * b[c];
  return dot;
}

template <class T>
__device__ inline float attn_score(const float* q, const float* k, int hn, const AttnParams& p, int bi, int h_global,
                                   int i, int j, float fill) {
  return attn_score_from_dot<T>(attn_dot(q, k, hn), p, bi, h_global, i, j, fill);
}

// The softmax's own output for score s of a row with online max m and sum l (fp32).
__device__ inline float attn_softmax_out(float s, float m, float l) { return expf(s - m) / l; }

// The dk / dv kernels' step of n query rows from q0 on (this (batch, head)'s rows from row0 in the
// forward's stats [.., 2] and D [..]): st_s[r * 3 + 0 / 1 / 2] = m, l, D of row q0 + r, rows past sq
// m 0, l 1, D 0 (their pairs are zero). The block's threads share the rows.
__device__ inline void attn_load_row_stats(float* st_s, const float* stats, const float* dsum, std::int64_t row0,
                                           int q0, int n, int sq) {
  for (int r = threadIdx.x; r < n; r += blockDim.x) {
    const int i = q0 + r;
    const bool ok = i < sq;
    st_s[r * 3 + 0] = ok ? stats[(row0 + i) * 2] : 0.0f;
    st_s[r * 3 + 1] = ok ? stats[(row0 + i) * 2 + 1] : 1.0f;
    st_s[r * 3 + 2] = ok ? dsum[row0 + i] : 0.0f;
  }
}

// The dropout element of (batch bi, global head h_global, i, j) in the flat [b, np_total, sq, sk]
// probabilities.
__device__ inline std::uint64_t attn_dropout_element(const AttnParams& p, int bi, int h_global, int i, int j) {
  return ((std::uint64_t(bi) * p.np_total + h_global) * p.sq + i) * std::uint64_t(p.sk) + j;
}

// The row's statistics after pass 1, saved for the backward when asked for.
__device__ inline void attn_save_stats(const AttnParams& p, int bi, int h, int i, float m, float l) {
  if (!p.softmax_stats) return;
  float* st = p.softmax_stats + ((std::int64_t(bi) * p.np_local + h) * p.sq + i) * 2;
  st[0] = m;
  st[1] = l;
}

// What the two-pass kernel with query tiles of `bq` rows moves and computes (the cost model):
// q read and the context written once; per query tile of each (batch, head), K read twice (once per
// pass) and V once, over the keys the tile needs (all, or up to its last row when causal); an
// explicit mask read once; nothing of size sq x sk (the scores and probabilities stay on chip).
// FLOPs: q k^T twice and p v once, 2 hn each per (row, key) of a computed tile, plus ~5 per score
// for the softmax.
struct AttnCost {
  double bytes = 0, flops = 0;
};
inline AttnCost attention_forward_cost(DType dt, const AttnParams& p, int bq) {
  const double e = dtype_size(dt), heads = p.np_local;
  double key_rows = 0, row_keys = 0;  // keys read per (batch, head): sum over query tiles; (row, key) pairs computed
  for (int q0 = 0; q0 < p.sq; q0 += bq) {
    const int rows = std::min(bq, p.sq - q0);
    const int k_end = p.mask == MaskMode::Causal ? std::min(p.sk, q0 + rows) : p.sk;
    key_rows += k_end;
    row_keys += double(rows) * k_end;
  }
  const double mask_bytes = p.mask == MaskMode::Explicit ? double(p.mask_b) * p.mask_h * p.sq * p.sk : 0.0;
  AttnCost c;
  c.bytes = e * p.b * heads * (2.0 * p.sq * p.hn + 3.0 * key_rows * p.hn) + mask_bytes;
  c.flops = p.b * heads * row_keys * (6.0 * p.hn + 5.0);
  return c;
}

// The preconditions the forward and backward launchers share: the shape, the heads, the mask.
inline void attention_check_shapes(const std::string& op, const AttnOperands& ops, const AttnParams& p) {
  require(p.hn > 0 && p.hn <= kAttnMaxHeadDim,
          op + ": head dim " + std::to_string(p.hn) + " must be in [1, " + std::to_string(kAttnMaxHeadDim) + "]");
  require(p.sq > 0 && p.sk > 0 && p.b > 0 && p.np_local > 0, op + ": empty shape");
  require(ops.hpg > 0 && p.np_local % ops.hpg == 0, op + ": local heads " + std::to_string(p.np_local) +
                                                        " not a multiple of heads per group " +
                                                        std::to_string(ops.hpg));
  require(p.mask != MaskMode::Causal || p.sq == p.sk,
          op + ": causal mask needs sq == sk, got sq=" + std::to_string(p.sq) + " sk=" + std::to_string(p.sk));
  require(p.mask != MaskMode::Explicit || p.mask_ptr, op + ": explicit mask without data");
  require(
      p.mask != MaskMode::Explicit || ((p.mask_b == 1 || p.mask_b == p.b) && (p.mask_h == 1 || p.mask_h == p.np_total)),
      op + ": mask dims [" + std::to_string(p.mask_b) + ", " + std::to_string(p.mask_h) + "] must be 1 or [b, np]");
  require(p.head_offset + p.np_local <= p.np_total, op + ": local heads exceed the layer's heads");
}

// ---- the backward's per-pair steps (both dq kernels and the dk / dv kernel)

// Whether the softmax runs in fp32 on a 16-bit T (attention_softmax_in_fp32): its input and output
// are fp32 and the probabilities are cast back to T after it.
template <class T>
__host__ __device__ inline bool attn_softmax_upcast(const AttnParams& p) {
  return p.softmax_fp32 && !std::is_same<T, float>::value;
}

// One (query row i, key j) pair of the backward, from its score s (attn_score: the forward's bits)
// and the row's saved m, l: y, the softmax's own output its backward multiplies by (fp32 under the
// upcast, else stored in T); prob, the probability probs v read (in T, after dropout); dprob, the
// grad of the softmax output (d context . v stored in T, through dropout's backward).
struct AttnBwdPair {
  float y = 0.0f, prob = 0.0f, dprob = 0.0f;
};
template <class T>
__device__ inline AttnBwdPair attn_backward_pair(float s, float m, float l, float dctx_dot_v, const AttnParams& p,
                                                 int bi, int h_global, int i, int j) {
  AttnBwdPair t;
  const float e = attn_softmax_out(s, m, l);  // the forward's pass 2: the same bits
  t.prob = round_to<T>(e);                    // rounds: softmax output (fp32), probs.to(T)
  t.y = attn_softmax_upcast<T>(p) ? e : t.prob;
  t.dprob = round_to<T>(dctx_dot_v);  // rounds: d probs = d context v^T, T
  if (p.drop.active) {                // the forward's mask, regenerated
    if (philox_keep(p.drop.seed, p.drop.offset, attn_dropout_element(p, bi, h_global, i, j), p.drop.threshold)) {
      t.prob = dropout_scaled<T>(t.prob, p.drop.scale);
      t.dprob = dropout_scaled<T>(t.dprob, p.drop.scale);  // rounds: dropout's backward, T
    } else {
      t.prob = t.dprob = 0.0f;
    }
  }
  return t;
}

// d score of a pair from y, d probs and the row's D = sum_j dprobs_j y_j, with the reference's
// rounding sequence: the softmax backward y (dy - D) (fp32 under the upcast, else stored in T),
// masked_fill's backward (0 where masked), the layer-scaling coefficient's (fp32), .float()'s (a
// store in T under the upcast).
template <class T>
__device__ inline float attn_dscore(float y, float dprob, float dsum, bool masked, const AttnParams& p) {
  const bool upcast = attn_softmax_upcast<T>(p);
  float d = y * (dprob - dsum);     // rounds: softmax backward output, fp32
  if (!upcast) d = round_to<T>(d);  // rounds: ... stored in T when the softmax runs in T
  if (masked) d = 0.0f;
  if (p.coeff != 0.0f) d = d * p.coeff;  // rounds: grad of input * scale, fp32
  if (upcast) d = round_to<T>(d);        // rounds: .float()'s backward, T
  return d;
}

}  // namespace twin::opt::TWIN_BACKEND
