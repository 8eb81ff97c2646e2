// rmsnorm_bench.cuh: the RMSNorm kernel the simulator benchmark times (one row per block, fp32
// statistics, warp shuffles + one shared-memory step, bf16 in/out); the workload of a typical
// simulated launch: 256 x 1024 bf16 with 256 threads per block is 65536 fibers and 3 barriers.
#pragma once

#include "cuda_compat.h"

namespace bench {

// y[r, :] = x[r, :] * rsqrt(mean(x[r, :]^2) + eps) * weight
__global__ void rmsnorm_forward_kernel(const __nv_bfloat16* x, const __nv_bfloat16* weight, __nv_bfloat16* y,
                                       int hidden, float eps) {
  __shared__ float warp_sums[32];
  __shared__ float rstd;
  const __nv_bfloat16* xr = x + static_cast<long>(blockIdx.x) * hidden;  // [hidden]
  __nv_bfloat16* yr = y + static_cast<long>(blockIdx.x) * hidden;        // [hidden]
  float ss = 0.0f;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    const float v = __bfloat162float(xr[i]);
    ss += v * v;
  }
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = ss;
  __syncthreads();
  if (threadIdx.x < 32) {
    float t = threadIdx.x < blockDim.x / 32 ? warp_sums[threadIdx.x] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
    if (threadIdx.x == 0) rstd = rsqrtf(t / hidden + eps);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < hidden; i += blockDim.x)
    yr[i] = __float2bfloat16(__bfloat162float(xr[i]) * rstd * __bfloat162float(weight[i]));
}

}  // namespace bench
