// semantics_kernels.cuh: small kernels exercising CUDA semantics the simulator must reproduce
// (shuffles with widths, votes, atomics across blocks, static/dynamic shared memory, a block
// reduction, bf16 arithmetic). Compiled by the host compiler for the simulator tests and by nvcc
// (sm_90) for the GPU tests; the expected values are computed on the host by the tests.
#pragma once

#include "cuda_compat.h"

namespace semantics {

enum ShuffleKind : int { kShfl = 0, kShflUp = 1, kShflDown = 2, kShflXor = 3 };

// out[t] = the value thread t receives from a shuffle of in[] across its warp.
template <class T>
__global__ void shuffle_forward_kernel(const T* in, T* out, int kind, int arg, int width) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  T v = in[t];
  T r;
  if (kind == kShfl)
    r = __shfl_sync(0xffffffffu, v, arg, width);
  else if (kind == kShflUp)
    r = __shfl_up_sync(0xffffffffu, v, static_cast<unsigned>(arg), width);
  else if (kind == kShflDown)
    r = __shfl_down_sync(0xffffffffu, v, static_cast<unsigned>(arg), width);
  else
    r = __shfl_xor_sync(0xffffffffu, v, arg, width);
  out[t] = r;
}

// Per thread: ballot, any, all over the full warp, and the same over lanes 0..15 only.
__global__ void vote_forward_kernel(const int* pred, unsigned* ballot, int* any, int* all, unsigned* half_ballot,
                                    int* half_any, int* half_all) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  const int p = pred[t];
  ballot[t] = __ballot_sync(0xffffffffu, p);
  any[t] = __any_sync(0xffffffffu, p);
  all[t] = __all_sync(0xffffffffu, p);
  const int lane = threadIdx.x % 32;
  if (lane < 16) {
    half_ballot[t] = __ballot_sync(0x0000ffffu, p);
    half_any[t] = __any_sync(0x0000ffffu, p);
    half_all[t] = __all_sync(0x0000ffffu, p);
  }
  __syncwarp();
}

// Every thread of every block updates the same counters; values are integers so float and
// double sums are exact in any order.
struct AtomicCounters {
  int i_add;
  unsigned u_add;
  float f_add;
  double d_add;
  int i_max, i_min;
  unsigned u_max, u_min;
  float f_max, f_min;
  double d_max, d_min;
  int cas_count;  // incremented through an atomicCAS loop
};

__global__ void atomics_forward_kernel(AtomicCounters* c, const int* values) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  const int v = values[t];
  atomicAdd(&c->i_add, v);
  atomicAdd(&c->u_add, static_cast<unsigned>(v));
  atomicAdd(&c->f_add, static_cast<float>(v));
  atomicAdd(&c->d_add, static_cast<double>(v));
  atomicMax(&c->i_max, v);
  atomicMin(&c->i_min, v);
  atomicMax(&c->u_max, static_cast<unsigned>(v));
  atomicMin(&c->u_min, static_cast<unsigned>(v));
  atomicMax(&c->f_max, static_cast<float>(v));
  atomicMin(&c->f_min, static_cast<float>(v));
  atomicMax(&c->d_max, static_cast<double>(v));
  atomicMin(&c->d_min, static_cast<double>(v));
  int old = c->cas_count, assumed;
  do {
    assumed = old;
    old = atomicCAS(&c->cas_count, assumed, assumed + 1);
  } while (old != assumed);
}

// Reverses each block's slice through static shared memory; also records whether every thread
// saw its own block's tag (a block's shared memory is its own, even with blocks in parallel).
__global__ void shared_reverse_static_kernel(const float* in, float* out, int* tag_ok) {
  __shared__ float tile[256];
  __shared__ int tag;
  const int t = threadIdx.x;
  const int base = blockIdx.x * blockDim.x;
  if (t == 0) tag = static_cast<int>(blockIdx.x);
  tile[t] = in[base + t];
  __syncthreads();
  out[base + t] = tile[blockDim.x - 1 - t];
  if (tag != static_cast<int>(blockIdx.x)) atomicAdd(tag_ok, 1);  // counts violations
}

// Same through dynamic shared memory (blockDim.x floats).
__global__ void shared_reverse_dynamic_kernel(const float* in, float* out) {
  DYNAMIC_SHARED(float, tile);
  const int t = threadIdx.x;
  const int base = blockIdx.x * blockDim.x;
  tile[t] = in[base + t];
  __syncthreads();
  out[base + t] = tile[blockDim.x - 1 - t];
}

// Reads dynamic shared memory before anything is written (the simulator's poison shows).
__global__ void shared_read_uninitialized_kernel(unsigned* out) {
  DYNAMIC_SHARED(unsigned, raw);
  out[blockIdx.x * blockDim.x + threadIdx.x] = raw[threadIdx.x];
}

// With `write`, fills its static shared array; without, reads it before writing (the simulator
// poisons static shared memory before every block, so a read-before-write shows 0xFFFFFFFF).
__global__ void static_shared_probe_kernel(unsigned* out, bool write) {
  __shared__ unsigned probe[64];
  if (write)
    probe[threadIdx.x] = 7u;
  else
    out[blockIdx.x * blockDim.x + threadIdx.x] = probe[threadIdx.x];
}

// sum[b] = sum of x[b * n + i] over i: warp shuffles, then one warp over the per-warp sums.
__global__ void block_sum_forward_kernel(const float* x, float* sum, int n) {
  __shared__ float warp_sums[32];
  const float* row = x + static_cast<long>(blockIdx.x) * n;  // [n]
  float s = 0.0f;
  for (int i = threadIdx.x; i < n; i += blockDim.x) s += row[i];
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_sums[warp] = s;
  __syncthreads();
  if (warp == 0) {
    const int nwarps = (blockDim.x + 31) / 32;
    float t = lane < nwarps ? warp_sums[lane] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) t += __shfl_down_sync(0xffffffffu, t, o);
    if (lane == 0) sum[blockIdx.x] = t;
  }
}

// Elementwise bf16 arithmetic: out = a * b + c (each op rounded to bf16), plus conversions.
__global__ void bf16_arith_forward_kernel(const __nv_bfloat16* a, const __nv_bfloat16* b, const __nv_bfloat16* c,
                                          __nv_bfloat16* fma_out, __nv_bfloat16* sub_out, __nv_bfloat16* exp_out,
                                          __nv_bfloat16* from_float, const float* f, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  __nv_bfloat16 prod = a[i] * b[i];
  fma_out[i] = prod + c[i];
  sub_out[i] = a[i] - b[i];
  exp_out[i] = hexp(a[i]);
  from_float[i] = __float2bfloat16(f[i]);
}

// __syncthreads_count / _and / _or: per thread, the block-wide results for pred[].
__global__ void barrier_vote_forward_kernel(const int* pred, int* count, int* all, int* any) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  const int p = pred[t];
  count[t] = __syncthreads_count(p);
  all[t] = __syncthreads_and(p);
  any[t] = __syncthreads_or(p);
}

}  // namespace semantics
