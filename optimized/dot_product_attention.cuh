/* Core attention forward (reference/dot_product_attention.h; Megatron's DotProductAttention,
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
 *
 * Tensor cores (dot_product_attention_forward_wmma_kernel, chosen by attention_wmma_supports: bf16 /
 * fp16, head dim up to 256, zero-padded to a multiple of 16 in shared memory; the CUDA-core kernel
 * above stays for fp32, which WMMA has no path for). The same two passes, with q k^T and p v as nvcuda::wmma m16n16k16
 * products: a block owns 64 query rows, 16 per warp (one WMMA row tile, its q fragments kept in registers); K and V
 * stream through shared memory in tiles of 64 keys, stored in T as they are in memory.
 *   1. per key tile, S = q k^T for the warp's 16 rows (fp32 accumulation over hn), stored to shared
 *      memory; each score is finished exactly as the CUDA-core kernel does (attn_score_from_dot:
 *      alpha, rounded to T, coeff, mask) and feeds the online max and sum;
 *   2. S again (the same products on the same tiles: the same bits), p = exp(s - m) / l rounded to
 *      T, dropout, P written to shared memory in T, and O += P V on tensor cores with fp32
 *      accumulators over all key tiles; O is rounded to T once at the end.
 * Megatron's rounding points stay where they are: the scores are an fp32 accumulation of hn
 * products of T values, stored in T (baddbmm); the probabilities are rounded to T before p v (the
 * softmax output .to(T)); p v is an fp32 accumulation over sk stored in T (bmm). A tensor core only
 * changes the order of each fp32 accumulation (and the products of two 16-bit values are exact in
 * fp32), so the launcher's counts (rounding_reduce(hn), rounding_reduce(sk), the stores) are the
 * same for both kernels and the bound built from them covers either. Causal: key tiles past the
 * block's last query are skipped, and the 16-key WMMA tiles past the end of the keys. GQA by index as
 * above. Cost (attention_forward_cost): per query tile K is read twice (once per pass) and V once;
 * nothing of size sq x sk goes to global memory. */
#pragma once

#include "philox.cuh"

