/* Permute and unpermute around one row-id map (reference/moe/token_dispatcher.h, moe_utils.py
 * permute / unpermute; the layout of TransformerEngine's permutation.cu).
 *
 * Design: the map is built ONCE per forward from the routing map: row_id_map[e * T + t] is the
 * row of the expert-major permuted tensor that token t sends to expert e, or -1. Rows are
 * expert-major and, within an expert, in token order, as Megatron's permute (and the reference)
 * orders them. Permute, the permuted probabilities and unpermute all read this one map, so the
 * combine (and a backward) use exactly the dispatch's mapping. Unpermute gathers per token: for
 * token t it adds its experts' rows in expert order, each sum stored in T, which is the order and
 * rounding of Megatron's scatter_add_ over the expert-major rows; no atomics, so the result does
 * not depend on scheduling. All index arithmetic is 64-bit (permute_index below): T x top-k rows
 * and rows x hidden elements pass 2^31 at production sizes. At one expert-parallel rank the
 * allgather and alltoall dispatchers permute identically (the chunk sort by local expert is the
 * identity there). */
#pragma once

#include "optimized/kernel_common.cuh"

namespace twin::opt::TWIN_BACKEND {

// The index arithmetic of the permutation, 64-bit throughout; host-callable so a test can check
// it at sizes that cannot be allocated.
struct PermuteIndex {
  // Slot of (expert e, token t) in row_id_map [E, T].
  __host__ __device__ static std::int64_t map_slot(std::int64_t e, std::int64_t t, std::int64_t tokens) {
    return e * tokens + t;
  }
  // Element (row, col) of a row-major [rows, hidden] tensor.
  __host__ __device__ static std::int64_t element(std::int64_t row, std::int64_t hidden, std::int64_t col) {
    return row * hidden + col;
  }
  // The permuted row of the j-th token (in token order) routed to expert e, given the exclusive
  // prefix sum of tokens per expert.
  __host__ __device__ static std::int64_t row(const std::int64_t* expert_offsets, std::int64_t e, std::int64_t j) {
    return expert_offsets[e] + j;
  }
};

// One block. routing_map [T, E] (0/1). Out: tokens_per_expert [E], expert_offsets [E + 1]
// (exclusive prefix sum; offsets[E] = N rows), row_id_map [E, T].
static __global__ void build_row_id_map_kernel(const std::uint8_t* routing_map, std::int64_t T, int E,
                                               std::int64_t* tokens_per_expert, std::int64_t* expert_offsets,
                                               std::int64_t* row_id_map) {
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    std::int64_t n = 0;
    for (std::int64_t t = 0; t < T; ++t) n += routing_map[PermuteIndex::element(t, E, e)];
    tokens_per_expert[e] = n;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    std::int64_t s = 0;
    for (int e = 0; e < E; ++e) {
      expert_offsets[e] = s;
      s += tokens_per_expert[e];
    }
    expert_offsets[E] = s;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    std::int64_t j = 0;
    for (std::int64_t t = 0; t < T; ++t) {
      const bool routed = routing_map[PermuteIndex::element(t, E, e)] != 0;
      row_id_map[PermuteIndex::map_slot(e, t, T)] = routed ? PermuteIndex::row(expert_offsets, e, j++) : -1;
    }
  }
}

// One block per token (grid-stride), threads over hidden. tokens [T, h] -> permuted [N, h];
// probs [T, E] (router dtype R) -> permuted_probs [N] when given.
template <class T, class R>
__global__ void permute_kernel(const T* tokens, const std::int64_t* row_id_map, const R* probs, T* permuted,
                               R* permuted_probs, std::int64_t num_tokens, int E, std::int64_t hidden) {
  for (std::int64_t t = blockIdx.x; t < num_tokens; t += gridDim.x)
    for (int e = 0; e < E; ++e) {
      const std::int64_t row = row_id_map[PermuteIndex::map_slot(e, t, num_tokens)];
      if (row < 0) continue;
      for (std::int64_t c = threadIdx.x; c < hidden; c += blockDim.x)
        permuted[PermuteIndex::element(row, hidden, c)] = tokens[PermuteIndex::element(t, hidden, c)];
      if (probs && threadIdx.x == 0) permuted_probs[row] = probs[PermuteIndex::element(t, E, e)];
    }
}

