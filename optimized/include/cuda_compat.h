// cuda_compat.h: the one header a kernel file (*.cuh under optimized/) includes.
//
// Design: the same kernel source compiles with nvcc for the GPU and with the host compiler for the
// CPU CUDA simulator (cudasim/, a static library twin_cudasim). Kernels are written in plain CUDA
// (__global__, __shared__, __syncthreads, __shfl_*_sync, atomics, threadIdx, __nv_bfloat16,
// nvcuda::wmma's fragments and *_matrix_sync / mma_sync, ...);
// only two spellings differ from textbook CUDA, because <<<>>> and `extern __shared__` cannot be
// expressed in standard C++:
//
//   launch_kernel(kernel, grid, block, dynamic_smem_bytes, stream, args...);   // kernel<<<...>>>
//   DYNAMIC_SHARED(T, name);                        // extern __shared__ T name[]; (name is a T*)
//
// `stream` is a cudaStream_t: twin::rt::Stream::handle(), or nullptr for the default stream.
// A launch error (bad configuration, a deadlock found by the simulator, an exception inside the
// kernel) throws an exception derived from std::runtime_error naming the kernel and launch site.
//
// Host code that is compiled in both builds and linked into one binary (the launcher functions
// next to the kernels) goes into `namespace twin::opt::TWIN_BACKEND { ... }` (`cuda` or `sim`),
// so the GPU and the simulator versions do not collide. TWIN_SIM is 1 in the simulator build.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>

namespace cuda_compat {

// The kernel's name from launch_kernel's stringified argument list ("k<a, b>, grid, ..." ->
// "k<a, b>"), for the launch errors of both builds (the simulator's in runtime/cudasim.cpp).
inline std::string kernel_name_from_args(const char* args) {
  std::string s;
  int depth = 0;
  for (const char* p = args; *p; ++p) {
    char c = *p;
    if (c == '<' || c == '(' || c == '[') ++depth;
    if (c == '>' || c == ')' || c == ']') --depth;
    if (c == ',' && depth == 0) break;
    s += c;
  }
  while (!s.empty() && s.back() == ' ') s.pop_back();
  return s;
}

}  // namespace cuda_compat

#if defined(__CUDACC__)
// ------------------------------------------------------------------------------------- nvcc ----
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

#define TWIN_SIM 0
#define TWIN_BACKEND cuda

namespace cuda_compat {

// Thrown for a failed launch (bad configuration, too much shared memory, ...).
struct LaunchError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

inline void check_launch(cudaError_t err, const char* args, const char* file, int line) {
  if (err != cudaSuccess)
    throw LaunchError(std::string("launch_kernel(") + kernel_name_from_args(args) + ") at " + file + ":" +
                      std::to_string(line) + ": " + cudaGetErrorName(err) + ": " + cudaGetErrorString(err));
}

template <class... P, class... A>
void launch_kernel_at(const char* args, const char* file, int line, void (*kernel)(P...), dim3 grid, dim3 block,
                      std::size_t smem, cudaStream_t stream, A&&... a) {
  // Above the default 48 KiB, dynamic shared memory needs an explicit opt-in per kernel.
  if (smem > 48 * 1024)
    check_launch(cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel),
                                      cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)),
                 args, file, line);
  kernel<<<grid, block, smem, stream>>>(std::forward<A>(a)...);
  check_launch(cudaGetLastError(), args, file, line);
}

}  // namespace cuda_compat

#define launch_kernel(...) ::cuda_compat::launch_kernel_at(#__VA_ARGS__, __FILE__, __LINE__, __VA_ARGS__)

// All extern __shared__ arrays alias the start of dynamic shared memory; declaring the raw array
// as bytes lets kernels with different element types share one translation unit.
#define DYNAMIC_SHARED(T, name)                                                \
  extern __shared__ __align__(16) unsigned char cuda_compat_dyn_smem_##name[]; \
  T* name = reinterpret_cast<T*>(cuda_compat_dyn_smem_##name)

// Float/double atomicMax/atomicMin, which CUDA lacks, as CAS loops (the simulator has the same).
__device__ __forceinline__ float atomicMax(float* addr, float v) {
  int* a = reinterpret_cast<int*>(addr);
  int old = *a, assumed;
  do {
    assumed = old;
    if (__int_as_float(assumed) >= v) break;
    old = atomicCAS(a, assumed, __float_as_int(v));
  } while (old != assumed);
  return __int_as_float(old);
}
__device__ __forceinline__ float atomicMin(float* addr, float v) {
  int* a = reinterpret_cast<int*>(addr);
  int old = *a, assumed;
  do {
    assumed = old;
    if (__int_as_float(assumed) <= v) break;
    old = atomicCAS(a, assumed, __float_as_int(v));
  } while (old != assumed);
  return __int_as_float(old);
}
__device__ __forceinline__ double atomicMax(double* addr, double v) {
  auto* a = reinterpret_cast<unsigned long long*>(addr);
  unsigned long long old = *a, assumed;
  do {
    assumed = old;
    if (__longlong_as_double(static_cast<long long>(assumed)) >= v) break;
    old = atomicCAS(a, assumed, static_cast<unsigned long long>(__double_as_longlong(v)));
  } while (old != assumed);
  return __longlong_as_double(static_cast<long long>(old));
}
__device__ __forceinline__ double atomicMin(double* addr, double v) {
  auto* a = reinterpret_cast<unsigned long long*>(addr);
  unsigned long long old = *a, assumed;
  do {
    assumed = old;
    if (__longlong_as_double(static_cast<long long>(assumed)) <= v) break;
    old = atomicCAS(a, assumed, static_cast<unsigned long long>(__double_as_longlong(v)));
  } while (old != assumed);
  return __longlong_as_double(static_cast<long long>(old));
}

#else
// ---------------------------------------------------------------- host compiler: simulator ----
#define TWIN_SIM 1
#define TWIN_BACKEND sim
#include "cudasim/cudasim.h"
#endif
