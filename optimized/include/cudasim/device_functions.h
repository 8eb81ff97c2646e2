// device_functions.h: CUDA device functions for the simulator (host compiler only): atomics,
// fences, intrinsics, integer bit functions and the bf16/fp16 math the toolkit's host headers
// leave out. Math is evaluated in float (double for double) and rounded once to the result type,
// which is within the error bounds CUDA documents for the device versions.
//
// Atomics: blocks run in parallel on worker threads, so atomics are real CPU atomics (GCC
// __atomic builtins on the object's bits; float/double ops are compare-and-swap loops).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>

// ---- atomics -----------------------------------------------------------------------------------
namespace cudasim::detail {
template <class T, class Bits, class F>
inline T atomic_update(T* addr, F f) {  // CAS loop: *addr = f(*addr); returns the old value
  static_assert(sizeof(T) == sizeof(Bits));
  Bits* a = reinterpret_cast<Bits*>(addr);
  Bits old_bits = __atomic_load_n(a, __ATOMIC_RELAXED);
  for (;;) {
    T old_v;
    std::memcpy(static_cast<void*>(&old_v), &old_bits, sizeof(T));
    T new_v = f(old_v);
    Bits new_bits;
    std::memcpy(&new_bits, static_cast<const void*>(&new_v), sizeof(T));
    if (__atomic_compare_exchange_n(a, &old_bits, new_bits, false, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED)) return old_v;
  }
}
}  // namespace cudasim::detail

#define CUDASIM_INT_ATOMICS(T)                                                              \
  inline T atomicAdd(T* a, T v) { return __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST); }      \
  inline T atomicSub(T* a, T v) { return __atomic_fetch_sub(a, v, __ATOMIC_SEQ_CST); }      \
  inline T atomicExch(T* a, T v) { return __atomic_exchange_n(a, v, __ATOMIC_SEQ_CST); }    \
  inline T atomicAnd(T* a, T v) { return __atomic_fetch_and(a, v, __ATOMIC_SEQ_CST); }      \
  inline T atomicOr(T* a, T v) { return __atomic_fetch_or(a, v, __ATOMIC_SEQ_CST); }        \
  inline T atomicXor(T* a, T v) { return __atomic_fetch_xor(a, v, __ATOMIC_SEQ_CST); }      \
  inline T atomicMax(T* a, T v) {                                                           \
    return ::cudasim::detail::atomic_update<T, T>(a, [v](T o) { return o < v ? v : o; });   \
  }                                                                                         \
  inline T atomicMin(T* a, T v) {                                                           \
    return ::cudasim::detail::atomic_update<T, T>(a, [v](T o) { return v < o ? v : o; });   \
  }                                                                                         \
  inline T atomicCAS(T* a, T compare, T v) {                                                \
    __atomic_compare_exchange_n(a, &compare, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST); \
    return compare; /* the old value either way */                                          \
  }
CUDASIM_INT_ATOMICS(int)
CUDASIM_INT_ATOMICS(unsigned int)
CUDASIM_INT_ATOMICS(unsigned long long int)
CUDASIM_INT_ATOMICS(long long int)
#undef CUDASIM_INT_ATOMICS

