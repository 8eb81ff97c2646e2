/* Tensor cores (dot_product_attention_forward_wmma_kernel, chosen by attention_wmma_supports: bf16 /
 * fp16, head dim up to 256, zero-padded to a multiple of 16 in shared memory; the CUDA-core kernel
 * (dot_product_attention_simt.cuh) stays for fp32, which WMMA has no path for). The same two passes, with q k^T and p v
 * as nvcuda::wmma m16n16k16 products: a block owns 64 query rows, 16 per warp (one WMMA row tile, its q fragments kept
 * in registers); K and V stream through shared memory in tiles of 64 keys, stored in T as they are in memory.
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
 * block's last query are skipped, and the 16-key WMMA tiles past the end of the keys. GQA by index, as
 * the CUDA-core kernel. Cost (attention_forward_cost): per query tile K is read twice (once per pass) and V once;
 */
#pragma once

#include "optimized/dot_product_attention_common.cuh"

namespace twin::opt::TWIN_BACKEND {

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

// Calls f(T{}, std::integral_constant<int, NT>{}) with the 16-bit T of dt and the fragment count NT a
// head dim of hn needs (4, 8 or 16 tiles of 16 columns): the kernels' template arguments.
template <class F>
inline void dispatch_wmma(DType dt, int hn, F&& f) {
  auto by_head_dim = [&](auto tag) {
    if (hn <= 64)
      f(tag, std::integral_constant<int, 4>{});
    else if (hn <= 128)
      f(tag, std::integral_constant<int, 8>{});
    else
      f(tag, std::integral_constant<int, kAttnMaxHeadDim / 16>{});
  };
  if (dt == DType::BF16)
    by_head_dim(__nv_bfloat16{});
  else
    by_head_dim(__half{});
}

inline std::size_t attention_wmma_smem_bytes(DType dt, int hn) {
  const std::size_t e = dtype_size(dt);
  return e * (std::size_t(kTcBQ) + 2 * kTcBK) * attention_wmma_padded_head_dim(hn) +
         std::size_t(kTcWarps) * 16 * kTcBK * (sizeof(float) + e);
}

}  // namespace twin::opt::TWIN_BACKEND
