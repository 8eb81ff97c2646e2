/* Multi-latent attention's core-attention operands (reference MLASelfAttention::forward; Megatron's
 * MLASelfAttention.get_query_key_value_tensors):
 *   key   = cat(k_no_pe, k_pos_emb expanded to the np heads)   [n, np, qk + pe]
 *   value = kv[..., qk:]                                        [n, np, v]
 * and the core attention's output [n, np, v]. The attention kernels take one head dim for q, k and
 * v, so the value is zero-padded to the query's head dim q_head = qk + pe (v <= q_head: every MLA
 * config Megatron ships, DeepSeek-V3's 128 <= 192 among them): the context's first v channels of
 * each head are then p @ value exactly (each output channel is its own sum over the keys), the rest
 * zero, and the backward's d probs = d context . value adds only exact zeros (0 * 0) after the v
 * channels' terms. The padding costs the attention (q_head - v) / q_head of its p @ v work.
 *
 *   mla_key_value_forward:   key | value (padded) per head, side by side     [n, np_l, 2 q_head]
 *   mla_key_value_backward:  d kv [n, np_l, qk + v] from d key's first qk and d value's first v
 *                            channels; d k_pos_emb [n, pe] = sum over the heads of d key's last pe
 *                            (expand's backward: fp32 in head order, stored in T once)
 *   mla_context_forward:     the padded context's first v channels of each head  [n, np_l * v]
 *   mla_context_backward:    d context padded with zeros                          [n, np_l, q_head]
 * The copies are exact (no rounding point); the head sum rounds once. */
#pragma once

#include "optimized/kernel_common.cuh"

