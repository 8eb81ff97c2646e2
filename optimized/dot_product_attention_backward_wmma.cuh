/* The backward's kernels on tensor cores. First the dq kernel
 * (dot_product_attention_backward_dq_wmma_kernel, chosen by attention_wmma_supports as the
 * forward's: bf16 / fp16, head dims up to 256 zero-padded to a multiple of 16 in shared memory;
 * the CUDA-core dq kernel stays for fp32). The CUDA-core kernel's
 * two passes with its per-pair steps (attn_backward_pair, attn_dscore), the three products on
 * nvcuda::wmma m16n16k16 with fp32 accumulation: a block owns 64 query rows, 16 per warp (its q and
 * d context fragments kept in registers); K and V stream through shared memory in tiles of 64
 * keys, stored in T as they are in memory.
 *   1. per key tile, S = q k^T (the forward's WMMA scores: attn_wmma_scores, the same bits) and
 *      DP = dctx v^T for the warp's 16 rows, into shared memory; each pair is finished as the
 *      CUDA-core kernel finishes it, and D_i = sum_j dprobs_ij y_ij accumulates in fp32;
 *   2. S and DP again (the same bits), d scores in T into shared memory, and dQ += dS K on tensor
 *      cores over every key tile; dq = alpha round_T(dQ), stored in T.
 * The rounding points are the CUDA-core kernel's: d probs is an fp32 accumulation of hn exact
 * products of T values, stored in T; a d score is a T value whichever path made it (the softmax
 * backward's store in T, or under the fp32 softmax .float()'s backward store in T; the
 * layer-scaling coefficient needs the fp32 softmax), so dS enters the tensor cores exactly; dS k is
 * an fp32 accumulation over sk stored in T. A tensor core only reorders each fp32 accumulation, so
 * the launcher's counts hold for both kernels and the bound built from them covers either. Causal:
 * key tiles past the block's last query are skipped. GQA by index. Then the dk / dv kernel
 * (dot_product_attention_backward_dkv_wmma_kernel, head dims up to 128; below).
 */
#pragma once

#include "optimized/dot_product_attention_common.cuh"
#include "optimized/dot_product_attention_wmma.cuh"  // kTcBQ, kTcBK, attn_wmma_scores