inline unsigned short int atomicCAS(unsigned short int* a, unsigned short int compare, unsigned short int v) {
  __atomic_compare_exchange_n(a, &compare, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  return compare;
}
// CUDA semantics: ((old >= v) ? 0 : old + 1) and ((old == 0 || old > v) ? v : old - 1).
inline unsigned int atomicInc(unsigned int* a, unsigned int v) {
  return cudasim::detail::atomic_update<unsigned, unsigned>(a, [v](unsigned o) { return o >= v ? 0u : o + 1; });
}
inline unsigned int atomicDec(unsigned int* a, unsigned int v) {
  return cudasim::detail::atomic_update<unsigned, unsigned>(a,
                                                            [v](unsigned o) { return (o == 0 || o > v) ? v : o - 1; });
}

#define CUDASIM_FLOAT_ATOMICS(T, Bits)                                                     \
  inline T atomicAdd(T* a, T v) {                                                          \
    return cudasim::detail::atomic_update<T, Bits>(a, [v](T o) { return o + v; });         \
  }                                                                                        \
  inline T atomicSub(T* a, T v) {                                                          \
    return cudasim::detail::atomic_update<T, Bits>(a, [v](T o) { return o - v; });         \
  }                                                                                        \
  inline T atomicExch(T* a, T v) {                                                         \
    return cudasim::detail::atomic_update<T, Bits>(a, [v](T) { return v; });               \
  }                                                                                        \
  inline T atomicMax(T* a, T v) {                                                          \
    return cudasim::detail::atomic_update<T, Bits>(a, [v](T o) { return o < v ? v : o; }); \
  }                                                                                        \
  inline T atomicMin(T* a, T v) {                                                          \
    return cudasim::detail::atomic_update<T, Bits>(a, [v](T o) { return v < o ? v : o; }); \
  }
CUDASIM_FLOAT_ATOMICS(float, std::uint32_t)
CUDASIM_FLOAT_ATOMICS(double, std::uint64_t)
#undef CUDASIM_FLOAT_ATOMICS

inline __nv_bfloat16 atomicAdd(__nv_bfloat16* a, __nv_bfloat16 v) {
  return cudasim::detail::atomic_update<__nv_bfloat16, std::uint16_t>(
      a, [v](__nv_bfloat16 o) { return __float2bfloat16(__bfloat162float(o) + __bfloat162float(v)); });
}
inline __half atomicAdd(__half* a, __half v) {
  return cudasim::detail::atomic_update<__half, std::uint16_t>(
      a, [v](__half o) { return __float2half(__half2float(o) + __half2float(v)); });
}

inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_block() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_system() { std::atomic_thread_fence(std::memory_order_seq_cst); }

// ---- loads, bit casts, integer intrinsics ------------------------------------------------------
template <class T>
inline T __ldg(const T* p) {
  return *p;
}
template <class T>
inline T __ldcs(const T* p) {
  return *p;
}
template <class T>
inline void __stcs(T* p, T v) {
  *p = v;
}

inline int __float_as_int(float f) {
  int i;
  std::memcpy(&i, &f, 4);
  return i;
}
inline unsigned int __float_as_uint(float f) {
  unsigned u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float __int_as_float(int i) {
  float f;
  std::memcpy(&f, &i, 4);
  return f;
}
inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline long long __double_as_longlong(double d) {
  long long i;
  std::memcpy(&i, &d, 8);
  return i;
}
inline double __longlong_as_double(long long i) {
  double d;
  std::memcpy(&d, &i, 8);
  return d;
}

inline int __popc(unsigned int x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }
inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll(static_cast<unsigned long long>(x)); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned int __brev(unsigned int x) {
  unsigned r = 0;
  for (int i = 0; i < 32; ++i) r |= ((x >> i) & 1u) << (31 - i);
  return r;
}
inline unsigned int __umulhi(unsigned int a, unsigned int b) {
  return static_cast<unsigned>((static_cast<unsigned long long>(a) * b) >> 32);
}

// CUDA's global min/max overloads (device and host under nvcc).
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned int min(unsigned int a, unsigned int b) { return a < b ? a : b; }
inline unsigned int max(unsigned int a, unsigned int b) { return a > b ? a : b; }
inline unsigned int min(int a, unsigned int b) { return min(static_cast<unsigned>(a), b); }
inline unsigned int max(int a, unsigned int b) { return max(static_cast<unsigned>(a), b); }
inline unsigned int min(unsigned int a, int b) { return min(a, static_cast<unsigned>(b)); }
inline unsigned int max(unsigned int a, int b) { return max(a, static_cast<unsigned>(b)); }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline unsigned long long min(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
inline unsigned long long max(unsigned long long a, unsigned long long b) { return a > b ? a : b; }
inline float min(float a, float b) { return std::fmin(a, b); }
inline float max(float a, float b) { return std::fmax(a, b); }
inline double min(double a, double b) { return std::fmin(a, b); }
inline double max(double a, double b) { return std::fmax(a, b); }
inline double min(float a, double b) { return std::fmin(static_cast<double>(a), b); }
inline double max(float a, double b) { return std::fmax(static_cast<double>(a), b); }
inline double min(double a, float b) { return std::fmin(a, static_cast<double>(b)); }
inline double max(double a, float b) { return std::fmax(a, static_cast<double>(b)); }

// ---- float intrinsics (exact versions; the device ones are approximations within a few ulp) ----
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline double rsqrt(double x) { return 1.0 / std::sqrt(x); }
inline float __expf(float x) { return std::exp(x); }
inline float __exp10f(float x) { return std::pow(10.0f, x); }
inline float __logf(float x) { return std::log(x); }
inline float __log2f(float x) { return std::log2(x); }
inline float __log10f(float x) { return std::log10(x); }
inline float __sinf(float x) { return std::sin(x); }
inline float __cosf(float x) { return std::cos(x); }
inline float __tanf(float x) { return std::tan(x); }
inline float __powf(float x, float y) { return std::pow(x, y); }
inline float __fdividef(float x, float y) { return x / y; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return std::sqrt(x); }
inline float __frsqrt_rn(float x) { return 1.0f / std::sqrt(x); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : (x == x ? x : 0.0f)); }
inline float normcdff(float x) { return 0.5f * std::erfc(-x * 0.70710678118654752f); }
inline double normcdf(double x) { return 0.5 * std::erfc(-x * 0.70710678118654752); }

// ---- bf16 / fp16 math missing from the toolkit's host headers ----------------------------------
#define CUDASIM_HALF_MATH(H, TOF, FROMF)                           \
  inline H hexp(H a) { return FROMF(std::exp(TOF(a))); }           \
  inline H hexp2(H a) { return FROMF(std::exp2(TOF(a))); }         \
  inline H hexp10(H a) { return FROMF(std::pow(10.0f, TOF(a))); }  \
  inline H hlog(H a) { return FROMF(std::log(TOF(a))); }           \
  inline H hlog2(H a) { return FROMF(std::log2(TOF(a))); }         \
  inline H hlog10(H a) { return FROMF(std::log10(TOF(a))); }       \
  inline H hsqrt(H a) { return FROMF(std::sqrt(TOF(a))); }         \
  inline H hrsqrt(H a) { return FROMF(1.0f / std::sqrt(TOF(a))); } \
  inline H hrcp(H a) { return FROMF(1.0f / TOF(a)); }              \
  inline H hsin(H a) { return FROMF(std::sin(TOF(a))); }           \
  inline H hcos(H a) { return FROMF(std::cos(TOF(a))); }           \
  inline H htanh(H a) { return FROMF(std::tanh(TOF(a))); }         \
  inline H hfloor(H a) { return FROMF(std::floor(TOF(a))); }       \
  inline H hceil(H a) { return FROMF(std::ceil(TOF(a))); }         \
  inline H htrunc(H a) { return FROMF(std::trunc(TOF(a))); }       \
  inline H hrint(H a) { return FROMF(std::nearbyint(TOF(a))); }    \
  inline H __hfma(H a, H b, H c) { return FROMF(std::fma(TOF(a), TOF(b), TOF(c))); }
CUDASIM_HALF_MATH(__nv_bfloat16, __bfloat162float, __float2bfloat16)
CUDASIM_HALF_MATH(__half, __half2float, __float2half)
#undef CUDASIM_HALF_MATH

inline __nv_bfloat162 __hfma2(__nv_bfloat162 a, __nv_bfloat162 b, __nv_bfloat162 c) {
  return __nv_bfloat162(__hfma(a.x, b.x, c.x), __hfma(a.y, b.y, c.y));
}
inline __half2 __hfma2(__half2 a, __half2 b, __half2 c) {
  return __half2(__hfma(a.x, b.x, c.x), __hfma(a.y, b.y, c.y));
}
inline int __bfloat162int_rn(__nv_bfloat16 a) { return static_cast<int>(std::nearbyint(__bfloat162float(a))); }
inline int __half2int_rn(__half a) { return static_cast<int>(std::nearbyint(__half2float(a))); }
