/* Rotary position embedding forward (reference/rotary_pos_embedding.h; Megatron's rope_utils.py
 * _apply_rotary_pos_emb_bshd, the unfused path): t = t * cos(f) + rotate_half(t) * sin(f) over the
 * first rot_dim channels of each head; halves ([x1 | x2] -> [-x2 | x1]) or interleaved pairs
 * ((x0, x1) -> (-x1, x0)); channels past rot_dim (rotary_percent < 1) pass through.
 *
 * Design: in place on the q and k heads inside the fused linear_qkv output (addressed like
 * NormRows), one thread per rotated PAIR of channels, so each thread reads both inputs of its two
 * outputs before writing them and the in-place update needs no barrier. cos/sin are computed from
 * the fp32 angles in fp32 and stored in T, and each product and the sum are stored in T, as
 * torch's unfused ops do.
 *
 * Backward (reference apply_rotary_pos_emb_backward): dt = dout cos + rotate_half^T(dout sin),
 * rotate_half^T sending (y0, y1) of a pair back as (y1, -y0): for the pair (c0, c1)
 * dt[c0] = dout[c0] cos[c0] + dout[c1] sin[c1], dt[c1] = dout[c1] cos[c1] - dout[c0] sin[c0],
 * each product (mul's grad) and the sum stored in T; in place, one thread per pair, as the
 * forward; channels past rot_dim pass dout through (untouched in place). */
#pragma once

#include "torch_norm.cuh"  // NormRows