namespace twin::opt::TWIN_BACKEND {

// The warp's 16 rows of dS K (acc, fp32) finished as Megatron's grad.bmm(k).mul_(alpha): through
// acc_w ([16, hp] fp32 shared memory) into dq rows w0.. (q_tok apart) below sq.
template <class T, int NT>
__device__ inline void attn_wmma_store_dq(
    nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 16, float> (&acc)[NT], bool warp_rows, float* acc_w,
    int hp, T* dq_base, std::int64_t q_tok, int w0, const AttnParams& p) {
  namespace wmma = nvcuda::wmma;
  if (warp_rows) {
    for (int c = 0; c < NT; ++c)
      if (c * 16 < hp) wmma::store_matrix_sync(acc_w + c * 16, acc[c], hp, wmma::mem_row_major);
  }
  __syncwarp();
  const int lane = threadIdx.x % 32;
  for (int r = 0; r < 16; ++r) {
    const int i = w0 + r;
    if (i >= p.sq) break;
    // rounds: the bmm ds k, T; dq = its product with alpha, T
    for (int c = lane; c < p.hn; c += 32)
      dq_base[i * q_tok + c] = Io<T>::store(p.alpha * round_to<T>(acc_w[r * hp + c]));
  }
}

// NT: 16-column tiles of the head dim held in registers (hp <= 16 NT).
template <class T, int NT>
__global__ void dot_product_attention_backward_dq_wmma_kernel(AttnOperands op, const T* dcontext, T* dq,
                                                              const float* stats, float* dsum, AttnParams p) {
  namespace wmma = nvcuda::wmma;
  DYNAMIC_SHARED(unsigned char, smem);
  const int hn = p.hn, hp = attention_wmma_padded_head_dim(hn);
  T* q_s = reinterpret_cast<T*>(smem);                           // [BQ, hp]
  T* o_s = q_s + kTcBQ * hp;                                     // [BQ, hp] d context
  T* k_s = o_s + kTcBQ * hp;                                     // [BK, hp]
  T* v_s = k_s + kTcBK * hp;                                     // [BK, hp]
  float* s_s = reinterpret_cast<float*>(v_s + kTcBK * hp);       // [warps, 16, BK] raw scores
  float* dp_s = s_s + kTcWarps * 16 * kTcBK;                     // [warps, 16, BK] raw dctx . v
  T* ds_s = reinterpret_cast<T*>(dp_s + kTcWarps * 16 * kTcBK);  // [warps, 16, BK] d scores
  float* acc_s = reinterpret_cast<float*>(k_s);                  // [BQ, hp] dS K, over k_s / v_s at the end
  static_assert(kTcBQ * sizeof(float) <= 2 * kTcBK * sizeof(T), "acc_s must fit in k_s and v_s");

  const int q0 = blockIdx.x * kTcBQ, h = blockIdx.y, bi = blockIdx.z;
  const int h_global = p.head_offset + h, g = h / op.hpg;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int w0 = q0 + warp * 16;     // the warp's first query row
  const bool warp_rows = w0 < p.sq;  // warp-uniform
  float* s_w = s_s + warp * 16 * kTcBK;
  float* dp_w = dp_s + warp * 16 * kTcBK;
  T* ds_w = ds_s + warp * 16 * kTcBK;
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
  const T zero = Io<T>::store(0.0f);

  for (int e = threadIdx.x; e < kTcBQ * hp; e += blockDim.x) {
    const int r = e / hp, c = e % hp;
    const bool ok = q0 + r < p.sq && c < hn;
    q_s[e] = ok ? q_base[(q0 + r) * op.q_tok + c] : zero;
    o_s[e] = ok ? o_base[(q0 + r) * ctx_tok + c] : zero;
  }
  const int q_last = min(q0 + kTcBQ, p.sq) - 1;
  const int k_end = p.mask == MaskMode::Causal ? min(p.sk, q_last + 1) : p.sk;
  auto in_row = [&](int i, int j) { return j < k_end && !(p.mask == MaskMode::Causal && j > i); };
  // K and V rows of the tile at k0; rows past k_end are zero (their d scores are zero).
  auto load_tile = [&](int k0) {
    for (int e = threadIdx.x; e < kTcBK * hp; e += blockDim.x) {
      const int j = e / hp, c = e % hp;
      const bool ok = k0 + j < k_end && c < hn;
      k_s[e] = ok ? k_base[(k0 + j) * op.kv_tok + c] : zero;
      v_s[e] = ok ? v_base[(k0 + j) * op.kv_tok + c] : zero;
    }
  };
  __syncthreads();  // q_s, o_s written
  wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> qf[NT], of[NT];
  if (warp_rows) {
    for (int c = 0; c < NT; ++c)
      if (c * 16 < hp) {
        wmma::load_matrix_sync(qf[c], q_s + warp * 16 * hp + c * 16, hp);
        wmma::load_matrix_sync(of[c], o_s + warp * 16 * hp + c * 16, hp);
      }
  }
  float m[16], l[16], dsum_r[16];
  for (int r = 0; r < 16; ++r) {
    const int i = w0 + r;
    m[r] = i < p.sq ? stats[(row0 + i) * 2] : 0.0f;
    l[r] = i < p.sq ? stats[(row0 + i) * 2 + 1] : 1.0f;
    dsum_r[r] = 0.0f;
  }
  // The tile's S and DP for the warp's rows, then the pair of (row r, key column jj).
  auto products = [&](int k0) {
    const int n_sub = (min(kTcBK, k_end - k0) + 15) / 16;
    attn_wmma_scores<T, NT>(qf, k_s, hp, n_sub, s_w);   // rounds: q k^T, fp32 over hn
    attn_wmma_scores<T, NT>(of, v_s, hp, n_sub, dp_w);  // rounds: dctx v^T, fp32 over hn
    return n_sub;
  };
  auto pair = [&](int r, int i, int jj, int j) {
    const float s = attn_score_from_dot<T>(s_w[r * kTcBK + jj], p, bi, h_global, i, j, fill);
    return attn_backward_pair<T>(s, m[r], l[r], dp_w[r * kTcBK + jj], p, bi, h_global, i, j);
  };

  // ---- pass 1: D_i = sum_j dprobs_ij y_ij over the row
  for (int k0 = 0; k0 < k_end; k0 += kTcBK) {
    __syncthreads();  // the previous tile consumed
    load_tile(k0);
    __syncthreads();
    if (!warp_rows) continue;
    products(k0);
    for (int r = 0; r < 16; ++r) {
      const int i = w0 + r;
      if (i >= p.sq) break;  // warp-uniform
      float t = 0.0f;
      for (int u = 0; u < 2; ++u) {
        const int jj = lane + 32 * u, j = k0 + jj;
        if (in_row(i, j)) {
          const AttnBwdPair pr = pair(r, i, jj, j);
          t += pr.dprob * pr.y;
        }
      }
      dsum_r[r] += warp_sum(t);  // rounds: D, fp32 over sk
    }
    __syncwarp();  // s_w / dp_w are rewritten by the next tile
  }
  if (warp_rows && lane == 0)
    for (int r = 0; r < 16 && w0 + r < p.sq; ++r) dsum[row0 + w0 + r] = dsum_r[r];

  // ---- pass 2: d scores in T, dQ += dS K on tensor cores
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[NT];
  for (int c = 0; c < NT; ++c) wmma::fill_fragment(acc[c], 0.0f);
  for (int k0 = 0; k0 < k_end; k0 += kTcBK) {
    __syncthreads();
    load_tile(k0);
    __syncthreads();
    if (!warp_rows) continue;
    const int n_sub = products(k0);
    for (int r = 0; r < 16; ++r) {
      const int i = w0 + r;
      for (int u = 0; u < 2; ++u) {
        const int jj = lane + 32 * u, j = k0 + jj;
        float ds = 0.0f;  // rows past sq and keys outside the row: zero
        if (i < p.sq && in_row(i, j)) {
          const AttnBwdPair pr = pair(r, i, jj, j);
          ds = attn_dscore<T>(pr.y, pr.dprob, dsum_r[r], attn_masked(p, bi, h_global, i, j), p);
        }
        ds_w[r * kTcBK + jj] = Io<T>::store(ds);  // exact: a d score is a T value (see above)
      }
    }
    __syncwarp();  // dS complete before the warp loads it
    for (int n = 0; n < n_sub; ++n) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> dsf;
      wmma::load_matrix_sync(dsf, ds_w + n * 16, kTcBK);
      for (int c = 0; c < NT; ++c) {
        if (c * 16 >= hp) break;  // warp-uniform
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> kf;
        wmma::load_matrix_sync(kf, k_s + n * 16 * hp + c * 16, hp);
        wmma::mma_sync(acc[c], dsf, kf, acc[c]);  // rounds: d scores k, fp32 over sk
      }
    }
    __syncwarp();  // ds_w / s_w / dp_w are rewritten by the next tile
  }
  __syncthreads();  // k_s / v_s become acc_s
  attn_wmma_store_dq<T, NT>(acc, warp_rows, acc_s + warp * 16 * hp, hp, dq_base, op.q_tok, w0, p);
}

