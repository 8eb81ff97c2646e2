/* Retro's reshuffles and bias-dropout-adds as device kernels (reference/retro/chunking.h,
 * decoder_attention.h, encoder_attention.h; megatron/core/models/retro/decoder_attention.py and
 * encoder_attention.py).
 *
 * Notation: ns sequence length, bs batch, d hidden, m = retro_chunk_length, l = ceil(ns / m),
 * k = retro_num_neighbors, r = retro_retrieved_length, N = bs * l (chunks of the batch).
 *
 * Design: every reshuffle is an index map computed on the device from the sizes alone (no host
 * map, no table upload): output row o of an [S*B] row layout takes input row retro_src_row(o), or
 * zeros when it is -1. All row and element indices are 64-bit. The maps are the reference's
 * RowMaps (chunking.cpp), so a test compares them entry for entry. The bias-dropout-adds fuse the
 * reshuffle with the arithmetic and keep the reference's rounding points and dropout streams: the
 * decoder's dropout numbers the elements of the chunked [m, N, d] tensor (the one Megatron drops
 * out), the encoder's neighbour n numbers its own [r, N, d] tensor under its own Philox offset. */
#pragma once

#include "optimized/kernel_common.cuh"
#include "core/dropout_site.h"
#include "optimized/philox.cuh"