namespace twin::opt::TWIN_BACKEND {

// Element e of the pairs: row r = e / (rot_dim / 2) of the heads addressed by `rows` (width = head
// dim), its pair of channels (c0, c1) (interleaved: adjacent; else half apart) and the forward's
// cos_ / sin_ of each, from freqs [s, rot_dim] fp32 angles at position r / rows_per_position.
template <class T>
struct RopePair {
  T* row;  // [hn]
  int c0, c1;
  float cos0, sin0, cos1, sin1;
};
template <class T>
__device__ inline RopePair<T> rope_pair(T* t, const float* freqs, const NormRows& rows, std::int64_t rows_per_position,
                                        int rot_dim, bool interleaved, std::int64_t e) {
  const int half = rot_dim / 2;
  const std::int64_t r = e / half;
  const int i = static_cast<int>(e % half);
  const float* f = freqs + (r / rows_per_position) * rot_dim;  // [rot_dim]
  RopePair<T> p;
  p.row = t + rows.offset(r);
  p.c0 = interleaved ? 2 * i : i;
  p.c1 = interleaved ? 2 * i + 1 : i + half;
  p.cos0 = round_to<T>(cosf(f[p.c0]));  // rounds: cos/sin .to(t.dtype)
  p.sin0 = round_to<T>(sinf(f[p.c0]));
  p.cos1 = round_to<T>(cosf(f[p.c1]));
  p.sin1 = round_to<T>(sinf(f[p.c1]));
  return p;
}

template <class T>
__global__ void rotary_pos_emb_forward_kernel(T* t, const float* freqs, NormRows rows, std::int64_t rows_per_position,
                                              int rot_dim, bool interleaved) {
  const std::int64_t total = rows.n_rows * (rot_dim / 2);
  for (std::int64_t e = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += std::int64_t(gridDim.x) * blockDim.x) {
    const RopePair<T> q = rope_pair(t, freqs, rows, rows_per_position, rot_dim, interleaved, e);
    T* row = q.row;
    const int c0 = q.c0, c1 = q.c1;
    const float x0 = Io<T>::load(row[c0]), x1 = Io<T>::load(row[c1]);
    const float cos0 = q.cos0, sin0 = q.sin0, cos1 = q.cos1, sin1 = q.sin1;
    // rotate_half(t)[c0] = -x1, rotate_half(t)[c1] = x0
    const float y0 = round_to<T>(x0 * cos0) + round_to<T>(-x1 * sin0);  // rounds: t * cos_, rotate_half(t) * sin_
    const float y1 = round_to<T>(x1 * cos1) + round_to<T>(x0 * sin1);
    row[c0] = Io<T>::store(y0);  // rounds: sum, T
    row[c1] = Io<T>::store(y1);
  }
}

inline void rotary_pos_emb_forward(DType dt, void* t, const float* freqs, const NormRows& rows,
                                   std::int64_t rows_per_position, int rot_dim, bool interleaved, cudaStream_t stream) {
  require(rot_dim > 0 && rot_dim % 2 == 0 && rot_dim <= rows.width,
          "rotary_pos_emb_forward: rot_dim " + std::to_string(rot_dim) +
              " must be even, > 0 and at most the head dim " + std::to_string(rows.width));
  require(rows_per_position > 0, "rotary_pos_emb_forward: rows_per_position must be > 0");
  // counts: t * cos_, rotate_half(t) * sin_, the sum. q and k are rotated by two calls on parallel
  // branches: the layer forks and joins around them.
  rounding_store(dt, 3);
  // cost: the rotated channels read and written in place, the fp32 angles of each position once
  // (cos and sin computed on chip); 3 FLOPs per rotated element.
  rt::declare_cost("rotary_pos_emb_forward",
                   double(dtype_size(dt)) * 2.0 * rows.n_rows * rot_dim +
                       4.0 * (double(rows.n_rows) / rows_per_position) * (rot_dim / 2),
                   3.0 * rows.n_rows * rot_dim);
  require(t && freqs, "rotary_pos_emb_forward: null tensor");
  if (rows.n_rows == 0) return;
  dispatch_dtype(dt, "rotary_pos_emb_forward", [&](auto tag) {
    using T = decltype(tag);
    const std::int64_t total = rows.n_rows * (rot_dim / 2);
    const unsigned threads = elementwise_threads(total);
    launch_kernel(rotary_pos_emb_forward_kernel<T>, dim3(elementwise_blocks(total, threads)), dim3(threads), 0, stream,
                  static_cast<T*>(t), freqs, rows, rows_per_position, rot_dim, interleaved);
  });
}

// ---- backward -----------------------------------------------------------------------------------
// dt: the heads' gradient addressed by `rows`, in place (dout in, dt out).
template <class T>
__global__ void rotary_pos_emb_backward_kernel(T* dt, const float* freqs, NormRows rows, std::int64_t rows_per_position,
                                               int rot_dim, bool interleaved) {
  const std::int64_t total = rows.n_rows * (rot_dim / 2);
  for (std::int64_t e = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += std::int64_t(gridDim.x) * blockDim.x) {
    const RopePair<T> q = rope_pair(dt, freqs, rows, rows_per_position, rot_dim, interleaved, e);
    T* row = q.row;
    const int c0 = q.c0, c1 = q.c1;
    const float g0 = Io<T>::load(row[c0]), g1 = Io<T>::load(row[c1]);
    const float cos0 = q.cos0, sin0 = q.sin0, cos1 = q.cos1, sin1 = q.sin1;
    const float d0 = round_to<T>(g0 * cos0) + round_to<T>(g1 * sin1);  // rounds: mul's grads of t and rotate_half(t)
    const float d1 = round_to<T>(g1 * cos1) - round_to<T>(g0 * sin0);
    row[c0] = Io<T>::store(d0);  // rounds: the grads' sum, T
    row[c1] = Io<T>::store(d1);
  }
}

// In place on the gradient of the rotated heads (layout and freqs as rotary_pos_emb_forward took them).
inline void rotary_pos_emb_backward(DType dt, void* dout, const float* freqs, const NormRows& rows,
                                    std::int64_t rows_per_position, int rot_dim, bool interleaved,
                                    cudaStream_t stream) {
  require(rot_dim > 0 && rot_dim % 2 == 0 && rot_dim <= rows.width,
          "rotary_pos_emb_backward: rot_dim " + std::to_string(rot_dim) +
              " must be even, > 0 and at most the head dim " + std::to_string(rows.width));
  require(rows_per_position > 0, "rotary_pos_emb_backward: rows_per_position must be > 0");
  require(rows.n_rows >= 0 && rows.rows_per_chunk > 0, "rotary_pos_emb_backward: bad row layout");
  // counts: as the reference's backward: the mul's grads, then their sum, each stored in T.
  rounding_store(dt, 2);
  // cost: as the forward: the rotated channels read and written, the angles once; 3 FLOPs each.
  rt::declare_cost("rotary_pos_emb_backward",
                   double(dtype_size(dt)) * 2.0 * rows.n_rows * rot_dim +
                       4.0 * (double(rows.n_rows) / rows_per_position) * (rot_dim / 2),
                   3.0 * rows.n_rows * rot_dim);
  require(dout && freqs, "rotary_pos_emb_backward: null tensor");
  if (rows.n_rows == 0) return;
  dispatch_dtype(dt, "rotary_pos_emb_backward", [&](auto tag) {
    using T = decltype(tag);
    const std::int64_t total = rows.n_rows * (rot_dim / 2);
    const unsigned threads = elementwise_threads(total);
    launch_kernel(rotary_pos_emb_backward_kernel<T>, dim3(elementwise_blocks(total, threads)), dim3(threads), 0, stream,
                  static_cast<T*>(dout), freqs, rows, rows_per_position, rot_dim, interleaved);
  });
}

}  // namespace twin::opt::TWIN_BACKEND