inline std::size_t attention_backward_dq_wmma_smem_bytes(DType dt, int hn) {
  const std::size_t e = dtype_size(dt);
  return e * 2 * (std::size_t(kTcBQ) + kTcBK) * attention_wmma_padded_head_dim(hn) +
         std::size_t(kTcWarps) * 16 * kTcBK * (2 * sizeof(float) + e);
}

// Launches the dq kernel for bf16 / fp16 (attention_wmma_supports), its fragment count by head dim.
inline void launch_attention_backward_dq_wmma(DType dt, const AttnOperands& ops, const void* dcontext, void* dq,
                                              const float* stats, float* dsum, const AttnParams& p,
                                              cudaStream_t stream) {
  const dim3 grid(ceil_div(p.sq, kTcBQ), static_cast<unsigned>(p.np_local), static_cast<unsigned>(p.b));
  dispatch_wmma(dt, p.hn, [&](auto tag, auto nt) {
    using T = decltype(tag);
    constexpr int NT = decltype(nt)::value;
    launch_kernel((dot_product_attention_backward_dq_wmma_kernel<T, NT>), grid, dim3(32 * kTcWarps),
                  attention_backward_dq_wmma_smem_bytes(dt, p.hn), stream, ops, static_cast<const T*>(dcontext),
                  static_cast<T*>(dq), stats, dsum, p);
  });
}

// ---- dk / dv ----------------------------------------------------------------------------------

constexpr int kTcBwdBK = 64;  // keys per block of the dk / dv kernel: 16 per warp
constexpr int kTcBwdBQ = 16;  // query rows per step (one WMMA tile)

