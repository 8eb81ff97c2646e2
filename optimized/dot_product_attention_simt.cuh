/* Core attention forward on CUDA cores (reference/dot_product_attention.h; Megatron's DotProductAttention,
 * unfused path with FusedScaleMaskSoftmax.forward_torch_softmax):
 *   scores = alpha * q k^T (stored in T), [* coeff in fp32], masked_fill(mask, -10000.0),
 *   probs = softmax(scores) in fp32 stored in T, dropout(probs), context = probs v (stored in T).
 *
 * Design: tiled, never materialising the [sq, sk] score matrix. A block owns BQ = 16 query rows of
 * one (batch, head); 4 warps, each owning 4 of the rows; K and V stream through shared memory in
 * tiles of BK = 32 keys (one key per lane). Two passes over the key tiles per query tile:
 *   1. online softmax statistics: running max m and rescaled sum l (Milakov & Gimelshein's online
 *      normaliser), warp shuffles only;
 *   2. recompute each score (same instructions, same bits), p = exp(s - m) / l rounded to T exactly
 *      where Megatron stores its probabilities, attention dropout on p, and accumulate p * v in fp32
 *      registers.
 * The second pass costs a second q k^T, but gives Megatron's rounding points (probs stored in T
 * before the bmm) instead of FlashAttention's unrounded rescaled accumulator: the twin reproduces
 * the reference's numbers rather than only approximating them. Causal attention skips the key tiles
 * past the block's last query (their -10000.0 scores contribute exp(-10000 - m) = 0 in fp32).
 * Padding / arbitrary masks keep Megatron's semantics: masked scores are -10000.0 (not -inf), so a
 * fully masked row is a uniform distribution, as in Megatron. GQA reads the group's K/V head by
 * index (head h uses group h / (np / ng)) straight from the fused linear_qkv output; nothing is
 * copied or repeated. Head dim up to 256 (8 accumulators per lane and row).
 */
#pragma once

#include "optimized/dot_product_attention_common.cuh"

