// negative_kernels.cuh: kernels with synchronization bugs the simulator must report (or, for the
// missing barrier, expose as a wrong result in some resume order). A `// @name` marker ends the
// line of the operation a report must name; the test finds that line in this file (source_file()).
// They compile with nvcc too, but are only run in the simulator: on a GPU they hang or are
// undefined.
#pragma once

#include "cuda_compat.h"

namespace negative {

inline const char* source_file() { return __FILE__; }

// Thread 5 returns; the others wait at the barrier for it.
__global__ void early_return_forward_kernel(float* out) {
  __shared__ float s[64];
  if (threadIdx.x == 5) return;
  s[threadIdx.x] = 1.0f;
  __syncthreads();  // @early_return
  out[threadIdx.x] = s[(threadIdx.x + 1) % blockDim.x];
}

// The first warp waits at one barrier, the others at another.
__global__ void split_barrier_forward_kernel(float* out) {
  if (threadIdx.x < 32) {
    __syncthreads();  // @split_a
  } else {
    __syncthreads();  // @split_b
  }
  out[threadIdx.x] = 1.0f;
}

// Lane 7 skips the shuffle its warp-mates wait in (its mask names lane 7).
__global__ void shuffle_missing_lane_forward_kernel(int* out) {
  int v = static_cast<int>(threadIdx.x);
  if (threadIdx.x % 32 != 7) {
    v = __shfl_xor_sync(0xffffffffu, v, 1);  // @missing_lane
  }
  out[threadIdx.x] = v;
}

// Launched with 16 threads (a partial warp): lane 8 reads lane 16, which does not exist.
__global__ void partial_warp_shuffle_forward_kernel(int* out) {
  int v = static_cast<int>(threadIdx.x);
  v = __shfl_down_sync(0x0000ffffu, v, 8);  // @partial_warp
  out[threadIdx.x] = v;
}

// Launched with 16 threads: a full-warp mask names lanes 16..31, which do not exist.
__global__ void partial_warp_full_mask_forward_kernel(int* out) {
  int v = static_cast<int>(threadIdx.x);
  v = __shfl_xor_sync(0xffffffffu, v, 1);  // @full_mask
  out[threadIdx.x] = v;
}

// Every lane passes mask 0x1, which names only lane 0.
__global__ void caller_not_in_mask_forward_kernel(int* out) {
  int v = static_cast<int>(threadIdx.x);
  v = __shfl_sync(0x1u, v, 0);  // @not_in_mask
  out[threadIdx.x] = v;
}

// A shuffle with a width that is not a power of two in [1, 32] (CUDA leaves it undefined).
__global__ void shuffle_bad_width_forward_kernel(int* out, int width) {
  int v = static_cast<int>(threadIdx.x);
  v = __shfl_sync(0xffffffffu, v, 0, width);  // @bad_width
  out[threadIdx.x] = v;
}

// Launched with 32 threads: lanes 0..15 shuffle under mask 0xffff, so lane 8 reads lane 16, which
// exists but is not in the mask (undefined on a GPU); lanes 16..31 do not take part.
__global__ void shuffle_source_outside_mask_forward_kernel(int* out) {
  int v = static_cast<int>(threadIdx.x);
  if (threadIdx.x < 16) {
    v = __shfl_down_sync(0x0000ffffu, v, 8);  // @outside_mask
  }
  out[threadIdx.x] = v;
}

// Missing barrier: each thread reads its neighbour's shared value without waiting for it.
// With `sync` true the barrier is there and the result is right in every order.
__global__ void neighbour_forward_kernel(const float* in, float* out, bool sync) {
  DYNAMIC_SHARED(float, s);
  const int t = threadIdx.x;
  s[t] = in[t];
  if (sync) __syncthreads();
  out[t] = s[(t + 1) % blockDim.x];
}

// Throws from kernel code (simulator only): the launch reports it with kernel, block, thread.
__global__ void throwing_forward_kernel(int* out) {
  out[threadIdx.x] = 1;
#if TWIN_SIM
  if (blockIdx.x == 1 && threadIdx.x == 3) throw std::runtime_error("bad value");
#endif
}

}  // namespace negative