// One warp's raw transposed products X^T[16 keys, 16 rows] = K[16, hp] Q^T for its 16 keys k_w
// ([16, hp] row-major) and the step's rows q_s ([16, hp] row-major, so Q^T is a col_major
// matrix_b), stored row-major into x_w (ldm 16): each element the 16-bit products added in the k
// order attn_wmma_scores adds them (fragment c by c from zero), so the scores are the forward's.
template <class T, int NT>
__device__ inline void attn_wmma_transposed_scores(const T* k_w, const T* q_s, int hp, float* x_w) {
  namespace wmma = nvcuda::wmma;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
  wmma::fill_fragment(acc, 0.0f);
  for (int c = 0; c < NT; ++c) {
    if (c * 16 >= hp) break;  // warp-uniform
    wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> kf;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> qf;
    wmma::load_matrix_sync(kf, k_w + c * 16, hp);
    wmma::load_matrix_sync(qf, q_s + c * 16, hp);
    wmma::mma_sync(acc, kf, qf, acc);
  }
  wmma::store_matrix_sync(x_w, acc, kTcBwdBQ, wmma::mem_row_major);
}

// Whether the dk / dv kernel runs on tensor cores: the dq kernel's dtypes, head dims up to 128
// padded (a warp keeps four fp32 accumulator rows of its 16 keys across the head dim: dk, dv and
// their group sums, 4 x hp / 16 fragments; past 128 they would not fit in registers on a GPU, and
// the CUDA-core kernel serves those).
inline bool attention_wmma_dkv_supports(DType dt, int hn) {
  return attention_wmma_supports(dt, hn) && attention_wmma_padded_head_dim(hn) <= 128;
}

