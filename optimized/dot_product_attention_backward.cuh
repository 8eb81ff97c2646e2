/* Backward (dot_product_attention_backward; the reference's DotProductAttention::backward, which is
 * autograd through the forward's ops). For bf16 / fp16 the dq kernel runs on tensor cores
 * (dot_product_attention_backward_wmma.cuh, chosen by the forward's attention_wmma_supports), the
 * same passes and rounding points, and so does the dk / dv kernel for head dims up to 128
 * (attention_wmma_dkv_supports); the CUDA-core kernels below serve every dtype and head dim. The forward saves each
 * row's m and l (AttnParams::softmax_stats, [b, np_local, sq, 2], written after pass 1 by either kernel when asked);
 * nothing of size sq x sk is saved or written, and no atomics are used, so two runs are bitwise equal. Two CUDA-core
 * kernels (fp32 accumulation, every dtype), each recomputing a pair's score with the forward's instructions
 * (attn_score: the CUDA-core forward's bits; after the WMMA forward the same bits on the simulator, whose mma_sync adds
 * the exact 16-bit products in k order, and an fp32 reordering apart on a GPU, which the counted reduce(hn) covers) and
 * its probability exp(s - m) / l as pass 2 did:
 *   1. dq (one block per query tile of one (batch, head), the forward's layout). Pass 1: d probs_ij =
 *      dctx_i . v_j stored in T, dropout's backward with the forward's regenerated mask (the same
 *      Philox element numbering), and D_i = sum_j dprobs_ij y_ij, y the softmax's own output (fp32
 *      when the softmax runs in fp32 for a 16-bit T, else T), accumulated in fp32 (warp sums per key
 *      tile, tiles in order) and written to the workspace. Pass 2: the pairs again (the same bits),
 *      d scores with the reference's rounding sequence (attn_dscore: softmax backward output,
 *      masked -> 0, * coeff in fp32, .float()'s backward store), the bmm sum_j dscores_ij k_j in fp32
 *      registers rounded to T, then dq_i = alpha times it stored in T (torch's grad.bmm(k).mul_(alpha)).
 *   2. dk, dv (one block per key tile of one (batch, query group)): for each of the group's heads in
 *      order, the query rows that see the tile (causal: from the tile's first key on), pairs
 *      recomputed from m, l and D into shared memory, dv_j = sum_i p_ij dctx_i and the bmm
 *      sum_i dscores_ij q_i in fp32 registers (rows in order), rounded per head to T (the reference's
 *      per-head bmm outputs; dk_j = alpha times the latter, rounded to T), then summed over the group's heads in head
 * order in fp32 and stored once in T (repeat_interleave's backward; exact for one head per group). Fully masked rows
 * (explicit masks) keep Megatron's uniform probabilities: they add to dv, and their d scores are zero. The rounding
 * points are the reference's, and the launcher counts them as the reference's backward does; two steps take one fp32
 * rounding more than the reference's one rounding of a double value (y (dy - D), and the product with alpha before its
 * store). Cost (attention_backward_cost): kernel 1 reads K and V twice per query tile, kernel 2 q and d context once
 * per key tile and head; each pair's q k^T and dctx v^T are computed three times in all (twice in kernel 1, once in 2).
 */
#pragma once

#include "optimized/dot_product_attention_common.cuh"
#include "optimized/dot_product_attention_backward_wmma.cuh"
#include "optimized/dot_product_attention_simt.cuh"  // attention_smem_bytes: the dq kernel extends its layout