// One block per token: out[t] = sum over its experts e (ascending) of permuted[row(e, t)], each
// partial sum stored in T; a token routed nowhere gets zeros.
template <class T>
__global__ void unpermute_kernel(const T* permuted, const std::int64_t* row_id_map, T* out, std::int64_t num_tokens,
                                 int E, std::int64_t hidden) {
  for (std::int64_t t = blockIdx.x; t < num_tokens; t += gridDim.x)
    for (std::int64_t c = threadIdx.x; c < hidden; c += blockDim.x) {
      float acc = 0.0f;
      for (int e = 0; e < E; ++e) {
        const std::int64_t row = row_id_map[PermuteIndex::map_slot(e, t, num_tokens)];
        if (row >= 0)
          acc = round_to<T>(acc + Io<T>::load(permuted[PermuteIndex::element(row, hidden, c)]));  // rounds: T
      }
      out[PermuteIndex::element(t, hidden, c)] = Io<T>::store(acc);
    }
}

// ---- launchers

inline void build_row_id_map(const std::uint8_t* routing_map, std::int64_t T, int E, std::int64_t* tokens_per_expert,
                             std::int64_t* expert_offsets, std::int64_t* row_id_map, cudaStream_t stream) {
  require(T >= 0 && E > 0, "build_row_id_map: bad shape [" + std::to_string(T) + ", " + std::to_string(E) + "]");
  require(routing_map && tokens_per_expert && expert_offsets && (row_id_map || T == 0),
          "build_row_id_map: null buffer");
  // cost: the routing map [T, E] read once, the row-id map [E, T] written, the counts and offsets.
  rt::declare_cost("build_row_id_map", double(T) * E * (1 + 8) + 8.0 * (2 * E + 1), 0.0);
  launch_kernel(build_row_id_map_kernel, dim3(1), dim3(std::min(1024u, ceil_div(E, 32) * 32)), 0, stream, routing_map,
                T, E, tokens_per_expert, expert_offsets, row_id_map);
}

inline unsigned row_threads(std::int64_t hidden) {
  return static_cast<unsigned>(std::min<std::int64_t>(256, std::max<std::int64_t>(32, (hidden + 31) / 32 * 32)));
}

// dt: the tokens' dtype; rdt: the probabilities' (router) dtype. routed_rows: the permuted rows N
// at most (T * topk, or E * capacity when padded), for the cost model only: the exact N is known on
// the device, and a phase captured as a graph cannot wait for it.
inline void permute_forward(DType dt, DType rdt, const void* tokens, const std::int64_t* row_id_map, const void* probs,
                            void* permuted, void* permuted_probs, std::int64_t T, int E, std::int64_t hidden,
                            std::int64_t routed_rows, cudaStream_t stream) {
  require(hidden > 0 && E > 0 && T >= 0, "permute_forward: bad shape");
  require(!probs || permuted_probs, "permute_forward: probs without an output for them");
  // cost: the row-id map read, each token read once and written to its N rows, a probability per
  // row read and written; no arithmetic.
  rt::declare_cost("permute_forward",
                   8.0 * E * T + double(dtype_size(dt)) * hidden * (T + routed_rows) +
                       (probs ? 2.0 * routed_rows * (rdt == DType::F64 ? 8 : dtype_size(rdt)) : 0.0),
                   0.0);
  if (T == 0) return;
  dispatch_dtype(dt, "permute_forward", [&](auto a) {
    using TT = decltype(a);
    auto run = [&](auto b) {
      using R = decltype(b);
      launch_kernel(permute_kernel<TT, R>, dim3(static_cast<unsigned>(std::min<std::int64_t>(T, 65535))),
                    dim3(row_threads(hidden)), 0, stream, static_cast<const TT*>(tokens), row_id_map,
                    static_cast<const R*>(probs), static_cast<TT*>(permuted), static_cast<R*>(permuted_probs), T, E,
                    hidden);
    };
    if (rdt == DType::F64)
      run(double{});
    else
      dispatch_dtype(rdt, "permute_forward", run);
  });
}