// dk, dv on tensor cores: one block per 64 keys of one (batch, group), warp w the keys 16 w..; for
// each of the group's heads in order, the query rows that see the block (causal: from its first
// key on) in steps of 16. Per step a warp computes S^T = K Q^T and DP^T = V dctx^T for its keys
// (the forward's scores: the same 16-bit products added in the same k order as attn_wmma_scores),
// finishes each pair as the CUDA-core kernel does (probability after dropout and d score, both T
// values, so they enter the tensor cores exactly), and accumulates dV += P^T dctx and dK += dS^T q
// in fp32 fragments. After a head its dk = alpha round_T(dK) and dv = round_T(dV) are rounded to T
// and added to the group's fp32 sums (element by element on the fragments, heads in order); the
// sums are stored once in T. The rounding points are the CUDA-core kernel's; only each fp32
// accumulation over the rows is reordered.
template <class T, int NT>
__global__ void dot_product_attention_backward_dkv_wmma_kernel(AttnOperands op, const T* dcontext, T* dk, T* dv,
                                                               const float* stats, const float* dsum, AttnParams p) {
  namespace wmma = nvcuda::wmma;
  using Acc = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;
  DYNAMIC_SHARED(unsigned char, smem);
  const int hn = p.hn, hp = attention_wmma_padded_head_dim(hn);
  T* k_s = reinterpret_cast<T*>(smem);                              // [BK, hp] the block's keys
  T* v_s = k_s + kTcBwdBK * hp;                                     // [BK, hp]
  T* q_s = v_s + kTcBwdBK * hp;                                     // [BQ, hp] the step's query rows
  T* o_s = q_s + kTcBwdBQ * hp;                                     // [BQ, hp] their d context
  float* st_s = reinterpret_cast<float*>(o_s + kTcBwdBQ * hp);      // [BQ, 3] the rows' m, l, D
  float* s_s = st_s + kTcBwdBQ * 3;                                 // [warps, 16 keys, BQ] raw scores S^T
  float* dp_s = s_s + kTcWarps * 16 * kTcBwdBQ;                     // [warps, 16, BQ] raw v . dctx
  T* pt_s = reinterpret_cast<T*>(dp_s + kTcWarps * 16 * kTcBwdBQ);  // [warps, 16, BQ] P^T
  T* dst_s = pt_s + kTcWarps * 16 * kTcBwdBQ;                       // [warps, 16, BQ] dS^T
  float* out_s = reinterpret_cast<float*>(k_s);  // [warps, 16, hp] the sums, over k_s / v_s at the end
  static_assert(kTcWarps * 16 * sizeof(float) <= 2 * kTcBwdBK * sizeof(T), "out_s must fit in k_s and v_s");

  const int k0 = blockIdx.x * kTcBwdBK, g = blockIdx.y, bi = blockIdx.z;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int j0 = k0 + warp * 16;     // the warp's first key
  const bool warp_keys = j0 < p.sk;  // warp-uniform
  float* s_w = s_s + warp * 16 * kTcBwdBQ;
  float* dp_w = dp_s + warp * 16 * kTcBwdBQ;
  T* pt_w = pt_s + warp * 16 * kTcBwdBQ;
  T* dst_w = dst_s + warp * 16 * kTcBwdBQ;
  const std::int64_t kv_at = std::int64_t(bi) * op.kv_batch + g * op.kv_group;
  const T* k_base = static_cast<const T*>(op.k) + kv_at;
  const T* v_base = static_cast<const T*>(op.v) + kv_at;
  const std::int64_t ctx_tok = std::int64_t(p.b) * p.np_local * hn;
  const bool causal = p.mask == MaskMode::Causal;
  const float fill = p.softmax_fp32 ? -10000.0f : round_to<T>(-10000.0f);
  const T zero = Io<T>::store(0.0f);
  for (int e = threadIdx.x; e < kTcBwdBK * hp; e += blockDim.x) {
    const int j = e / hp, c = e % hp;
    const bool ok = k0 + j < p.sk && c < hn;
    k_s[e] = ok ? k_base[(k0 + j) * op.kv_tok + c] : zero;
    v_s[e] = ok ? v_base[(k0 + j) * op.kv_tok + c] : zero;
  }
  const int i_begin = causal ? k0 : 0;  // rows before the block's first key see none of it when causal

  Acc acc_k[NT], acc_v[NT], sum_k[NT], sum_v[NT];
  for (int c = 0; c < NT; ++c) wmma::fill_fragment(sum_k[c], 0.0f), wmma::fill_fragment(sum_v[c], 0.0f);
  for (int hh = 0; hh < op.hpg; ++hh) {
    const int h = g * op.hpg + hh, h_global = p.head_offset + h;
    const T* q_base = static_cast<const T*>(op.q) + std::int64_t(bi) * op.q_batch + g * op.q_group + hh * op.q_head;
    const T* o_base = dcontext + (std::int64_t(bi) * p.np_local + h) * hn;
    const std::int64_t row0 = (std::int64_t(bi) * p.np_local + h) * p.sq;
    for (int c = 0; c < NT; ++c) wmma::fill_fragment(acc_k[c], 0.0f), wmma::fill_fragment(acc_v[c], 0.0f);
    for (int q0 = i_begin; q0 < p.sq; q0 += kTcBwdBQ) {
      __syncthreads();  // the previous step consumed (and k_s / v_s written, first time)
      for (int e = threadIdx.x; e < kTcBwdBQ * hp; e += blockDim.x) {
        const int r = e / hp, c = e % hp;
        const bool ok = q0 + r < p.sq && c < hn;
        q_s[e] = ok ? q_base[(q0 + r) * op.q_tok + c] : zero;
        o_s[e] = ok ? o_base[(q0 + r) * ctx_tok + c] : zero;
      }
      attn_load_row_stats(st_s, stats, dsum, row0, q0, kTcBwdBQ, p.sq);
      __syncthreads();
      if (!warp_keys) continue;
      attn_wmma_transposed_scores<T, NT>(k_s + warp * 16 * hp, q_s, hp, s_w);   // rounds: q k^T, fp32 over hn
      attn_wmma_transposed_scores<T, NT>(v_s + warp * 16 * hp, o_s, hp, dp_w);  // rounds: dctx v^T, fp32 over hn
      __syncwarp();
      for (int e = lane; e < 16 * kTcBwdBQ; e += 32) {
        const int jj = e / kTcBwdBQ, r = e % kTcBwdBQ, i = q0 + r, j = j0 + jj;
        float pr = 0.0f, ds = 0.0f;  // rows past sq, keys past sk, causally masked pairs: zero
        if (i < p.sq && j < p.sk && !(causal && j > i)) {
          const float s = attn_score_from_dot<T>(s_w[e], p, bi, h_global, i, j, fill);
          const AttnBwdPair t = attn_backward_pair<T>(s, st_s[r * 3], st_s[r * 3 + 1], dp_w[e], p, bi, h_global, i, j);
          pr = t.prob;
          ds = attn_dscore<T>(t.y, t.dprob, st_s[r * 3 + 2], attn_masked(p, bi, h_global, i, j), p);
        }
        pt_w[e] = Io<T>::store(pr);  // exact: T values (the probability after dropout, the d score)
        dst_w[e] = Io<T>::store(ds);
      }
      __syncwarp();  // P^T and dS^T complete before the warp loads them
      wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> pf, dsf;
      wmma::load_matrix_sync(pf, pt_w, kTcBwdBQ);
      wmma::load_matrix_sync(dsf, dst_w, kTcBwdBQ);
      for (int c = 0; c < NT; ++c) {
        if (c * 16 >= hp) break;  // warp-uniform
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> of, qf;
        wmma::load_matrix_sync(of, o_s + c * 16, hp);
        wmma::load_matrix_sync(qf, q_s + c * 16, hp);
        wmma::mma_sync(acc_v[c], pf, of, acc_v[c]);   // rounds: probs^T d context, fp32 over sq
        wmma::mma_sync(acc_k[c], dsf, qf, acc_k[c]);  // rounds: d scores^T q, fp32 over sq
      }
    }
    for (int c = 0; c < NT; ++c)
      for (int t = 0; t < acc_k[c].num_elements; ++t) {
        // rounds: this head's bmm ds^T q, T; its product with alpha, T; then the group's sum
        sum_k[c].x[t] += round_to<T>(p.alpha * round_to<T>(acc_k[c].x[t]));
        sum_v[c].x[t] += round_to<T>(acc_v[c].x[t]);  // rounds: this head's dv, T; the group's sum
      }
  }
  // The sums through shared memory (over k_s / v_s) into dk, then dv, stored in T.
  float* out_w = out_s + warp * 16 * hp;
  for (int which = 0; which < 2; ++which) {
    __syncthreads();  // k_s / v_s (or the previous round) consumed
    if (warp_keys)
      for (int c = 0; c < NT; ++c)
        if (c * 16 < hp)
          wmma::store_matrix_sync(out_w + c * 16, which == 0 ? sum_k[c] : sum_v[c], hp, wmma::mem_row_major);
    __syncwarp();
    T* base = (which == 0 ? dk : dv) + kv_at;
    for (int e = lane; e < 16 * hn && warp_keys; e += 32) {
      const int jj = e / hn, c = e % hn;
      if (j0 + jj < p.sk) base[(j0 + jj) * op.kv_tok + c] = Io<T>::store(out_w[jj * hp + c]);  // rounds: the GQA sum, T
    }
  }
}