namespace twin::opt::TWIN_BACKEND {

enum class MaskMode : int { None, Causal, Explicit };

constexpr int kAttnBQ = 16;  // query rows per block
constexpr int kAttnBK = 32;  // keys per tile (one per lane)
constexpr int kAttnWarps = 4;
constexpr int kAttnRowsPerWarp = kAttnBQ / kAttnWarps;
constexpr int kAttnMaxHeadDim = 256;
constexpr int kAttnMaxChunks = kAttnMaxHeadDim / 32;

// Where q, k and v live inside the fused linear_qkv output [s, b, ng_local, (hpg + 2) * hn]:
// token t = s_idx * b + b_idx; q of local head h at t * ld + (h / hpg) * group_stride + (h % hpg) * hn;
// k of local group g at t * ld + g * group_stride + hpg * hn; v right after k.
struct QkvLayout {
  std::int64_t ld = 0;            // elements per token
  std::int64_t group_stride = 0;  // (hpg + 2) * hn
  int hpg = 1;                    // query heads per group
};

// Separate query and key/value layouts (cross attention, Retro's chunks and neighbours): query
// head h of batch column bi at query position i is at
//   q + i * q_tok + bi * q_batch + (h / hpg) * q_group + (h % hpg) * q_head,
// key / value of group g at key position j at k / v + j * kv_tok + bi * kv_batch + g * kv_group.
// Each tensor is read in place by index: a strided batch column (a neighbour's rows inside the
// [r, bs*l*k] layout) costs no copy.
struct AttnOperands {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  std::int64_t q_tok = 0, q_batch = 0, q_group = 0, q_head = 0;
  int hpg = 1;
  std::int64_t kv_tok = 0, kv_batch = 0, kv_group = 0;
  // The fused linear_qkv output of a self attention (QkvLayout) as operands.
  static AttnOperands from_qkv(const void* qkv, const QkvLayout& lay, int b, int hn, std::size_t elem_bytes) {
    AttnOperands o;
    const char* base = static_cast<const char*>(qkv);
    o.q = base;
    o.k = base + std::size_t(lay.hpg) * hn * elem_bytes;
    o.v = base + std::size_t(lay.hpg + 1) * hn * elem_bytes;
    o.q_tok = o.kv_tok = std::int64_t(b) * lay.ld;
    o.q_batch = o.kv_batch = lay.ld;
    o.q_group = o.kv_group = lay.group_stride;
    o.q_head = hn;
    o.hpg = lay.hpg;
    return o;
  }
};

struct AttnParams {
  int sq = 0, sk = 0, b = 0;
  int np_local = 0;     // heads on this rank
  int np_total = 0;     // heads of the layer (mask head dim, dropout numbering)
  int head_offset = 0;  // global index of local head 0
  int hn = 0;
  float alpha = 1.0f;        // softmax_scale (already divided by coeff)
  float coeff = 0.0f;        // apply_query_key_layer_scaling: layer_number; 0 when off
  bool softmax_fp32 = true;  // softmax input/output in fp32 (attention_softmax_in_fp32 for bf16/fp16)
  MaskMode mask = MaskMode::None;
  const std::uint8_t* mask_ptr = nullptr;  // [mask_b, mask_h, sq, sk], nonzero = masked
  int mask_b = 1, mask_h = 1;
  DropoutArgs drop;  // attention dropout over the flat [b, np_total, sq, sk] probabilities
  // [b, np_local, sq, 2]: each row's online max m and sum l of exp(s - m) after pass 1 (what pass 2
  // divides by), written by the forward when not null, for a backward that recomputes the
  // probabilities from them. Null: not saved (the forward's output is the same either way).
  float* softmax_stats = nullptr;
};

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

// ---- tensor cores (WMMA): bf16 / fp16, head dims a multiple of 16 up to 256 ----
constexpr int kTcBQ = 64;  // query rows per block: 16 per warp, one WMMA row tile each
constexpr int kTcBK = 64;  // keys per K / V tile
constexpr int kTcWarps = kTcBQ / 16;
constexpr int kTcSub = kTcBK / 16;  // 16-key WMMA tiles per key tile

// Whether the tensor-core kernel covers an attention: WMMA has 16-bit inputs with fp32
// accumulation (no fp32 inputs), so bf16 / fp16 with a head dim up to kAttnMaxHeadDim (one that is
// not a multiple of 16 is zero-padded in shared memory: the padded products are exact zeros, which
// leave an fp32 sum unchanged); fp32 runs on the CUDA-core kernel.
inline bool attention_wmma_supports(DType dt, int hn) {
  return (dt == DType::BF16 || dt == DType::F16) && hn > 0 && hn <= kAttnMaxHeadDim;
}
__host__ __device__ inline int attention_wmma_padded_head_dim(int hn) { return (hn + 15) / 16 * 16; }

// One warp's raw scores S[16, 16 * n_sub] = Q[16, hp] K^T for the key tile in k_s ([BK, hp] row-major,
// so K^T is a col_major matrix_b; hp the padded head dim), accumulated in fp32, stored row-major into
// s_w (ldm BK).
template <class T, int NT>
__device__ inline void attn_wmma_scores(
    const nvcuda::wmma::fragment<nvcuda::wmma::matrix_a, 16, 16, 16, T, nvcuda::wmma::row_major> (&qf)[NT],
    const T* k_s, int hp, int n_sub, float* s_w) {
  namespace wmma = nvcuda::wmma;
  for (int n = 0; n < n_sub; ++n) {
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    wmma::fill_fragment(acc, 0.0f);
    for (int c = 0; c < NT; ++c) {
      if (c * 16 >= hp) break;  // warp-uniform
      wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> kf;
      wmma::load_matrix_sync(kf, k_s + n * 16 * hp + c * 16, hp);
      wmma::mma_sync(acc, qf[c], kf, acc);  // rounds: q k^T, fp32 accumulation over hn
    }
    wmma::store_matrix_sync(s_w + n * 16, acc, kTcBK, wmma::mem_row_major);
  }
  __syncwarp();  // every lane's part of S is visible to the whole warp
}

// NT: 16-column tiles of the head dim the kernel holds (hp <= 16 NT); a compile-time count keeps
// the fragments in registers on the GPU. Shared memory rows are hp = hn rounded up to 16 wide, the
// columns past hn zero.
template <class T, int NT>
__global__ void dot_product_attention_forward_wmma_kernel(AttnOperands op, T* context, AttnParams p) {
  namespace wmma = nvcuda::wmma;
  DYNAMIC_SHARED(unsigned char, smem);
  const int hn = p.hn, hp = attention_wmma_padded_head_dim(hn);
  T* q_s = reinterpret_cast<T*>(smem);                         // [BQ, hp]
  T* k_s = q_s + kTcBQ * hp;                                   // [BK, hp]
  T* v_s = k_s + kTcBK * hp;                                   // [BK, hp]
  float* s_s = reinterpret_cast<float*>(v_s + kTcBK * hp);     // [warps, 16, BK] raw scores
  T* p_s = reinterpret_cast<T*>(s_s + kTcWarps * 16 * kTcBK);  // [warps, 16, BK] probabilities
  float* o_s = reinterpret_cast<float*>(k_s);                  // [BQ, hp] context, over k_s / v_s at the end
  static_assert(kTcBQ * sizeof(float) <= 2 * kTcBK * sizeof(T), "o_s must fit in k_s and v_s");

  const int q0 = blockIdx.x * kTcBQ, h = blockIdx.y, bi = blockIdx.z;
  const int h_global = p.head_offset + h, g = h / op.hpg;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int w0 = q0 + warp * 16;     // the warp's first query row
  const bool warp_rows = w0 < p.sq;  // warp-uniform: the warp has rows to compute
  float* s_w = s_s + warp * 16 * kTcBK;
  T* p_w = p_s + warp * 16 * kTcBK;
  const T* q_base =
      static_cast<const T*>(op.q) + std::int64_t(bi) * op.q_batch + g * op.q_group + (h % op.hpg) * op.q_head;
  const std::int64_t kv_at = std::int64_t(bi) * op.kv_batch + g * op.kv_group;
  const T* k_base = static_cast<const T*>(op.k) + kv_at;
  const T* v_base = static_cast<const T*>(op.v) + kv_at;
  const float fill = p.softmax_fp32 ? -10000.0f : round_to<T>(-10000.0f);
  const T zero = Io<T>::store(0.0f);

  for (int e = threadIdx.x; e < kTcBQ * hp; e += blockDim.x) {
    const int r = e / hp, c = e % hp;
    q_s[e] = q0 + r < p.sq && c < hn ? q_base[(q0 + r) * op.q_tok + c] : zero;
  }
  const int q_last = min(q0 + kTcBQ, p.sq) - 1;
  const int k_end = p.mask == MaskMode::Causal ? min(p.sk, q_last + 1) : p.sk;
  auto in_row = [&](int i, int j) { return j < k_end && !(p.mask == MaskMode::Causal && j > i); };
  // K (and V) rows of the tile at k0; rows past k_end are zero (P is zero there, and 0 * NaN poison
  // would not be).
  auto load_tile = [&](int k0, bool with_v) {
    for (int e = threadIdx.x; e < kTcBK * hp; e += blockDim.x) {
      const int j = e / hp, c = e % hp;
      const bool ok = k0 + j < k_end && c < hn;
      k_s[e] = ok ? k_base[(k0 + j) * op.kv_tok + c] : zero;
      if (with_v) v_s[e] = ok ? v_base[(k0 + j) * op.kv_tok + c] : zero;
    }
  };
  __syncthreads();  // q_s written
  wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> qf[NT];
  if (warp_rows) {
    for (int c = 0; c < NT; ++c)
      if (c * 16 < hp) wmma::load_matrix_sync(qf[c], q_s + warp * 16 * hp + c * 16, hp);
  }

  // ---- pass 1: online max m and rescaled sum l per row (the warp's 16 rows; every lane holds them)
  float m[16], l[16];
  for (int r = 0; r < 16; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.0f;
  }
  for (int k0 = 0; k0 < k_end; k0 += kTcBK) {
    __syncthreads();  // the previous tile consumed
    load_tile(k0, false);
    __syncthreads();
    if (!warp_rows) continue;
    const int n_sub = (min(kTcBK, k_end - k0) + 15) / 16;
    attn_wmma_scores<T, NT>(qf, k_s, hp, n_sub, s_w);
    for (int r = 0; r < 16; ++r) {
      const int i = w0 + r;
      if (i >= p.sq) break;  // warp-uniform
      float s2[2];
      bool keep[2];
      for (int t = 0; t < 2; ++t) {
        const int jj = lane + 32 * t, j = k0 + jj;
        keep[t] = in_row(i, j);
        s2[t] = keep[t] ? attn_score_from_dot<T>(s_w[r * kTcBK + jj], p, bi, h_global, i, j, fill) : -INFINITY;
      }
      const float m_new = fmaxf(m[r], warp_max(fmaxf(s2[0], s2[1])));
      const float e_s = (keep[0] ? expf(s2[0] - m_new) : 0.0f) + (keep[1] ? expf(s2[1] - m_new) : 0.0f);
      l[r] = (m_new == -INFINITY ? l[r] : l[r] * expf(m[r] - m_new)) + warp_sum(e_s);
      m[r] = m_new;
    }
    __syncwarp();  // s_w is rewritten by the next tile
  }
  if (warp_rows && lane == 0)
    for (int r = 0; r < 16 && w0 + r < p.sq; ++r) attn_save_stats(p, bi, h, w0 + r, m[r], l[r]);

  // ---- pass 2: the same scores again, probabilities in T, dropout, P V on tensor cores
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> o[NT];
  for (int c = 0; c < NT; ++c) wmma::fill_fragment(o[c], 0.0f);
  for (int k0 = 0; k0 < k_end; k0 += kTcBK) {
    __syncthreads();
    load_tile(k0, true);
    __syncthreads();
    if (!warp_rows) continue;
    const int n_sub = (min(kTcBK, k_end - k0) + 15) / 16;
    attn_wmma_scores<T, NT>(qf, k_s, hp, n_sub, s_w);
    for (int r = 0; r < 16; ++r) {
      const int i = w0 + r;
      for (int t = 0; t < 2; ++t) {
        const int jj = lane + 32 * t, j = k0 + jj;
        float pr = 0.0f;  // rows past sq and keys outside the row: zero probability
        if (i < p.sq && in_row(i, j)) {
          const float s = attn_score_from_dot<T>(s_w[r * kTcBK + jj], p, bi, h_global, i, j, fill);
          pr = round_to<T>(attn_softmax_out(s, m[r], l[r]));  // rounds: softmax output (fp32), probs.to(T)
          if (p.drop.active) {
            const std::uint64_t e = attn_dropout_element(p, bi, h_global, i, j);
            pr = philox_keep(p.drop.seed, p.drop.offset, e, p.drop.threshold) ? dropout_scaled<T>(pr, p.drop.scale)
                                                                              : 0.0f;
          }
        }
        p_w[r * kTcBK + jj] = Io<T>::store(pr);  // exact: pr is a T value
      }
    }
    __syncwarp();  // P complete before the warp loads it
    for (int n = 0; n < n_sub; ++n) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> pf;
      wmma::load_matrix_sync(pf, p_w + n * 16, kTcBK);
      for (int c = 0; c < NT; ++c) {
        if (c * 16 >= hp) break;  // warp-uniform
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> vf;
        wmma::load_matrix_sync(vf, v_s + n * 16 * hp + c * 16, hp);
        wmma::mma_sync(o[c], pf, vf, o[c]);  // rounds: probs v, fp32 accumulation over sk
      }
    }
    __syncwarp();  // p_w / s_w are rewritten by the next tile
  }
  __syncthreads();  // k_s / v_s become o_s
  if (warp_rows) {
    for (int c = 0; c < NT; ++c)
      if (c * 16 < hp) wmma::store_matrix_sync(o_s + warp * 16 * hp + c * 16, o[c], hp, wmma::mem_row_major);
  }
  __syncwarp();
  for (int r = 0; r < 16; ++r) {
    const int i = w0 + r;
    if (i >= p.sq) break;
    T* out = context + (std::int64_t(i) * p.b + bi) * (std::int64_t(p.np_local) * hn) + std::int64_t(h) * hn;  // [hn]
    for (int c = lane; c < hn; c += 32) out[c] = Io<T>::store(o_s[(warp * 16 + r) * hp + c]);  // rounds: bmm output, T
  }
}

