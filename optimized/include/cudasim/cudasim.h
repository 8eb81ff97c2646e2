// cudasim.h: the CUDA simulator as seen by kernel code compiled with the host compiler.
// Included by cuda_compat.h when __CUDACC__ is not defined; do not include it directly.
//
// Design (the engine is optimized/runtime/cudasim.cpp, which documents the scheduler):
// - Every CUDA thread of a block is a cooperative fiber; a block runs start to end on one worker
//   thread; blocks of a grid run in parallel on a worker pool (CUDASIM_WORKERS, default: hardware
//   threads; the launching thread is one of them).
// - threadIdx is fiber-local (the scheduler sets a thread_local pointer before resuming a fiber);
//   blockIdx/blockDim/gridDim are worker-thread-local, since a block never changes worker.
// - Static `__shared__ T x[N];` becomes `static thread_local T x[N];` placed in the TLS section
//   "cudasim_shared": one instance per worker thread, hence shared by exactly the fibers of the
//   block running there and separate from blocks running concurrently on other workers. A macro
//   cannot learn the address of the array it prefixes, but the linker gathers the section, so
//   before every block the engine fills the worker's whole copy of it (every kernel's static
//   shared arrays) with 0xFF bytes: NaN for float/bf16/fp16, -1 for ints, as it does for dynamic
//   shared memory (DYNAMIC_SHARED, a per-worker buffer). Stale values never carry over.
// - __nv_bfloat16/__half come from the CUDA toolkit's own headers, which implement conversions and
//   arithmetic for the host; math functions the toolkit keeps device-only are supplied below.
// - Barriers and warp operations record __FILE__/__LINE__ (they are macros) so the simulator
//   can name the source line of a deadlock or a bad mask.
#pragma once

#include <cuda_runtime_api.h>  // cudaStream_t, cudaError_t (declarations only; never linked)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <vector_types.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

// ---- CUDA keywords the toolkit leaves undefined (or empty) for a host compiler ----------------
#undef __shared__
#define __shared__ static thread_local __attribute__((section("cudasim_shared")))
#ifndef __launch_bounds__
#define __launch_bounds__(...)
#endif
#undef __noinline__
#define __noinline__ __attribute__((noinline))
#ifndef __grid_constant__
#define __grid_constant__
#endif
#ifndef warpSize
#define warpSize 32
#endif

namespace cudasim {

// Every error the simulator reports (deadlock, bad mask, bad launch configuration).
struct KernelError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

namespace detail {

// Per-fiber state visible to the kernel side (the engine's Fiber starts with it).
struct ThreadCtx {
  uint3 tid;
};
inline thread_local ThreadCtx* tl_thread = nullptr;
inline thread_local uint3 tl_block_idx{0, 0, 0};
inline thread_local dim3 tl_block_dim{1, 1, 1};
inline thread_local dim3 tl_grid_dim{1, 1, 1};
inline thread_local unsigned char* tl_dyn_smem = nullptr;

[[noreturn]] void not_in_kernel(const char* what);
inline const ThreadCtx& thread_ctx() {
  if (!tl_thread) not_in_kernel("threadIdx");
  return *tl_thread;
}

enum class WarpOp : int { Shfl, ShflUp, ShflDown, ShflXor, Ballot, Any, All, SyncWarp, Collective };

// Block barrier; returns how many threads passed a non-zero `pred` (for __syncthreads_count/and/or).
int syncthreads(const char* file, int line, int pred = 0);
// One warp operation of the calling lane; returns the result bits (shuffles: the source lane's
// value; ballot: the mask; any/all: 0/1).
std::uint64_t warp_op(WarpOp op, const char* file, int line, unsigned mask, std::uint64_t value, int arg, int width);
unsigned activemask();
// A warp collective (WMMA, cudasim/wmma.h): all 32 lanes of the caller's warp must arrive at the
// same call (`name` at file:line); each posts `data`, and the last to arrive runs
// complete(lane_data) with every lane's data (lane_data[l] from lane l) before all continue. A
// std::exception from `complete` is reported as a misuse at file:line, like a diverged warp.
using CollectiveFn = void (*)(void* const* lane_data);
void warp_collective(const char* name, const char* file, int line, void* data, CollectiveFn complete);
// Throws the simulator's report of a misused warp operation (kernel, block, thread, file:line).
[[noreturn]] void warp_misuse(const char* name, const char* file, int line, const std::string& what);

template <class T>
std::uint64_t to_bits(const T& v) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8,
                "shuffles move trivially copyable values of at most 8 bytes");
  std::uint64_t u = 0;
  std::memcpy(&u, static_cast<const void*>(&v), sizeof(T));
  return u;
}
template <class T>
T from_bits(std::uint64_t u) {
  T v;
  std::memcpy(static_cast<void*>(&v), &u, sizeof(T));
  return v;
}

// ---- launches ----
struct LaunchSpec {
  const char* args_text;  // "kernel<...>, grid, block, smem, stream, args..." (for the name)
  const char* file;
  int line;
  dim3 grid, block;
  std::size_t smem;
};
using Thunk = void (*)(const void* ctx);
// Runs (or, while `stream` is being captured, records) the grid. ctx owns the kernel arguments.
void launch(cudaStream_t stream, const LaunchSpec& spec, Thunk thunk, std::shared_ptr<const void> ctx);

template <class... P>
struct KernelCall {
  void (*kernel)(P...);
  std::tuple<std::decay_t<P>...> params;
  static void run(const void* self) {
    auto* c = static_cast<const KernelCall*>(self);
    std::apply(c->kernel, c->params);  // each CUDA thread gets its own copy of the parameters
  }
};

}  // namespace detail