namespace twin::opt::TWIN_BACKEND {

// Kernel 1: dq and the rows' D. One block per query tile (kAttnBQ rows) of one (batch, head), the
// forward's layout (4 warps x 4 rows, key tiles of kAttnBK keys, one per lane). Pass 1 accumulates
// D_i = sum_j dprobs_ij y_ij (warp sums per tile, tiles in order) and writes it to `dsum`
// [b, np_local, sq]; pass 2 recomputes the pairs (the same bits), d scores with D, and dq_i += d
// scores_ij k_j in fp32 registers; dq = alpha round_T(acc) stored in T (the bmm, then mul_(alpha)).
template <class T>
__global__ void dot_product_attention_backward_dq_kernel(AttnOperands op, const T* dcontext, T* dq, const float* stats,
                                                         float* dsum, AttnParams p) {
  DYNAMIC_SHARED(float, smem);
  const int hn = p.hn, kstride = hn + 1;
  float* q_s = smem;                     // [BQ, hn]
  float* o_s = q_s + kAttnBQ * hn;       // [BQ, hn] d context
  float* k_s = o_s + kAttnBQ * hn;       // [BK, hn + 1]
  float* v_s = k_s + kAttnBK * kstride;  // [BK, hn + 1]
  float* d_s = v_s + kAttnBK * kstride;  // [warps, BK] d scores

  const int q0 = blockIdx.x * kAttnBQ, h = blockIdx.y, bi = blockIdx.z;
  const int h_global = p.head_offset + h, g = h / op.hpg;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const std::int64_t q_at = std::int64_t(bi) * op.q_batch + g * op.q_group + (h % op.hpg) * op.q_head;
  const T* q_base = static_cast<const T*>(op.q) + q_at;
  T* dq_base = dq + q_at;
  const std::int64_t kv_at = std::int64_t(bi) * op.kv_batch + g * op.kv_group;
  const T* k_base = static_cast<const T*>(op.k) + kv_at;
  const T* v_base = static_cast<const T*>(op.v) + kv_at;
  const std::int64_t ctx_tok = std::int64_t(p.b) * p.np_local * hn;  // one query position of d context
  const T* o_base = dcontext + (std::int64_t(bi) * p.np_local + h) * hn;
  const std::int64_t row0 = (std::int64_t(bi) * p.np_local + h) * p.sq;  // this (batch, head)'s rows of stats / D
  const float fill = p.softmax_fp32 ? -10000.0f : round_to<T>(-10000.0f);

  for (int e = threadIdx.x; e < kAttnBQ * hn; e += blockDim.x) {
    const int r = e / hn, c = e % hn;
    const bool ok = q0 + r < p.sq;
    q_s[e] = ok ? Io<T>::load(q_base[(q0 + r) * op.q_tok + c]) : 0.0f;
    o_s[e] = ok ? Io<T>::load(o_base[(q0 + r) * ctx_tok + c]) : 0.0f;
  }
  const int q_last = min(q0 + kAttnBQ, p.sq) - 1;
  const int k_end = p.mask == MaskMode::Causal ? min(p.sk, q_last + 1) : p.sk;
  auto in_row = [&](int i, int j) { return j < k_end && !(p.mask == MaskMode::Causal && j > i); };
  float m[kAttnRowsPerWarp], l[kAttnRowsPerWarp], dsum_r[kAttnRowsPerWarp];
  for (int r = 0; r < kAttnRowsPerWarp; ++r) {
    const int i = q0 + warp * kAttnRowsPerWarp + r;
    m[r] = i < p.sq ? stats[(row0 + i) * 2] : 0.0f;
    l[r] = i < p.sq ? stats[(row0 + i) * 2 + 1] : 1.0f;
    dsum_r[r] = 0.0f;
  }
  auto pair = [&](int r, int i, int j) {
    const int row = warp * kAttnRowsPerWarp + r;
    const float s = attn_score<T>(q_s + row * hn, k_s + lane * kstride, hn, p, bi, h_global, i, j, fill);
    return attn_backward_pair<T>(s, m[r], l[r], attn_dot(o_s + row * hn, v_s + lane * kstride, hn), p, bi, h_global, i,
                                 j);
  };
  auto load_tile = [&](int k0) {
    for (int e = threadIdx.x; e < kAttnBK * hn; e += blockDim.x) {
      const int j = e / hn, c = e % hn;
      const bool ok = k0 + j < k_end;
      k_s[j * kstride + c] = ok ? Io<T>::load(k_base[(k0 + j) * op.kv_tok + c]) : 0.0f;
      v_s[j * kstride + c] = ok ? Io<T>::load(v_base[(k0 + j) * op.kv_tok + c]) : 0.0f;
    }
  };
  // ---- pass 1: D_i = sum_j dprobs_ij y_ij over the row (masked keys included, as the reference's
  // row dot has them; causally masked ones have y = 0 exactly and are skipped)
  for (int k0 = 0; k0 < k_end; k0 += kAttnBK) {
    __syncthreads();  // previous tile consumed (and q_s / o_s written, first time)
    load_tile(k0);
    __syncthreads();
    for (int r = 0; r < kAttnRowsPerWarp; ++r) {
      const int i = q0 + warp * kAttnRowsPerWarp + r;
      if (i >= p.sq) break;  // warp-uniform
      const int j = k0 + lane;
      float t = 0.0f;
      if (in_row(i, j)) {
        const AttnBwdPair pr = pair(r, i, j);
        t = pr.dprob * pr.y;
      }
      dsum_r[r] += warp_sum(t);  // rounds: D, fp32 over sk
    }
  }
  for (int r = 0; r < kAttnRowsPerWarp; ++r) {
    const int i = q0 + warp * kAttnRowsPerWarp + r;
    if (i < p.sq && lane == 0) dsum[row0 + i] = dsum_r[r];
  }
  // ---- pass 2: d scores, dq += d scores k
  float acc[kAttnRowsPerWarp][kAttnMaxChunks];
  for (int r = 0; r < kAttnRowsPerWarp; ++r)
    for (int c = 0; c < kAttnMaxChunks; ++c) acc[r][c] = 0.0f;
  for (int k0 = 0; k0 < k_end; k0 += kAttnBK) {
    __syncthreads();
    load_tile(k0);
    __syncthreads();
    for (int r = 0; r < kAttnRowsPerWarp; ++r) {
      const int i = q0 + warp * kAttnRowsPerWarp + r;
      if (i >= p.sq) break;  // warp-uniform
      const int j = k0 + lane;
      float ds = 0.0f;
      if (in_row(i, j)) {
        const AttnBwdPair pr = pair(r, i, j);
        ds = attn_dscore<T>(pr.y, pr.dprob, dsum_r[r], attn_masked(p, bi, h_global, i, j), p);
      }
      d_s[warp * kAttnBK + lane] = ds;
      __syncwarp();
      const int n_keys = min(kAttnBK, k_end - k0);
      for (int cc = 0; cc < kAttnMaxChunks; ++cc) {
        const int c = cc * 32 + lane;
        if (c >= hn) break;
        float a = acc[r][cc];
        for (int jj = 0; jj < n_keys; ++jj) a += d_s[warp * kAttnBK + jj] * k_s[jj * kstride + c];
        acc[r][cc] = a;  // rounds: d scores k, fp32 over sk
      }
      __syncwarp();  // d_s is rewritten by the next row
    }
  }
  for (int r = 0; r < kAttnRowsPerWarp; ++r) {
    const int i = q0 + warp * kAttnRowsPerWarp + r;
    if (i >= p.sq) break;
    for (int cc = 0; cc < kAttnMaxChunks; ++cc) {
      const int c = cc * 32 + lane;
      // rounds: the bmm ds k, T; dq = its product with alpha, T (torch's grad.bmm(k).mul_(alpha))
      if (c < hn) dq_base[i * op.q_tok + c] = Io<T>::store(p.alpha * round_to<T>(acc[r][cc]));
    }
  }
}

inline std::size_t attention_backward_dq_smem_bytes(int hn) {
  return attention_smem_bytes(hn) + sizeof(float) * std::size_t(kAttnBQ) * hn;
}

// Kernel 2: dk and dv. One block per key tile (kAttnBwdBK keys) of one (batch, group); 4 warps.
// For each of the group's heads in order, the query rows that see the tile (all, or from the tile's
// first key on when causal) in steps of kAttnBwdBQ: the block computes the step's BQ x BK pairs
// (probability after dropout, d score, from the saved m, l, D) into shared memory, then warp w
// accumulates dv_j += prob_ij dctx_i and dk_j += dscore_ij q_i for its kAttnBwdBK / 4 keys (lane: the
// columns lane + 32 c), rows in order. After a head, its dk = alpha round_T(acc) and dv are rounded to T (the
// reference's per-head bmm outputs, dk's then times alpha) and added to the group's fp32 sums in head order; the sums
// are stored once in T (repeat_interleave's backward; exact for one head per group). NC: 32-column chunks of the head
// dim held in registers (hn <= 32 NC).
constexpr int kAttnBwdBK = 16;  // keys per block of the dk / dv kernel
constexpr int kAttnBwdBQ = 16;  // query rows per step
constexpr int kAttnBwdKeysPerWarp = kAttnBwdBK / kAttnWarps;

template <class T, int NC>
__global__ void dot_product_attention_backward_dkv_kernel(AttnOperands op, const T* dcontext, T* dk, T* dv,
                                                          const float* stats, const float* dsum, AttnParams p) {
  DYNAMIC_SHARED(float, smem);
  const int hn = p.hn, stride = hn + 1;         // +1: threads of one step read rows hn + 1 apart
  float* k_s = smem;                            // [BK, hn + 1]
  float* v_s = k_s + kAttnBwdBK * stride;       // [BK, hn + 1]
  float* q_s = v_s + kAttnBwdBK * stride;       // [BQ, hn + 1]
  float* o_s = q_s + kAttnBwdBQ * stride;       // [BQ, hn + 1] d context
  float* p_s = o_s + kAttnBwdBQ * stride;       // [BQ, BK] probabilities after dropout
  float* d_s = p_s + kAttnBwdBQ * kAttnBwdBK;   // [BQ, BK] d scores
  float* st_s = d_s + kAttnBwdBQ * kAttnBwdBK;  // [BQ, 3] the rows' m, l, D

  const int k0 = blockIdx.x * kAttnBwdBK, g = blockIdx.y, bi = blockIdx.z;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const std::int64_t kv_at = std::int64_t(bi) * op.kv_batch + g * op.kv_group;
  const T* k_base = static_cast<const T*>(op.k) + kv_at;
  const T* v_base = static_cast<const T*>(op.v) + kv_at;
  const std::int64_t ctx_tok = std::int64_t(p.b) * p.np_local * hn;
  const int n_keys = min(kAttnBwdBK, p.sk - k0);
  const bool causal = p.mask == MaskMode::Causal;
  const float fill = p.softmax_fp32 ? -10000.0f : round_to<T>(-10000.0f);
  for (int e = threadIdx.x; e < kAttnBwdBK * hn; e += blockDim.x) {
    const int j = e / hn, c = e % hn;
    const bool ok = j < n_keys;
    k_s[j * stride + c] = ok ? Io<T>::load(k_base[(k0 + j) * op.kv_tok + c]) : 0.0f;
    v_s[j * stride + c] = ok ? Io<T>::load(v_base[(k0 + j) * op.kv_tok + c]) : 0.0f;
  }
  const int i_begin = causal ? k0 : 0;  // rows before the tile's first key see none of it when causal

  float acc_k[kAttnBwdKeysPerWarp][NC], acc_v[kAttnBwdKeysPerWarp][NC];
  float sum_k[kAttnBwdKeysPerWarp][NC], sum_v[kAttnBwdKeysPerWarp][NC];
  for (int kk = 0; kk < kAttnBwdKeysPerWarp; ++kk)
    for (int cc = 0; cc < NC; ++cc) sum_k[kk][cc] = sum_v[kk][cc] = 0.0f;
  for (int hh = 0; hh < op.hpg; ++hh) {
    const int h = g * op.hpg + hh, h_global = p.head_offset + h;
    const T* q_base = static_cast<const T*>(op.q) + std::int64_t(bi) * op.q_batch + g * op.q_group + hh * op.q_head;
    const T* o_base = dcontext + (std::int64_t(bi) * p.np_local + h) * hn;
    const std::int64_t row0 = (std::int64_t(bi) * p.np_local + h) * p.sq;
    for (int kk = 0; kk < kAttnBwdKeysPerWarp; ++kk)
      for (int cc = 0; cc < NC; ++cc) acc_k[kk][cc] = acc_v[kk][cc] = 0.0f;
    for (int q0 = i_begin; q0 < p.sq; q0 += kAttnBwdBQ) {
      __syncthreads();  // the previous step consumed (and k_s / v_s written, first time)
      for (int e = threadIdx.x; e < kAttnBwdBQ * hn; e += blockDim.x) {
        const int r = e / hn, c = e % hn;
        const bool ok = q0 + r < p.sq;
        q_s[r * stride + c] = ok ? Io<T>::load(q_base[(q0 + r) * op.q_tok + c]) : 0.0f;
        o_s[r * stride + c] = ok ? Io<T>::load(o_base[(q0 + r) * ctx_tok + c]) : 0.0f;
      }
      attn_load_row_stats(st_s, stats, dsum, row0, q0, kAttnBwdBQ, p.sq);
      __syncthreads();
      for (int e = threadIdx.x; e < kAttnBwdBQ * kAttnBwdBK; e += blockDim.x) {
        const int r = e / kAttnBwdBK, jj = e % kAttnBwdBK, i = q0 + r, j = k0 + jj;
        float pr = 0.0f, ds = 0.0f;  // rows past sq, keys past sk, causally masked pairs: zero
        if (i < p.sq && jj < n_keys && !(causal && j > i)) {
          const float s = attn_score<T>(q_s + r * stride, k_s + jj * stride, hn, p, bi, h_global, i, j, fill);
          const AttnBwdPair t =
              attn_backward_pair<T>(s, st_s[r * 3], st_s[r * 3 + 1], attn_dot(o_s + r * stride, v_s + jj * stride, hn),
                                    p, bi, h_global, i, j);
          pr = t.prob;
          ds = attn_dscore<T>(t.y, t.dprob, st_s[r * 3 + 2], attn_masked(p, bi, h_global, i, j), p);
        }
        p_s[e] = pr;
        d_s[e] = ds;
      }
      __syncthreads();
      const int n_rows = min(kAttnBwdBQ, p.sq - q0);
      for (int r = 0; r < n_rows; ++r)
        for (int kk = 0; kk < kAttnBwdKeysPerWarp; ++kk) {
          const int jj = warp * kAttnBwdKeysPerWarp + kk;
          const float pr = p_s[r * kAttnBwdBK + jj], ds = d_s[r * kAttnBwdBK + jj];
          for (int cc = 0; cc < NC; ++cc) {
            const int c = cc * 32 + lane;
            if (c >= hn) break;
            acc_v[kk][cc] += pr * o_s[r * stride + c];  // rounds: probs^T d context, fp32 over sq
            acc_k[kk][cc] += ds * q_s[r * stride + c];  // rounds: d scores^T q, fp32 over sq
          }
        }
    }
    for (int kk = 0; kk < kAttnBwdKeysPerWarp; ++kk)
      for (int cc = 0; cc < NC; ++cc) {
        // rounds: this head's bmm ds^T q, T; its product with alpha, T; then the group's sum
        sum_k[kk][cc] += round_to<T>(p.alpha * round_to<T>(acc_k[kk][cc]));
        sum_v[kk][cc] += round_to<T>(acc_v[kk][cc]);  // rounds: this head's dv, T; the group's sum
      }
  }
  T* dk_base = dk + kv_at;
  T* dv_base = dv + kv_at;
  for (int kk = 0; kk < kAttnBwdKeysPerWarp; ++kk) {
    const int jj = warp * kAttnBwdKeysPerWarp + kk;
    if (jj >= n_keys) break;
    for (int cc = 0; cc < NC; ++cc) {
      const int c = cc * 32 + lane;
      if (c >= hn) break;
      dk_base[(k0 + jj) * op.kv_tok + c] = Io<T>::store(sum_k[kk][cc]);  // rounds: the GQA sum, T (exact: one head)
      dv_base[(k0 + jj) * op.kv_tok + c] = Io<T>::store(sum_v[kk][cc]);
    }
  }
}

inline std::size_t attention_backward_dkv_smem_bytes(int hn) {
  return sizeof(float) * (std::size_t(2 * kAttnBwdBK + 2 * kAttnBwdBQ) * (hn + 1) +
                          2 * std::size_t(kAttnBwdBQ) * kAttnBwdBK + 3 * kAttnBwdBQ);
}

// The workspace of dot_product_attention_backward: D [b, np_local, sq] in fp32.
inline std::size_t dot_product_attention_backward_workspace_bytes(const AttnParams& p) {
  return sizeof(float) * std::size_t(std::max(p.b, 0)) * std::size_t(std::max(p.np_local, 0)) *
         std::size_t(std::max(p.sq, 0));
}

// What the two backward kernels move and compute (the cost model). dq kernel: q and d context read,
// dq written once, each row's m, l read and D written; per query tile of each (batch, head), K and V
// read twice (once per pass) over the keys the tile needs. dk / dv kernel: K, V read and dk, dv
// written once per (batch, group); per key tile and head of the group, q and d context read over the
// rows that see the tile, with their m, l, D. An explicit mask read once by each. Nothing of size
// sq x sk. FLOPs: dq kernel 2 x (q k^T + dctx v^T) + d scores k per (row, key) it computes (10 hn),
// dk / dv kernel q k^T + dctx v^T + probs^T dctx + d scores^T q (8 hn); ~10 per pair for the rest.
struct AttnBwdCost {
  AttnCost dq, dkv;
};
// dq_rows: the query rows of a dq block (kAttnBQ on CUDA cores, kTcBQ on tensor cores).
// dkv_keys: the keys of a dk / dv block (kAttnBwdBK on CUDA cores, kTcBwdBK on tensor cores).
inline AttnBwdCost attention_backward_cost(DType dt, const AttnParams& p, int hpg, int dq_rows = kAttnBQ,
                                           int dkv_keys = kAttnBwdBK) {
  const double e = dtype_size(dt), heads = p.np_local, groups = double(p.np_local) / hpg;
  const bool causal = p.mask == MaskMode::Causal;
  const double mask_bytes = p.mask == MaskMode::Explicit ? double(p.mask_b) * p.mask_h * p.sq * p.sk : 0.0;
  double key_rows = 0, row_keys = 0;  // dq kernel, per (batch, head): keys read per query tile; pairs computed
  for (int q0 = 0; q0 < p.sq; q0 += dq_rows) {
    const int rows = std::min(dq_rows, p.sq - q0);
    const int k_end = causal ? std::min(p.sk, q0 + rows) : p.sk;
    key_rows += k_end;
    row_keys += double(rows) * k_end;
  }
  double q_rows = 0, pairs = 0;  // dk / dv kernel, per (batch, head): rows read per key tile; pairs computed
  for (int k0 = 0; k0 < p.sk; k0 += dkv_keys) {
    const int keys = std::min(dkv_keys, p.sk - k0), rows = causal ? p.sq - k0 : p.sq;
    q_rows += rows;
    pairs += double(rows) * keys;
  }
  AttnBwdCost c;
  c.dq.bytes = e * p.b * heads * (3.0 * p.sq * p.hn + 4.0 * key_rows * p.hn) + 12.0 * p.b * heads * p.sq + mask_bytes;
  c.dq.flops = p.b * heads * row_keys * (10.0 * p.hn + 10.0);
  c.dkv.bytes =
      e * p.b * (4.0 * groups * p.sk * p.hn + 2.0 * heads * q_rows * p.hn) + 12.0 * p.b * heads * q_rows + mask_bytes;
  c.dkv.flops = p.b * heads * pairs * (8.0 * p.hn + 10.0);
  return c;
}

// Gradients of dot_product_attention_forward for dcontext [sq, b, np_local * hn]: dq, dk, dv with
// the strides of `ops` (must not alias q, k, v or dcontext: the dk / dv kernel reads q after dq is
// written). softmax_stats: the forward's AttnParams::softmax_stats of the same inputs and params.
// Deterministic: no atomics, every sum in an order fixed by the shapes. tensor_cores: the dq kernel on
// tensor cores (dot_product_attention_backward_wmma.cuh; attention_wmma_supports must hold), and the
// dk / dv kernel too where attention_wmma_dkv_supports holds (head dims up to 128), else both on CUDA
// cores; dot_product_attention_backward below chooses as the forward does.
inline void dot_product_attention_backward_on(bool tensor_cores, DType dt, const AttnOperands& ops,
                                              const void* dcontext, const AttnGradOperands& grads,
                                              const float* softmax_stats, const AttnParams& p, void* workspace,
                                              std::size_t workspace_bytes, cudaStream_t stream) {
  const std::string op = "dot_product_attention_backward";
  require(ops.q && ops.k && ops.v && dcontext, op + ": null q / k / v / dcontext");
  require(grads.dq && grads.dk && grads.dv, op + ": null dq / dk / dv");
  require(softmax_stats, op + ": null softmax_stats (the forward's AttnParams::softmax_stats)");
  const void* inputs[] = {ops.q, ops.k, ops.v, dcontext};
  for (const void* in : inputs)
    require(in != grads.dq && in != grads.dk && in != grads.dv,
            op + ": dq / dk / dv must not alias q / k / v / dcontext (they are read after the grads are written)");
  attention_check_shapes(op, ops, p);
  require(!tensor_cores || attention_wmma_supports(dt, p.hn), op + ": no tensor-core kernel for this dtype / head dim");
  const bool dkv_tensor_cores = tensor_cores && attention_wmma_dkv_supports(dt, p.hn);
  require(p.coeff == 0.0f || p.softmax_fp32 || dt == DType::F32,
          op + ": the layer-scaling coefficient needs the softmax in fp32 (Megatron asserts it)");
  const std::size_t ws_need = dot_product_attention_backward_workspace_bytes(p);
  require(workspace && workspace_bytes >= ws_need, op + ": workspace of " + std::to_string(workspace_bytes) +
                                                       " bytes is null or smaller than the " + std::to_string(ws_need) +
                                                       " bytes needed");
  // counts: as the reference's backward. d probs = dctx v^T (hn long, stored in T), dropout's
  // backward (T), D (sk long), the softmax backward's output (fp32 under the upcast, then the
  // coefficient's fp32 product and .float()'s store in T; else T, then the coefficient's fp32
  // product), the bmm grads dq / dk / dv (max(sq, sk) long, stored in T), the GQA sum (T).
  const bool upcast = p.softmax_fp32 && dt != DType::F32;
  rounding_reduce(p.hn);
  rounding_store(dt);
  if (p.drop.active) rounding_store(dt);
  rounding_reduce(p.sk);
  if (upcast) {
    rounding_store(DType::F32, p.coeff != 0.0f ? 2 : 1);
    rounding_store(dt);
  } else {
    rounding_store(dt);
    if (p.coeff != 0.0f) rounding_store(DType::F32);
  }
  rounding_reduce(std::max(p.sq, p.sk));
  rounding_store(dt, 2);  // the bmm outputs; dq and dk's product with alpha (dv's path has one store)
  if (ops.hpg > 1) rounding_store(dt);
  {
    // cost: attention_backward_cost, one declaration per kernel.
    const AttnBwdCost c = attention_backward_cost(dt, p, ops.hpg, tensor_cores ? kTcBQ : kAttnBQ,
                                                  dkv_tensor_cores ? kTcBwdBK : kAttnBwdBK);
    rt::declare_cost("dot_product_attention_backward_dq", c.dq.bytes, c.dq.flops);
    rt::declare_cost("dot_product_attention_backward_dkv", c.dkv.bytes, c.dkv.flops);
  }
  float* dsum = static_cast<float*>(workspace);
  dispatch_dtype(dt, op.c_str(), [&](auto tag) {
    using T = decltype(tag);
    const T* dctx = static_cast<const T*>(dcontext);
    const dim3 block(32 * kAttnWarps);
    const dim3 grid_q(ceil_div(p.sq, kAttnBQ), static_cast<unsigned>(p.np_local), static_cast<unsigned>(p.b));
    if (tensor_cores)
      launch_attention_backward_dq_wmma(dt, ops, dctx, grads.dq, softmax_stats, dsum, p, stream);
    else
      launch_kernel(dot_product_attention_backward_dq_kernel<T>, grid_q, block, attention_backward_dq_smem_bytes(p.hn),
                    stream, ops, dctx, static_cast<T*>(grads.dq), softmax_stats, dsum, p);
    if (dkv_tensor_cores)
      return launch_attention_backward_dkv_wmma(dt, ops, dctx, grads.dk, grads.dv, softmax_stats, dsum, p, stream);
    const dim3 grid_k(ceil_div(p.sk, kAttnBwdBK), static_cast<unsigned>(p.np_local / ops.hpg),
                      static_cast<unsigned>(p.b));
    auto dkv = [&](auto nc) {
      constexpr int NC = decltype(nc)::value;
      launch_kernel((dot_product_attention_backward_dkv_kernel<T, NC>), grid_k, block,
                    attention_backward_dkv_smem_bytes(p.hn), stream, ops, dctx, static_cast<T*>(grads.dk),
                    static_cast<T*>(grads.dv), static_cast<const float*>(softmax_stats),
                    static_cast<const float*>(dsum), p);
    };
    if (p.hn <= 64)
      dkv(std::integral_constant<int, 2>{});
    else if (p.hn <= 128)
      dkv(std::integral_constant<int, 4>{});
    else
      dkv(std::integral_constant<int, kAttnMaxChunks>{});
  });
}

inline void dot_product_attention_backward(DType dt, const AttnOperands& ops, const void* dcontext,
                                           const AttnGradOperands& grads, const float* softmax_stats,
                                           const AttnParams& p, void* workspace, std::size_t workspace_bytes,
                                           cudaStream_t stream) {
  dot_product_attention_backward_on(attention_wmma_supports(dt, p.hn), dt, ops, dcontext, grads, softmax_stats, p,
                                    workspace, workspace_bytes, stream);
}

// Self attention on the fused linear_qkv output (as the forward's overload): the grads land in
// dqkv, a buffer of qkv's layout.
inline void dot_product_attention_backward(DType dt, const void* qkv, const QkvLayout& lay, const void* dcontext,
                                           void* dqkv, const float* softmax_stats, const AttnParams& p, void* workspace,
                                           std::size_t workspace_bytes, cudaStream_t stream) {
  require(qkv != nullptr && dqkv != nullptr, "dot_product_attention_backward: null qkv / dqkv");
  const std::size_t es = dtype_size(dt);
  dot_product_attention_backward(dt, AttnOperands::from_qkv(qkv, lay, p.b, p.hn, es), dcontext,
                                 AttnGradOperands::from_qkv(dqkv, lay, p.hn, es), softmax_stats, p, workspace,
                                 workspace_bytes, stream);
}

}  // namespace twin::opt::TWIN_BACKEND