inline std::size_t attention_wmma_smem_bytes(DType dt, int hn) {
  const std::size_t e = dtype_size(dt);
  return e * (std::size_t(kTcBQ) + 2 * kTcBK) * attention_wmma_padded_head_dim(hn) +
         std::size_t(kTcWarps) * 16 * kTcBK * (sizeof(float) + e);
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

// q, k, v as laid out by `ops`, context: [sq, b, np_local * hn].
inline void dot_product_attention_forward(DType dt, const AttnOperands& ops, void* context, const AttnParams& p,
                                          cudaStream_t stream) {
  const std::string op = "dot_product_attention_forward";
  require(ops.q && ops.k && ops.v && context, op + ": null q / k / v / context");
  // counts: q k^T (stored in T), * coeff in fp32, the softmax's sum and its output (fp32, then T
  // when the softmax runs in fp32 for a 16-bit T), the dropout product, probs @ v (stored in T).
  rounding_reduce(p.hn);
  rounding_store(dt);
  if (p.coeff != 0.0f) rounding_store(DType::F32);
  rounding_reduce(p.sk);
  if (p.softmax_fp32 && dt != DType::F32) rounding_store(DType::F32);
  rounding_store(dt);
  if (p.drop.active) rounding_store(dt);
  rounding_reduce(p.sk);
  rounding_store(dt);
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
  const bool tensor_cores = attention_wmma_supports(dt, p.hn);
  {
    // cost: attention_forward_cost of the kernel chosen (its query tile height).
    const AttnCost c = attention_forward_cost(dt, p, tensor_cores ? kTcBQ : kAttnBQ);
    rt::declare_cost("dot_product_attention_forward", c.bytes, c.flops);
  }
  if (tensor_cores) {
    const dim3 grid(ceil_div(p.sq, kTcBQ), static_cast<unsigned>(p.np_local), static_cast<unsigned>(p.b));
    auto launch = [&](auto tag, auto nt) {
      using T = decltype(tag);
      constexpr int NT = decltype(nt)::value;
      launch_kernel((dot_product_attention_forward_wmma_kernel<T, NT>), grid, dim3(32 * kTcWarps),
                    attention_wmma_smem_bytes(dt, p.hn), stream, ops, static_cast<T*>(context), p);
    };
    auto by_head_dim = [&](auto tag) {
      if (p.hn <= 64)
        launch(tag, std::integral_constant<int, 4>{});
      else if (p.hn <= 128)
        launch(tag, std::integral_constant<int, 8>{});
      else
        launch(tag, std::integral_constant<int, kAttnMaxHeadDim / 16>{});
    };
    if (dt == DType::BF16)
      by_head_dim(__nv_bfloat16{});
    else
      by_head_dim(__half{});
    return;
  }
  dispatch_dtype(dt, op.c_str(), [&](auto tag) {
    using T = decltype(tag);
    const dim3 grid(ceil_div(p.sq, kAttnBQ), static_cast<unsigned>(p.np_local), static_cast<unsigned>(p.b));
    launch_kernel(dot_product_attention_forward_kernel<T>, grid, dim3(32 * kAttnWarps), attention_smem_bytes(p.hn),
                  stream, ops, static_cast<T*>(context), p);
  });
}

// qkv: the fused linear_qkv output of this rank (after qk-layernorm and RoPE), context:
// [sq, b, np_local * hn]. Self attention (sq == sk).
inline void dot_product_attention_forward(DType dt, const void* qkv, const QkvLayout& lay, void* context,
                                          const AttnParams& p, cudaStream_t stream) {
  require(qkv != nullptr, "dot_product_attention_forward: null qkv");
  dot_product_attention_forward(dt, AttnOperands::from_qkv(qkv, lay, p.b, p.hn, dtype_size(dt)), context, p, stream);
}

}  // namespace twin::opt::TWIN_BACKEND