using cuda_compat::kernel_name_from_args;  // cuda_compat.h, shared with the nvcc build

template <class... P, class... A>
void launch_kernel_at(const char* args, const char* file, int line, void (*kernel)(P...), dim3 grid, dim3 block,
                      std::size_t smem, cudaStream_t stream, A&&... a) {
  static_assert(sizeof...(P) == sizeof...(A), "launch_kernel: argument count differs from the kernel's");
  using Call = detail::KernelCall<P...>;
  auto ctx = std::make_shared<Call>(Call{kernel, std::tuple<std::decay_t<P>...>(std::forward<A>(a)...)});
  detail::launch(stream, detail::LaunchSpec{args, file, line, grid, block, smem}, &Call::run, std::move(ctx));
}

inline void syncthreads(const char* file, int line) { detail::syncthreads(file, line); }
inline int syncthreads_count(const char* file, int line, int pred) {
  return detail::syncthreads(file, line, pred != 0);
}
inline int syncthreads_and(const char* file, int line, int pred) {
  return detail::syncthreads(file, line, pred != 0) ==
         static_cast<int>(detail::tl_block_dim.x * detail::tl_block_dim.y * detail::tl_block_dim.z);
}
inline int syncthreads_or(const char* file, int line, int pred) {
  return detail::syncthreads(file, line, pred != 0) != 0;
}

template <class T>
T shfl_sync(const char* f, int l, unsigned mask, T v, int src_lane, int width = 32) {
  return detail::from_bits<T>(detail::warp_op(detail::WarpOp::Shfl, f, l, mask, detail::to_bits(v), src_lane, width));
}
template <class T>
T shfl_up_sync(const char* f, int l, unsigned mask, T v, unsigned delta, int width = 32) {
  return detail::from_bits<T>(
      detail::warp_op(detail::WarpOp::ShflUp, f, l, mask, detail::to_bits(v), static_cast<int>(delta), width));
}
template <class T>
T shfl_down_sync(const char* f, int l, unsigned mask, T v, unsigned delta, int width = 32) {
  return detail::from_bits<T>(
      detail::warp_op(detail::WarpOp::ShflDown, f, l, mask, detail::to_bits(v), static_cast<int>(delta), width));
}
template <class T>
T shfl_xor_sync(const char* f, int l, unsigned mask, T v, int lane_mask, int width = 32) {
  return detail::from_bits<T>(
      detail::warp_op(detail::WarpOp::ShflXor, f, l, mask, detail::to_bits(v), lane_mask, width));
}
inline unsigned ballot_sync(const char* f, int l, unsigned mask, int pred) {
  return static_cast<unsigned>(detail::warp_op(detail::WarpOp::Ballot, f, l, mask, pred != 0, 0, 32));
}
inline int any_sync(const char* f, int l, unsigned mask, int pred) {
  return static_cast<int>(detail::warp_op(detail::WarpOp::Any, f, l, mask, pred != 0, 0, 32));
}
inline int all_sync(const char* f, int l, unsigned mask, int pred) {
  return static_cast<int>(detail::warp_op(detail::WarpOp::All, f, l, mask, pred != 0, 0, 32));
}
// __syncwarp() and __syncwarp(mask): a call site object, since the mask is optional.
struct SyncWarpAt {
  const char* file;
  int line;
  void operator()(unsigned mask = 0xffffffffu) const {
    detail::warp_op(detail::WarpOp::SyncWarp, file, line, mask, 0, 0, 32);
  }
};

}  // namespace cudasim

// ---- the CUDA spellings ------------------------------------------------------------------------
#define threadIdx (::cudasim::detail::thread_ctx().tid)
#define blockIdx (static_cast<const uint3&>(::cudasim::detail::tl_block_idx))
#define blockDim (static_cast<const dim3&>(::cudasim::detail::tl_block_dim))
#define gridDim (static_cast<const dim3&>(::cudasim::detail::tl_grid_dim))

#define __syncthreads() ::cudasim::syncthreads(__FILE__, __LINE__)
#define __syncthreads_count(pred) ::cudasim::syncthreads_count(__FILE__, __LINE__, (pred))
#define __syncthreads_and(pred) ::cudasim::syncthreads_and(__FILE__, __LINE__, (pred))
#define __syncthreads_or(pred) ::cudasim::syncthreads_or(__FILE__, __LINE__, (pred))
#define __syncwarp \
  ::cudasim::SyncWarpAt { __FILE__, __LINE__ }
#define __shfl_sync(...) ::cudasim::shfl_sync(__FILE__, __LINE__, __VA_ARGS__)
#define __shfl_up_sync(...) ::cudasim::shfl_up_sync(__FILE__, __LINE__, __VA_ARGS__)
#define __shfl_down_sync(...) ::cudasim::shfl_down_sync(__FILE__, __LINE__, __VA_ARGS__)
#define __shfl_xor_sync(...) ::cudasim::shfl_xor_sync(__FILE__, __LINE__, __VA_ARGS__)
#define __ballot_sync(...) ::cudasim::ballot_sync(__FILE__, __LINE__, __VA_ARGS__)
#define __any_sync(...) ::cudasim::any_sync(__FILE__, __LINE__, __VA_ARGS__)
#define __all_sync(...) ::cudasim::all_sync(__FILE__, __LINE__, __VA_ARGS__)
#define __activemask() ::cudasim::detail::activemask()

#define launch_kernel(...) ::cudasim::launch_kernel_at(#__VA_ARGS__, __FILE__, __LINE__, __VA_ARGS__)
#define DYNAMIC_SHARED(T, name) T* name = reinterpret_cast<T*>(::cudasim::detail::tl_dyn_smem)

#include "cudasim/device_functions.h"
#include "cudasim/wmma.h"