// routed_rows: the permuted rows at most, for the cost model (see permute_forward).
inline void unpermute_forward(DType dt, const void* permuted, const std::int64_t* row_id_map, void* out, std::int64_t T,
                              int E, std::int64_t hidden, std::int64_t routed_rows, cudaStream_t stream) {
  require(hidden > 0 && E > 0 && T >= 0, "unpermute_forward: bad shape");
  require(permuted != out, "unpermute_forward: in and out alias");
  // cost: the row-id map and the N expert rows read once, [T, h] written; one add per row element.
  rt::declare_cost("unpermute_forward", 8.0 * E * T + double(dtype_size(dt)) * hidden * (routed_rows + T),
                   double(routed_rows) * hidden);
  if (T == 0) return;
  dispatch_dtype(dt, "unpermute_forward", [&](auto a) {
    using TT = decltype(a);
    launch_kernel(unpermute_kernel<TT>, dim3(static_cast<unsigned>(std::min<std::int64_t>(T, 65535))),
                  dim3(row_threads(hidden)), 0, stream, static_cast<const TT*>(permuted), row_id_map,
                  static_cast<TT*>(out), T, E, hidden);
  });
}

// ---- backward: the permute's backward is unpermute_forward of the rows' gradients (each token's
// rows added in expert order, as torch's index_add over the expert-major rows), the unpermute's is
// permute_forward of the tokens' gradients (each row takes its token's); the permuted
// probabilities' gradient goes back to its (token, expert) entry here.

// One thread per (token, expert): dprobs[t, e] = d_permuted_probs[row(e, t)], 0 where not routed.
template <class R>
__global__ void permute_probs_backward_kernel(const R* d_permuted_probs, const std::int64_t* row_id_map, R* dprobs,
                                              std::int64_t num_tokens, int E) {
  const std::int64_t n = num_tokens * E;
  for (std::int64_t i = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += std::int64_t(gridDim.x) * blockDim.x) {
    const std::int64_t t = i / E, e = i % E;
    const std::int64_t row = row_id_map[PermuteIndex::map_slot(e, t, num_tokens)];
    dprobs[i] = row >= 0 ? d_permuted_probs[row] : Io<R>::store(0);
  }
}

// d probs [T, E] (router dtype rdt) from the permuted probabilities' gradient [N]. No rounding.
inline void permute_probs_backward(DType rdt, const void* d_permuted_probs, const std::int64_t* row_id_map,
                                   void* dprobs, std::int64_t T, int E, cudaStream_t stream) {
  require(E > 0 && T >= 0 && dprobs && row_id_map, "permute_probs_backward: bad shape or null buffer");
  const double rs = rdt == DType::F64 ? 8.0 : double(dtype_size(rdt));
  // cost: the row-id map read, [T, E] written, at most one gathered probability per entry.
  rt::declare_cost("permute_probs_backward", double(T) * E * (8.0 + 2.0 * rs), 0.0);
  if (T == 0) return;
  auto run = [&](auto tag) {
    using R = decltype(tag);
    const unsigned threads = elementwise_threads(T * E);
    launch_kernel(permute_probs_backward_kernel<R>, dim3(elementwise_blocks(T * E, threads)), dim3(threads), 0, stream,
                  static_cast<const R*>(d_permuted_probs), row_id_map, static_cast<R*>(dprobs), T, E);
  };
  if (rdt == DType::F64)
    run(double{});
  else
    dispatch_dtype(rdt, "permute_probs_backward", run);
}

}  // namespace twin::opt::TWIN_BACKEND