namespace twin::opt::TWIN_BACKEND {

// The shape every MLA operand kernel shares: n tokens of np (this rank's) heads.
struct MlaOperandShape {
  std::int64_t n = 0;
  int np = 0, qk = 0, pe = 0, v = 0;
  TWIN_HOST_DEVICE int q_head() const { return qk + pe; }
};

inline void mla_operands_check(const char* op, const MlaOperandShape& s) {
  require(s.n >= 0 && s.np > 0 && s.qk > 0 && s.pe > 0 && s.v > 0 && s.v <= s.q_head(),
          std::string(op) + ": bad shape (n, np, qk, pe, v) = (" + std::to_string(s.n) + ", " + std::to_string(s.np) +
              ", " + std::to_string(s.qk) + ", " + std::to_string(s.pe) + ", " + std::to_string(s.v) +
              "): v_head_dim must be at most qk_head_dim + qk_pos_emb_head_dim");
}

template <class T>
__global__ void mla_key_value_forward_kernel(const T* kv, const T* k_pos_emb, std::int64_t ld_pos, T* key_value,
                                             MlaOperandShape s) {
  const int qh = s.q_head(), w = 2 * qh;
  const std::int64_t total = s.n * s.np * w;
  for (std::int64_t e = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += std::int64_t(gridDim.x) * blockDim.x) {
    const std::int64_t row = e / w, t = row / s.np;  // row: (token, head)
    const int c = static_cast<int>(e % w);
    const T* kv_row = kv + row * (s.qk + s.v);
    T out = Io<T>::store(0.0f);
    if (c < s.qk)
      out = kv_row[c];  // k_no_pe
    else if (c < qh)
      out = k_pos_emb[t * ld_pos + (c - s.qk)];  // k_pos_emb, the same for every head
    else if (c - qh < s.v)
      out = kv_row[s.qk + (c - qh)];  // value; past v: the padding's zeros
    key_value[e] = out;
  }
}

// kv [n, np_l, qk + v] (linear_kv_up_proj's output), k_pos_emb [n, pe] rows ld_pos apart (after
// RoPE) -> key_value [n, np_l, 2 q_head].
inline void mla_key_value_forward(DType dt, const void* kv, const void* k_pos_emb, std::int64_t ld_pos, void* key_value,
                                  const MlaOperandShape& s, cudaStream_t stream) {
  mla_operands_check("mla_key_value_forward", s);
  require(kv && k_pos_emb && key_value && ld_pos >= s.pe, "mla_key_value_forward: null tensor or bad ld_pos");
  const std::int64_t total = s.n * s.np * 2 * s.q_head();
  rt::declare_cost("mla_key_value_forward", double(dtype_size(dt)) * (s.n * s.np * (s.qk + s.v) + s.n * s.pe + total),
                   0.0);
  if (total == 0) return;
  dispatch_dtype(dt, "mla_key_value_forward", [&](auto tag) {
    using T = decltype(tag);
    const unsigned threads = elementwise_threads(total);
    launch_kernel(mla_key_value_forward_kernel<T>, dim3(elementwise_blocks(total, threads)), dim3(threads), 0, stream,
                  static_cast<const T*>(kv), static_cast<const T*>(k_pos_emb), ld_pos, static_cast<T*>(key_value), s);
  });
}

// One thread per (token, channel) of [n, qk + v + pe]: d kv's channels of every head, then the head
// sum of d k_pos_emb.
template <class T>
__global__ void mla_key_value_backward_kernel(const T* d_key_value, T* d_kv, T* d_k_pos_emb, std::int64_t ld_pos,
                                              MlaOperandShape s) {
  const int qh = s.q_head(), w = 2 * qh, kvw = s.qk + s.v;
  const std::int64_t total = s.n * (kvw + s.pe);
  for (std::int64_t e = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += std::int64_t(gridDim.x) * blockDim.x) {
    const std::int64_t t = e / (kvw + s.pe);
    const int c = static_cast<int>(e % (kvw + s.pe));
    const T* d_rows = d_key_value + t * s.np * w;  // [np, 2 q_head]
    if (c < kvw) {
      const int src = c < s.qk ? c : qh + (c - s.qk);  // d key's k_no_pe, or d value
      for (int h = 0; h < s.np; ++h) d_kv[(t * s.np + h) * kvw + c] = d_rows[std::int64_t(h) * w + src];
    } else {
      const int p = c - kvw;
      float sum = 0.0f;
      for (int h = 0; h < s.np; ++h) sum += Io<T>::load(d_rows[std::int64_t(h) * w + s.qk + p]);
      d_k_pos_emb[t * ld_pos + p] = Io<T>::store(sum);  // rounds: expand's backward, the heads' sum in T
    }
  }
}

// d_key_value [n, np_l, 2 q_head] (the core attention's d key | d value) -> d_kv [n, np_l, qk + v]
// and d_k_pos_emb [n, pe] rows ld_pos apart (this rank's heads' sum).
inline void mla_key_value_backward(DType dt, const void* d_key_value, void* d_kv, void* d_k_pos_emb,
                                   std::int64_t ld_pos, const MlaOperandShape& s, cudaStream_t stream) {
  mla_operands_check("mla_key_value_backward", s);
  require(d_key_value && d_kv && d_k_pos_emb && ld_pos >= s.pe, "mla_key_value_backward: null tensor or bad ld_pos");
  // counts: d k_pos_emb, the sum over np_l heads in fp32 stored in T (d kv: copies).
  rounding_reduce(s.np);
  rounding_store(dt);
  const std::int64_t total = s.n * (s.qk + s.v + s.pe);
  rt::declare_cost("mla_key_value_backward", double(dtype_size(dt)) * (s.n * s.np * (s.qk + s.v + s.pe) + total),
                   double(s.n) * s.np * s.pe);
  if (total == 0) return;
  dispatch_dtype(dt, "mla_key_value_backward", [&](auto tag) {
    using T = decltype(tag);
    const unsigned threads = elementwise_threads(total);
    launch_kernel(mla_key_value_backward_kernel<T>, dim3(elementwise_blocks(total, threads)), dim3(threads), 0, stream,
                  static_cast<const T*>(d_key_value), static_cast<T*>(d_kv), static_cast<T*>(d_k_pos_emb), ld_pos, s);
  });
}

// dst [rows, dst_w] = src [rows, src_w] of `heads` heads: each head's first min(src_w, dst_w)
// channels, zeros past src_w.
template <class T>
__global__ void mla_head_channels_kernel(const T* src, int src_w, T* dst, int dst_w, std::int64_t rows) {
  const std::int64_t total = rows * dst_w;
  for (std::int64_t e = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += std::int64_t(gridDim.x) * blockDim.x) {
    const std::int64_t r = e / dst_w;
    const int c = static_cast<int>(e % dst_w);
    dst[e] = c < src_w ? src[r * src_w + c] : Io<T>::store(0.0f);
  }
}

inline void mla_head_channels(const char* op, DType dt, const void* src, int src_w, void* dst, int dst_w,
                              const MlaOperandShape& s, cudaStream_t stream) {
  mla_operands_check(op, s);
  require(src && dst, std::string(op) + ": null tensor");
  const std::int64_t rows = s.n * s.np;
  rt::declare_cost(op, double(dtype_size(dt)) * rows * (std::min(src_w, dst_w) + dst_w), 0.0);
  if (rows == 0) return;
  dispatch_dtype(dt, op, [&](auto tag) {
    using T = decltype(tag);
    const std::int64_t total = rows * dst_w;
    const unsigned threads = elementwise_threads(total);
    launch_kernel(mla_head_channels_kernel<T>, dim3(elementwise_blocks(total, threads)), dim3(threads), 0, stream,
                  static_cast<const T*>(src), src_w, static_cast<T*>(dst), dst_w, rows);
  });
}

// context [n, np_l, q_head] (over the padded value) -> ctx [n, np_l * v].
inline void mla_context_forward(DType dt, const void* context, void* ctx, const MlaOperandShape& s,
                                cudaStream_t stream) {
  mla_head_channels("mla_context_forward", dt, context, s.q_head(), ctx, s.v, s, stream);
}

// d ctx [n, np_l * v] -> d context [n, np_l, q_head], zero past v.
inline void mla_context_backward(DType dt, const void* d_ctx, void* d_context, const MlaOperandShape& s,
                                 cudaStream_t stream) {
  mla_head_channels("mla_context_backward", dt, d_ctx, s.v, d_context, s.q_head(), s, stream);
}

}  // namespace twin::opt::TWIN_BACKEND