namespace twin::opt::TWIN_BACKEND {

template <class T>
__global__ void dot_product_attention_forward_kernel(AttnOperands op, T* context, AttnParams p) {
  DYNAMIC_SHARED(float, smem);
  const int hn = p.hn, kstride = hn + 1;  // +1: lanes reading consecutive keys hit different banks
  float* q_s = smem;                      // [BQ, hn]
  float* k_s = q_s + kAttnBQ * hn;        // [BK, hn + 1]
  float* v_s = k_s + kAttnBK * kstride;   // [BK, hn + 1]
  float* p_s = v_s + kAttnBK * kstride;   // [warps, BK]

  const int q0 = blockIdx.x * kAttnBQ, h = blockIdx.y, bi = blockIdx.z;
  const int h_global = p.head_offset + h, g = h / op.hpg;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const T* q_base =
      static_cast<const T*>(op.q) + std::int64_t(bi) * op.q_batch + g * op.q_group + (h % op.hpg) * op.q_head;
  const std::int64_t kv_at = std::int64_t(bi) * op.kv_batch + g * op.kv_group;
  const T* k_base = static_cast<const T*>(op.k) + kv_at;
  const T* v_base = static_cast<const T*>(op.v) + kv_at;
  const std::int64_t q_tok = op.q_tok, tok_stride = op.kv_tok;  // one query / key position
  // -10000.0 as the softmax input stores it (fp32, or T when the softmax runs in T)
  const float fill = p.softmax_fp32 ? -10000.0f : round_to<T>(-10000.0f);

  for (int e = threadIdx.x; e < kAttnBQ * hn; e += blockDim.x) {
    const int r = e / hn, c = e % hn;
    q_s[e] = q0 + r < p.sq ? Io<T>::load(q_base[(q0 + r) * q_tok + c]) : 0.0f;
  }
  // Keys this block needs: all, or up to its last query row when causal.
  const int q_last = min(q0 + kAttnBQ, p.sq) - 1;
  const int k_end = p.mask == MaskMode::Causal ? min(p.sk, q_last + 1) : p.sk;

  float m[kAttnRowsPerWarp], l[kAttnRowsPerWarp];
  for (int r = 0; r < kAttnRowsPerWarp; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.0f;
  }
  // Whether key j is in query row i's softmax (the tile's end, the causal mask), and its score
  // against the warp's r-th query row.
  auto in_row = [&](int i, int j) { return j < k_end && !(p.mask == MaskMode::Causal && j > i); };
  auto score = [&](int r, int i, int j) {
    return attn_score<T>(q_s + (warp * kAttnRowsPerWarp + r) * hn, k_s + lane * kstride, hn, p, bi, h_global, i, j,
                         fill);
  };
  // ---- pass 1: online max and sum of exp over the row
  for (int k0 = 0; k0 < k_end; k0 += kAttnBK) {
    __syncthreads();  // previous tile consumed (and q_s written, first time)
    for (int e = threadIdx.x; e < kAttnBK * hn; e += blockDim.x) {
      const int j = e / hn, c = e % hn;
      k_s[j * kstride + c] = k0 + j < k_end ? Io<T>::load(k_base[(k0 + j) * tok_stride + c]) : 0.0f;
    }
    __syncthreads();
    for (int r = 0; r < kAttnRowsPerWarp; ++r) {
      const int i = q0 + warp * kAttnRowsPerWarp + r;
      if (i >= p.sq) break;  // warp-uniform
      const int j = k0 + lane;
      const bool keep = in_row(i, j);
      const float s = keep ? score(r, i, j) : -INFINITY;
      const float m_new = fmaxf(m[r], warp_max(s));
      const float e_s = keep ? expf(s - m_new) : 0.0f;
      l[r] = (m_new == -INFINITY ? l[r] : l[r] * expf(m[r] - m_new)) + warp_sum(e_s);
      m[r] = m_new;
    }
  }
  for (int r = 0; r < kAttnRowsPerWarp; ++r) {
    const int i = q0 + warp * kAttnRowsPerWarp + r;
    if (i < p.sq && lane == 0) attn_save_stats(p, bi, h, i, m[r], l[r]);
  }
  // ---- pass 2: probabilities in T, dropout, p @ v
  float acc[kAttnRowsPerWarp][kAttnMaxChunks];
  for (int r = 0; r < kAttnRowsPerWarp; ++r)
    for (int c = 0; c < kAttnMaxChunks; ++c) acc[r][c] = 0.0f;
  for (int k0 = 0; k0 < k_end; k0 += kAttnBK) {
    __syncthreads();
    for (int e = threadIdx.x; e < kAttnBK * hn; e += blockDim.x) {
      const int j = e / hn, c = e % hn;
      const bool ok = k0 + j < k_end;
      k_s[j * kstride + c] = ok ? Io<T>::load(k_base[(k0 + j) * tok_stride + c]) : 0.0f;
      v_s[j * kstride + c] = ok ? Io<T>::load(v_base[(k0 + j) * tok_stride + c]) : 0.0f;
    }
    __syncthreads();
    for (int r = 0; r < kAttnRowsPerWarp; ++r) {
      const int i = q0 + warp * kAttnRowsPerWarp + r;
      if (i >= p.sq) break;  // warp-uniform
      const int j = k0 + lane;
      float pr = 0.0f;
      if (in_row(i, j)) {
        pr = round_to<T>(attn_softmax_out(score(r, i, j), m[r], l[r]));  // rounds: softmax output (fp32), probs.to(T)
        if (p.drop.active) {
          const std::uint64_t e = attn_dropout_element(p, bi, h_global, i, j);
          pr =
              philox_keep(p.drop.seed, p.drop.offset, e, p.drop.threshold) ? dropout_scaled<T>(pr, p.drop.scale) : 0.0f;
        }
      }
      p_s[warp * kAttnBK + lane] = pr;
      __syncwarp();
      const int n_keys = min(kAttnBK, k_end - k0);
      for (int cc = 0; cc < kAttnMaxChunks; ++cc) {
        const int c = cc * 32 + lane;
        if (c >= hn) break;
        float a = acc[r][cc];
        for (int jj = 0; jj < n_keys; ++jj) a += p_s[warp * kAttnBK + jj] * v_s[jj * kstride + c];
        acc[r][cc] = a;
      }
      __syncwarp();  // p_s is rewritten by the next row
    }
  }
  for (int r = 0; r < kAttnRowsPerWarp; ++r) {
    const int i = q0 + warp * kAttnRowsPerWarp + r;
    if (i >= p.sq) break;
    T* out = context + (std::int64_t(i) * p.b + bi) * (std::int64_t(p.np_local) * hn) + std::int64_t(h) * hn;  // [hn]
    for (int cc = 0; cc < kAttnMaxChunks; ++cc) {
      const int c = cc * 32 + lane;
      if (c < hn) out[c] = Io<T>::store(acc[r][cc]);  // rounds: bmm output, T
    }
  }
}

inline std::size_t attention_smem_bytes(int hn) {
  return sizeof(float) * (std::size_t(kAttnBQ) * hn + 2 * std::size_t(kAttnBK) * (hn + 1) + kAttnWarps * kAttnBK);
}

}  // namespace twin::opt::TWIN_BACKEND