inline std::size_t attention_backward_dkv_wmma_smem_bytes(DType dt, int hn) {
  const std::size_t e = dtype_size(dt);
  return e * 2 * (std::size_t(kTcBwdBK) + kTcBwdBQ) * attention_wmma_padded_head_dim(hn) +
         sizeof(float) * 3 * kTcBwdBQ + std::size_t(kTcWarps) * 16 * kTcBwdBQ * (2 * sizeof(float) + 2 * e);
}

// Launches the dk / dv kernel for bf16 / fp16 with head dims up to 128 (attention_wmma_dkv_supports).
inline void launch_attention_backward_dkv_wmma(DType dt, const AttnOperands& ops, const void* dcontext, void* dk,
                                               void* dv, const float* stats, const float* dsum, const AttnParams& p,
                                               cudaStream_t stream) {
  const dim3 grid(ceil_div(p.sk, kTcBwdBK), static_cast<unsigned>(p.np_local / ops.hpg), static_cast<unsigned>(p.b));
  auto launch = [&](auto tag, auto nt) {
    using T = decltype(tag);
    constexpr int NT = decltype(nt)::value;
    launch_kernel((dot_product_attention_backward_dkv_wmma_kernel<T, NT>), grid, dim3(32 * kTcWarps),
                  attention_backward_dkv_wmma_smem_bytes(dt, p.hn), stream, ops, static_cast<const T*>(dcontext),
                  static_cast<T*>(dk), static_cast<T*>(dv), stats, dsum, p);
  };
  auto by_head_dim = [&](auto tag) {
    if (p.hn <= 64)
      launch(tag, std::integral_constant<int, 4>{});
    else
      launch(tag, std::integral_constant<int, 8>{});
  };
  if (dt == DType::BF16)
    by_head_dim(__nv_bfloat16{});
  else
    by_head_dim(__half{});
}

}  // namespace twin::opt::TWIN_BACKEND
