/* Shared pieces of the optimized kernels (compiled by nvcc for the GPU and by the host compiler
 * for the simulator; see include/cuda_compat.h).
 *
 * Design: every kernel computes in fp32 and stores in the tensor's dtype T (float, __nv_bfloat16,
 * __half) with one round-to-nearest-even store, at exactly the points where Megatron's tensor is
 * stored in that dtype (reference/precision.h names them). Reductions are warp shuffles, then one
 * shared-memory step across warps: a fixed tree for a given block size, so two runs give the same
 * bits. Launchers take a runtime DType and dispatch to the templated kernel; their preconditions
 * throw std::invalid_argument naming the op and the offending sizes. */
#pragma once

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "core/dtype.h"
#include "core/rounding.h"
#include "cuda_compat.h"
#include "optimized/layer/kernel_args.h"  // the launchers' argument types, shared by both backends
#include "optimized/runtime/cost_model.h"

namespace twin::opt::TWIN_BACKEND {

// fp32 <-> storage dtype; store() rounds to nearest even (the toolkit's conversions do).
template <class T>
struct Io;
template <>
struct Io<float> {
  __host__ __device__ static float load(float x) { return x; }
  __host__ __device__ static float store(float x) { return x; }
};
template <>
struct Io<__nv_bfloat16> {
  __host__ __device__ static float load(__nv_bfloat16 x) { return __bfloat162float(x); }
  __host__ __device__ static __nv_bfloat16 store(float x) { return __float2bfloat16(x); }
};
template <>
struct Io<__half> {
  __host__ __device__ static float load(__half x) { return __half2float(x); }
  __host__ __device__ static __half store(float x) { return __float2half(x); }
};
// fp64: the router dtype moe_router_dtype="fp64" (its values pass through unrounded).
template <>
struct Io<double> {
  __host__ __device__ static double load(double x) { return x; }
  __host__ __device__ static double store(double x) { return x; }
};
// Rounds an fp32 value to T and back: "stored in T" in the middle of a fused computation.
template <class T>
__host__ __device__ inline float round_to(float x) {
  return Io<T>::load(Io<T>::store(x));
}

// Sum over the 32 lanes of a warp (all lanes get the result; butterfly order is fixed).
__device__ inline float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ inline float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
// `scratch` is 32 floats of shared memory; the call ends with a barrier, so it can be reused.
__device__ inline float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
  v = warp_sum(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float t = lane < nwarps ? scratch[lane] : 0.0f;
  t = warp_sum(t);
  __syncthreads();
  return t;
}

// Host-side precondition check of a launcher.
inline void require(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument(what);
}

// Calls f(T{}) with T the storage type of dt (F32, BF16, F16); other dtypes are an error.
template <class F>
void dispatch_dtype(DType dt, const char* op, F&& f) {
  switch (dt) {
    case DType::F32:
      f(float{});
      return;
    case DType::BF16:
      f(__nv_bfloat16{});
      return;
    case DType::F16:
      f(__half{});
      return;
    default:
      throw std::invalid_argument(std::string(op) + ": dtype " + dtype_name(dt) + " is not supported (F32, BF16, F16)");
  }
}

inline unsigned ceil_div(std::int64_t a, std::int64_t b) { return static_cast<unsigned>((a + b - 1) / b); }

// Threads per block of an element-wise kernel over n elements: 256, or fewer (a multiple of 32)
// when n is small, so no block is mostly idle (and the simulator makes no idle fibers).
inline unsigned elementwise_threads(std::int64_t n) {
  return static_cast<unsigned>(std::min<std::int64_t>(256, std::max<std::int64_t>(32, (n + 31) / 32 * 32)));
}
// Grid of a grid-stride element-wise kernel.
inline unsigned elementwise_blocks(std::int64_t n, unsigned threads) {
  return static_cast<unsigned>(std::min<std::int64_t>(ceil_div(n, threads), 65535));
}

// ---- Deterministic column sums: parameter gradients reduced over the rows ----------------------
// out_v[c] = sum over rows r of f(r, c)[v] for every column c < width and each of NV values v
// (a norm's dgamma and dbeta, a bias's grad), accumulated in fp32 in an order fixed by the shapes
// alone, then stored once in T. Stage 1: a block of kColSumCols columns x kColSumRowLanes row
// lanes takes a chunk of kColSumChunkRows rows (lane l adds rows l, l + lanes, ...; a warp reads
// 32 consecutive columns of one row, coalesced), adds its lanes' sums in lane order in shared
// memory and writes one fp32 partial per (value, chunk, column) to `partials` [NV, chunks, width].
// Stage 2: one thread per column adds the chunks in order. No atomics: two runs are bitwise equal,
// and the sum is one fp32 reduction of length n_rows in a fixed tree.
constexpr int kColSumCols = 32, kColSumRowLanes = 8, kColSumChunkRows = 256;

inline std::int64_t column_sum_chunks(std::int64_t n_rows) {
  return std::max<std::int64_t>(1, (n_rows + kColSumChunkRows - 1) / kColSumChunkRows);
}
// fp32 partials column_sums needs for NV sums of `width` columns over n_rows rows.
inline std::size_t column_sum_workspace_bytes(int nv, std::int64_t n_rows, int width) {
  return sizeof(float) * std::size_t(nv) * std::size_t(column_sum_chunks(n_rows)) * std::size_t(width);
}

// F: a copyable functor with `__device__ void operator()(std::int64_t r, int c, float* v) const`
// writing its NV values for element (r, c).
template <int NV, class F>
__global__ void column_partial_sum_kernel(F f, std::int64_t n_rows, int width, float* partials) {
  __shared__ float lanes[NV][kColSumRowLanes][kColSumCols];
  const int tx = threadIdx.x % kColSumCols, ty = threadIdx.x / kColSumCols;
  const int c = blockIdx.x * kColSumCols + tx;
  const std::int64_t r0 = std::int64_t(blockIdx.y) * kColSumChunkRows;
  const std::int64_t r1 = r0 + kColSumChunkRows < n_rows ? r0 + kColSumChunkRows : n_rows;
  float s[NV];
  for (int v = 0; v < NV; ++v) s[v] = 0.0f;
  if (c < width)
    for (std::int64_t r = r0 + ty; r < r1; r += kColSumRowLanes) {
      float t[NV];
      f(r, c, t);
      for (int v = 0; v < NV; ++v) s[v] += t[v];
    }
  for (int v = 0; v < NV; ++v) lanes[v][ty][tx] = s[v];
  __syncthreads();
  if (ty == 0 && c < width) {
    const std::int64_t chunks = gridDim.y;
    for (int v = 0; v < NV; ++v) {
      float t = 0.0f;
      for (int l = 0; l < kColSumRowLanes; ++l) t += lanes[v][l][tx];
      partials[(v * chunks + blockIdx.y) * width + c] = t;
    }
  }
}

// out[c] = sum over chunks k of partials[k, c], stored once in T.
template <class T>
__global__ void column_sum_finish_kernel(const float* partials, std::int64_t chunks, int width, T* out) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= width) return;
  float s = 0.0f;
  for (std::int64_t k = 0; k < chunks; ++k) s += partials[k * width + c];
  out[c] = Io<T>::store(s);  // rounds: the row reduction, T
}

