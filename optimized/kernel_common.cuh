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

}  // namespace twin::opt::TWIN_BACKEND