namespace twin::opt::TWIN_BACKEND {

// The input row output row o takes, or -1 (zeros).
__host__ __device__ inline std::int64_t retro_src_row(const RetroMapArgs& a, std::int64_t o) {
  switch (a.map) {
    case RetroMap::ChunkEncoderContext: {
      // o = i * N + b * l + chunk; sequence slot t = chunk * m + i of the padded [l*m] sequence
      const std::int64_t N = a.bs * a.l, i = o / N, col = o % N, b = col / a.l, chunk = col % a.l;
      const std::int64_t t = chunk * a.m + i, first_ns = a.ns % a.m;
      std::int64_t src;
      if (first_ns == 0)
        src = t;
      else if (t < a.m)
        src = t < first_ns ? t : -1;
      else
        src = first_ns + (t - a.m);
      return src < 0 ? -1 : src * a.bs + b;
    }
    case RetroMap::PadAttendingChunks: {
      const std::int64_t N = a.bs * a.l, i = o / N, col = o % N, b = col / a.l, chunk = col % a.l;
      const std::int64_t s = a.pad + chunk * a.m + i;
      return s < a.ns ? s * a.bs + b : -1;
    }
    case RetroMap::UnchunkDecoderOutput: {
      // o = s * bs + b; s = pad + chunk * m + i takes chunked row i * N + b * l + chunk
      const std::int64_t s = o / a.bs, b = o % a.bs, t = s - a.pad;
      if (t < 0) return -1;
      const std::int64_t chunk = t / a.m, i = t % a.m;
      return chunk < a.l ? i * a.bs * a.l + b * a.l + chunk : -1;
    }
    case RetroMap::SplitNeighbors: {
      const std::int64_t t = o / a.N, j = o % a.N;
      return t * a.N * a.k + j * a.k + a.n;
    }
    case RetroMap::StackNeighbors: {
      const std::int64_t t = o / (a.k * a.N), c = o % (a.k * a.N), n = c / a.N, j = c % a.N;
      return n * a.r * a.N + t * a.N + j;
    }
  }
  return -1;
}

template <class I>
__global__ void retro_build_map_kernel(RetroMapArgs a, I* map) {
  const std::int64_t rows = a.out_rows();
  for (std::int64_t o = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; o < rows;
       o += std::int64_t(gridDim.x) * blockDim.x)
    map[o] = retro_src_row(a, o);
}

template <class T>
__global__ void retro_gather_rows_kernel(const T* x, T* out, RetroMapArgs a, std::int64_t in_rows, int d) {
  const std::int64_t n = a.out_rows() * d;
  for (std::int64_t e = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += std::int64_t(gridDim.x) * blockDim.x) {
    const std::int64_t src = retro_src_row(a, e / d);
    out[e] = src >= 0 && src < in_rows ? x[src * d + e % d] : Io<T>::store(0.0f);
  }
}

// The map itself (for tests and inspection): map [a.out_rows()] int64 on the device.
inline void retro_build_map(const RetroMapArgs& a, std::int64_t* map, cudaStream_t stream) {
  const std::int64_t rows = a.out_rows();
  require(map != nullptr, "retro_build_map: null map");
  // cost: the map written once (computed from the sizes, nothing read); ~10 integer ops per row
  // are not FLOPs.
  rt::declare_cost("retro_build_map", 8.0 * rows, 0.0);
  if (rows == 0) return;
  const unsigned threads = elementwise_threads(rows);
  launch_kernel(retro_build_map_kernel<std::int64_t>, dim3(elementwise_blocks(rows, threads)), dim3(threads), 0, stream,
                a, map);
}

// out [a.out_rows(), d] = rows of x [in_rows, d] by the map; no rounding (a copy).
inline void retro_gather_rows(DType dt, const void* x, void* out, const RetroMapArgs& a, std::int64_t in_rows, int d,
                              cudaStream_t stream) {
  require(x && out && x != out, "retro_gather_rows: null or aliased x / out");
  require(d > 0 && in_rows >= 0, "retro_gather_rows: bad shape");
  const std::int64_t n = a.out_rows() * d;
  // cost: every output element written once and, at most, one input element read for it (padding
  // rows read nothing; the model counts the output size twice, an upper bound of one copy).
  rt::declare_cost("retro_gather_rows", 2.0 * dtype_size(dt) * n, 0.0);
  if (n == 0) return;
  dispatch_dtype(dt, "retro_gather_rows", [&](auto tag) {
    using T = decltype(tag);
    const unsigned threads = elementwise_threads(n);
    launch_kernel(retro_gather_rows_kernel<T>, dim3(elementwise_blocks(n, threads)), dim3(threads), 0, stream,
                  static_cast<const T*>(x), static_cast<T*>(out), a, in_rows, d);
  });
}

template <class T>
__global__ void retro_scatter_rows_kernel(const T* dy, T* out, RetroMapArgs a, std::int64_t in_rows, int d) {
  const std::int64_t n = a.out_rows() * d;
  for (std::int64_t e = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += std::int64_t(gridDim.x) * blockDim.x) {
    const std::int64_t dst = retro_src_row(a, e / d);
    if (dst >= 0 && dst < in_rows) out[dst * d + e % d] = dy[e];
  }
}

// retro_gather_rows' transpose: out [in_rows, d] row map(o) = dy [a.out_rows(), d] row o, for every
// o the map takes a row for; the other rows of out are left as they are (the caller zeroes them
// for the gather's backward, or fills them from another map of disjoint rows). Every map takes an
// input row at most once, so no two threads write one element: no atomics, no rounding (a copy).
inline void retro_scatter_rows(DType dt, const void* dy, void* out, const RetroMapArgs& a, std::int64_t in_rows, int d,
                               cudaStream_t stream) {
  require(dy && out && dy != out, "retro_scatter_rows: null or aliased dy / out");
  require(d > 0 && in_rows >= 0, "retro_scatter_rows: bad shape");
  const std::int64_t n = a.out_rows() * d;
  // cost: every element of dy read once and at most one element of out written for it.
  rt::declare_cost("retro_scatter_rows", 2.0 * dtype_size(dt) * n, 0.0);
  if (n == 0) return;
  dispatch_dtype(dt, "retro_scatter_rows", [&](auto tag) {
    using T = decltype(tag);
    const unsigned threads = elementwise_threads(n);
    launch_kernel(retro_scatter_rows_kernel<T>, dim3(elementwise_blocks(n, threads)), dim3(threads), 0, stream,
                  static_cast<const T*>(dy), static_cast<T*>(out), a, in_rows, d);
  });
}

// RetroDecoderBiasDropoutAdd: out [ns, bs, d] = residual + unchunk(dropout(x + bias) + 0), x the
// chunked attention output [m, N, d]. Row (s, b) before pad takes residual + 0.
template <class T>
__global__ void retro_decoder_bda_kernel(const T* x, const T* bias, const T* residual, T* out, RetroMapArgs a, int d,
                                         DropoutArgs drop) {
  const std::int64_t n = a.ns * a.bs * d;
  for (std::int64_t e = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += std::int64_t(gridDim.x) * blockDim.x) {
    const std::int64_t src = retro_src_row(a, e / d), c = e % d;
    float v = 0.0f;
    if (src >= 0) {
      const std::int64_t xe = src * d + c;  // element of the chunked tensor Megatron drops out
      v = Io<T>::load(x[xe]);
      if (bias) v = round_to<T>(v + Io<T>::load(bias[c]));  // rounds: x + bias, T
      if (drop.active)
        v = philox_keep(drop.seed, drop.offset, static_cast<std::uint64_t>(xe), drop.threshold)
                ? dropout_scaled<T>(v, drop.scale)  // rounds: dropout product, T
                : 0.0f;
      v = round_to<T>(v);  // rounds: zero residual + out, T (exact)
    }
    out[e] = Io<T>::store(Io<T>::load(residual[e]) + v);  // rounds: x + residual, T
  }
}

inline void retro_decoder_bias_dropout_add(DType dt, const void* x, const void* bias, const void* residual, void* out,
                                           const RetroMapArgs& unchunk, int d, const DropoutArgs& drop,
                                           cudaStream_t stream) {
  require(unchunk.map == RetroMap::UnchunkDecoderOutput, "retro_decoder_bias_dropout_add: needs the unchunk map");
  require(x && residual && out && out != x, "retro_decoder_bias_dropout_add: null or aliased x / residual / out");
  require(unchunk.pad >= 0 && unchunk.pad < unchunk.m && unchunk.pad + unchunk.l * unchunk.m >= unchunk.ns,
          "retro_decoder_bias_dropout_add: pad " + std::to_string(unchunk.pad) + " does not fit ns " +
              std::to_string(unchunk.ns) + " with " + std::to_string(unchunk.l) + " chunks of " +
              std::to_string(unchunk.m));
  // counts: x + bias, the dropout product, + the zero residual, then + residual (as the reference).
  rounding_store(dt, (bias ? 1 : 0) + (drop.active ? 1 : 0) + 2);
  const std::int64_t n = unchunk.ns * unchunk.bs * d;
  // cost: the chunked x read once (at most n of its elements reach the output), residual read and
  // out written once, the bias once; bias add, dropout product, residual add per element.
  rt::declare_cost("retro_decoder_bias_dropout_add", double(dtype_size(dt)) * (3.0 * n + (bias ? d : 0)),
                   double(n) * ((bias ? 1 : 0) + (drop.active ? 1 : 0) + 1));
  if (n == 0) return;
  dispatch_dtype(dt, "retro_decoder_bias_dropout_add", [&](auto tag) {
    using T = decltype(tag);
    const unsigned threads = elementwise_threads(n);
    launch_kernel(retro_decoder_bda_kernel<T>, dim3(elementwise_blocks(n, threads)), dim3(threads), 0, stream,
                  static_cast<const T*>(x), static_cast<const T*>(bias), static_cast<const T*>(residual),
                  static_cast<T*>(out), unchunk, d, drop);
  });
}

// RetroEncoderBiasDropoutAdd: out [r, k*N, d] neighbour-major (column n*N + j) =
//   residual[t, j*k + n] + dropout_n(x[n, t, j] + bias)
// x: the k attention outputs one after another ([k, r, N, d]); residual: the neighbours'
// chunked_output inside the [r, N*k, d] layout. Neighbour n's dropout uses offset
// drop.offset + (n + 1) * 2^32 over its own [r, N, d] elements.
template <class T>
__global__ void retro_encoder_bda_kernel(const T* x, const T* bias, const T* residual, T* out, std::int64_t r,
                                         std::int64_t N, std::int64_t k, int d, DropoutArgs drop) {
  const std::int64_t total = r * k * N * d;
  for (std::int64_t e = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += std::int64_t(gridDim.x) * blockDim.x) {
    const std::int64_t row = e / d, c = e % d;
    const std::int64_t t = row / (k * N), col = row % (k * N), n = col / N, j = col % N;
    const std::int64_t local = (t * N + j) * d + c;  // element of neighbour n's [r, N, d]
    float v = Io<T>::load(x[n * r * N * d + local]);
    if (bias) v = round_to<T>(v + Io<T>::load(bias[c]));  // rounds: x + bias, T
    if (drop.active) {
      const std::uint64_t offset = retro_neighbour_offset(drop.offset, static_cast<std::uint64_t>(n));
      v = philox_keep(drop.seed, offset, static_cast<std::uint64_t>(local), drop.threshold)
              ? dropout_scaled<T>(v, drop.scale)  // rounds: dropout product, T
              : 0.0f;
    }
    out[e] = Io<T>::store(Io<T>::load(residual[((t * N + j) * k + n) * d + c]) + v);  // rounds: residual + out, T
  }
}

inline void retro_encoder_bias_dropout_add(DType dt, const void* x, const void* bias, const void* residual, void* out,
                                           std::int64_t r, std::int64_t N, std::int64_t k, int d,
                                           const DropoutArgs& drop, cudaStream_t stream) {
  require(x && residual && out && out != x && out != residual,
          "retro_encoder_bias_dropout_add: null or aliased x / residual / out");
  require(r > 0 && N > 0 && k > 0 && d > 0, "retro_encoder_bias_dropout_add: empty shape");
  // counts: the reference calls bias_dropout_add once per neighbour on one running count.
  rounding_store(dt, static_cast<int>(k) * ((bias ? 1 : 0) + (drop.active ? 1 : 0) + 1));
  const std::int64_t n = r * k * N * d;
  // cost: the k attention outputs and the residual read once, out written once, the bias once.
  rt::declare_cost("retro_encoder_bias_dropout_add", double(dtype_size(dt)) * (3.0 * n + (bias ? d : 0)),
                   double(n) * ((bias ? 1 : 0) + (drop.active ? 1 : 0) + 1));
  dispatch_dtype(dt, "retro_encoder_bias_dropout_add", [&](auto tag) {
    using T = decltype(tag);
    const unsigned threads = elementwise_threads(n);
    launch_kernel(retro_encoder_bda_kernel<T>, dim3(elementwise_blocks(n, threads)), dim3(threads), 0, stream,
                  static_cast<const T*>(x), static_cast<const T*>(bias), static_cast<const T*>(residual),
                  static_cast<T*>(out), r, N, k, d, drop);
  });
}

}  // namespace twin::opt::TWIN_BACKEND