// The terms of a plain column sum (a bias grad): the elements of a row-major matrix [n_rows, ld].
template <class T>
struct MatrixTerms {
  const T* m;
  std::int64_t ld;
  __device__ void operator()(std::int64_t r, int c, float* v) const { v[0] = Io<T>::load(m[r * ld + c]); }
};

// Launches both stages; outs[v] ([width] in T) may be null to skip storing value v. `op` names the
// caller in errors and in the cost declarations ("<op>_partial", "<op>_finish"); bytes_per_row is
// what f reads per element (the caller knows its operands), flops_per_element likewise.
template <class T, int NV, class F>
void column_sums(const char* op, const F& f, std::int64_t n_rows, int width, T* const (&outs)[NV], void* workspace,
                 std::size_t workspace_bytes, double bytes_per_element, double flops_per_element, cudaStream_t stream) {
  const std::int64_t chunks = column_sum_chunks(n_rows);
  require(chunks <= 65535, std::string(op) + ": " + std::to_string(n_rows) + " rows exceed the column sum's grid (" +
                               std::to_string(65535LL * kColSumChunkRows) + " rows)");
  require(workspace != nullptr && workspace_bytes >= column_sum_workspace_bytes(NV, n_rows, width),
          std::string(op) + ": workspace of " + std::to_string(workspace_bytes) +
              " bytes is null or smaller than the " + std::to_string(column_sum_workspace_bytes(NV, n_rows, width)) +
              " bytes needed");
  float* partials = static_cast<float*>(workspace);
  const double partial_bytes = 4.0 * NV * chunks * width;
  rt::declare_cost((std::string(op) + "_partial").c_str(), bytes_per_element * n_rows * width + partial_bytes,
                   (flops_per_element + NV) * n_rows * width);
  launch_kernel(column_partial_sum_kernel<NV, F>, dim3(ceil_div(width, kColSumCols), unsigned(chunks)),
                dim3(kColSumCols * kColSumRowLanes), 0, stream, f, n_rows, width, partials);
  for (int v = 0; v < NV; ++v) {
    if (!outs[v]) continue;
    rt::declare_cost((std::string(op) + "_finish").c_str(), 4.0 * chunks * width + sizeof(T) * double(width),
                     double(chunks) * width);
    const unsigned threads = elementwise_threads(width);
    launch_kernel(column_sum_finish_kernel<T>, dim3(ceil_div(width, threads)), dim3(threads), 0, stream,
                  partials + std::int64_t(v) * chunks * width, chunks, width, outs[v]);
  }
}

}  // namespace twin::opt::TWIN_BACKEND
