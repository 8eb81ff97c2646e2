// wmma.h: CUDA's warp matrix functions (nvcuda::wmma, <mma.h>) for the simulator; included by
// cudasim.h, so a kernel including cuda_compat.h spells them as CUDA does:
//
//   nvcuda::wmma::fragment<nvcuda::wmma::matrix_a, 16, 16, 16, __nv_bfloat16, nvcuda::wmma::row_major> a;
//   nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 16, float> acc;
//   nvcuda::wmma::fill_fragment(acc, 0.0f);
//   nvcuda::wmma::load_matrix_sync(a, ptr, ldm);
//   nvcuda::wmma::mma_sync(acc, a, b, acc);
//   nvcuda::wmma::store_matrix_sync(out, acc, ldm, nvcuda::wmma::mem_row_major);
//
// Covered: __nv_bfloat16 and __half inputs with float accumulators, shapes m16n16k16, m32n8k16
// and m8n32k16 (the 16-bit shapes of sm_70..sm_90). Anything else fails to compile here
// (static_assert) rather than running with made-up semantics.
//
// Semantics, as the CUDA programming guide states them, and what the simulator checks:
// - load_matrix_sync, store_matrix_sync and mma_sync are warp-collective: all 32 lanes of the
//   warp must execute the same call (cudasim.cpp's warp_collective; a diverged warp, a lane that
//   returned or a partial warp is reported with file:line). mptr, ldm and layout must be the same
//   for every lane (checked); mptr must be 256-bit (32-byte) aligned and ldm a multiple of 16 bytes
//   (8 elements for the 16-bit types, 4 for float) (checked, per lane, with file:line).
// - mma_sync: D = A B + C, every product of two 16-bit values exact in fp32 (8- or 11-bit
//   significands multiply into at most 22 bits) and accumulated in fp32 onto C, in k order. A
//   tensor core adds in another order (and with other internal widths); the twin's bounds cover
//   any order of an fp32 accumulation of k products, which is what a caller may rely on.
// - The mapping of matrix elements to the lanes' fragment elements x[] is unspecified in CUDA;
//   here element (r, c) of the rows x cols tile belongs to lane (r * cols + c) % 32, slot
//   (r * cols + c) / 32. Elementwise code over x[] (scaling an accumulator, fill_fragment) works
//   with any mapping, which is all CUDA allows. fill_fragment is per lane, as in CUDA.
//
// The file:line of a report comes from __builtin_FILE()/__builtin_LINE() default arguments: a
// qualified call such as wmma::mma_sync(...) cannot go through a macro as __syncthreads does.
// The implementation lives in cudasim::wmma (nvcuda::wmma is an alias), so a program that links
// nvcc-compiled kernels (the real <mma.h> types) and simulated ones has no clashing definitions.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace cudasim::wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

namespace detail {

template <int M, int N, int K>
constexpr bool is_16bit_shape = (M == 16 && N == 16 && K == 16) || (M == 32 && N == 8 && K == 16) ||
                                (M == 8 && N == 32 && K == 16);

// The tile a fragment holds: matrix_a M x K, matrix_b K x N, accumulator M x N.
template <class Use, int M, int N, int K>
struct TileDims;
template <int M, int N, int K>
struct TileDims<matrix_a, M, N, K> {
  static constexpr int rows = M, cols = K;
};
template <int M, int N, int K>
struct TileDims<matrix_b, M, N, K> {
  static constexpr int rows = K, cols = N;
};
template <int M, int N, int K>
struct TileDims<accumulator, M, N, K> {
  static constexpr int rows = M, cols = N;
};

template <class T>
struct Identity {
  using type = T;
};

template <class T>
inline float to_float(T v) {
  if constexpr (std::is_same_v<T, float>)
    return v;
  else if constexpr (std::is_same_v<T, __nv_bfloat16>)
    return __bfloat162float(v);
  else
    return __half2float(v);
}

}  // namespace detail

template <class Use, int M, int N, int K, class T, class Layout = void>
class fragment {
  static_assert(detail::is_16bit_shape<M, N, K>, "cudasim wmma: only m16n16k16, m32n8k16 and m8n32k16 are simulated");
  static_assert(std::is_same_v<Use, accumulator> ? std::is_same_v<T, float>
                                                 : (std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>),
                "cudasim wmma: matrix_a/matrix_b of __nv_bfloat16 or __half and float accumulators are simulated");
  static_assert(std::is_same_v<Use, accumulator>
                    ? std::is_same_v<Layout, void>
                    : (std::is_same_v<Layout, row_major> || std::is_same_v<Layout, col_major>),
                "cudasim wmma: matrix_a/matrix_b need row_major or col_major; an accumulator has no layout");

 public:
  static constexpr int rows = detail::TileDims<Use, M, N, K>::rows;
  static constexpr int cols = detail::TileDims<Use, M, N, K>::cols;
  enum { num_elements = rows * cols / 32, num_storage_elements = rows * cols / 32 };
  using element_type = T;
  using storage_element_type = T;
  T x[num_elements];
};

namespace detail {

// What one lane posts to a collective load or store.
struct MemArgs {
  const void* ptr;
  unsigned ldm;
  bool col;    // the tile is column-major in memory
  void* frag;  // this lane's fragment
  int rows, cols;
};

inline void check_mem(const char* name, const char* file, int line, const void* ptr, unsigned ldm,
                      std::size_t elem_bytes) {
  const unsigned multiple = static_cast<unsigned>(16 / elem_bytes);
  if (ldm == 0 || ldm % multiple != 0)
    ::cudasim::detail::warp_misuse(name, file, line,
                                   "ldm " + std::to_string(ldm) + " must be a positive multiple of " +
                                       std::to_string(multiple) + " elements (16 bytes) for a " +
                                       std::to_string(elem_bytes) + "-byte element type");
  if (reinterpret_cast<std::uintptr_t>(ptr) % 32 != 0)
    ::cudasim::detail::warp_misuse(name, file, line, "the matrix pointer must be 256-bit (32-byte) aligned");
}

inline void check_uniform(void* const* lane_data) {
  const auto* a0 = static_cast<const MemArgs*>(lane_data[0]);
  for (int l = 1; l < 32; ++l) {
    const auto* a = static_cast<const MemArgs*>(lane_data[l]);
    if (a->ptr != a0->ptr || a->ldm != a0->ldm || a->col != a0->col)
      throw std::invalid_argument("lane " + std::to_string(l) + " passes another pointer, ldm or layout than lane 0 " +
                                  "(ldm " + std::to_string(a->ldm) + " vs " + std::to_string(a0->ldm) +
                                  "); they must be the same for the whole warp");
  }
}

// Element (r, c) of the tile <-> (lane, slot), see the file comment.
template <class E>
void load_all(void* const* lane_data) {
  check_uniform(lane_data);
  const auto* a0 = static_cast<const MemArgs*>(lane_data[0]);
  const E* p = static_cast<const E*>(a0->ptr);
  for (int r = 0; r < a0->rows; ++r)
    for (int c = 0; c < a0->cols; ++c) {
      const int e = r * a0->cols + c;
      E* x = static_cast<E*>(static_cast<const MemArgs*>(lane_data[e % 32])->frag);
      x[e / 32] = a0->col ? p[std::size_t(c) * a0->ldm + r] : p[std::size_t(r) * a0->ldm + c];
    }
}

template <class E>
void store_all(void* const* lane_data) {
  check_uniform(lane_data);
  const auto* a0 = static_cast<const MemArgs*>(lane_data[0]);
  E* p = const_cast<E*>(static_cast<const E*>(a0->ptr));
  for (int r = 0; r < a0->rows; ++r)
    for (int c = 0; c < a0->cols; ++c) {
      const int e = r * a0->cols + c;
      const E* x = static_cast<const E*>(static_cast<const MemArgs*>(lane_data[e % 32])->frag);
      (a0->col ? p[std::size_t(c) * a0->ldm + r] : p[std::size_t(r) * a0->ldm + c]) = x[e / 32];
    }
}

template <int M, int N, int K, class TA, class TB>
struct MmaArgs {
  float* d;
  const TA* a;
  const TB* b;
  const float* c;
};

template <int M, int N, int K, class TA, class TB>
void mma_all(void* const* lane_data) {
  float a[M][K], b[K][N], c[M][N];
  auto at = [&](int e) { return static_cast<const MmaArgs<M, N, K, TA, TB>*>(lane_data[e % 32]); };
  for (int e = 0; e < M * K; ++e) a[e / K][e % K] = to_float(at(e)->a[e / 32]);
  for (int e = 0; e < K * N; ++e) b[e / N][e % N] = to_float(at(e)->b[e / 32]);
  for (int e = 0; e < M * N; ++e) c[e / N][e % N] = at(e)->c[e / 32];
  // Gathered before any lane's d is written: d may be c.
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) {
      float acc = c[i][j];
      for (int k = 0; k < K; ++k) acc += a[i][k] * b[k][j];  // the product is exact in fp32
      at(i * N + j)->d[(i * N + j) / 32] = acc;
    }
}

template <class Layout>
constexpr bool layout_col = std::is_same_v<Layout, col_major>;

}  // namespace detail

template <class Use, int M, int N, int K, class T, class Layout>
inline void fill_fragment(fragment<Use, M, N, K, T, Layout>& f, const typename detail::Identity<T>::type& v) {
  for (int i = 0; i < fragment<Use, M, N, K, T, Layout>::num_elements; ++i) f.x[i] = v;
}

// matrix_a / matrix_b: the layout is the fragment's.
template <class Use, int M, int N, int K, class T, class Layout>
inline void load_matrix_sync(fragment<Use, M, N, K, T, Layout>& f, const T* mptr, unsigned ldm,
                             const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  static_assert(!std::is_same_v<Use, accumulator>, "an accumulator load needs a layout_t argument");
  using F = fragment<Use, M, N, K, T, Layout>;
  constexpr const char* name = "wmma::load_matrix_sync";
  detail::check_mem(name, file, line, mptr, ldm, sizeof(T));
  detail::MemArgs args{mptr, ldm, detail::layout_col<Layout>, f.x, F::rows, F::cols};
  ::cudasim::detail::warp_collective(name, file, line, &args, &detail::load_all<T>);
}

template <int M, int N, int K>
inline void load_matrix_sync(fragment<accumulator, M, N, K, float>& f, const float* mptr, unsigned ldm, layout_t layout,
                             const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  using F = fragment<accumulator, M, N, K, float>;
  constexpr const char* name = "wmma::load_matrix_sync";
  detail::check_mem(name, file, line, mptr, ldm, sizeof(float));
  detail::MemArgs args{mptr, ldm, layout == mem_col_major, f.x, F::rows, F::cols};
  ::cudasim::detail::warp_collective(name, file, line, &args, &detail::load_all<float>);
}

template <int M, int N, int K>
inline void store_matrix_sync(float* mptr, const fragment<accumulator, M, N, K, float>& f, unsigned ldm,
                              layout_t layout, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  using F = fragment<accumulator, M, N, K, float>;
  constexpr const char* name = "wmma::store_matrix_sync";
  detail::check_mem(name, file, line, mptr, ldm, sizeof(float));
  detail::MemArgs args{mptr, ldm, layout == mem_col_major, const_cast<float*>(f.x), F::rows, F::cols};
  ::cudasim::detail::warp_collective(name, file, line, &args, &detail::store_all<float>);
}

template <int M, int N, int K, class TA, class LA, class TB, class LB>
inline void mma_sync(fragment<accumulator, M, N, K, float>& d, const fragment<matrix_a, M, N, K, TA, LA>& a,
                     const fragment<matrix_b, M, N, K, TB, LB>& b, const fragment<accumulator, M, N, K, float>& c,
                     const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  static_assert(std::is_same_v<TA, TB>, "wmma::mma_sync: matrix_a and matrix_b must have the same element type");
  detail::MmaArgs<M, N, K, TA, TB> args{d.x, a.x, b.x, c.x};
  ::cudasim::detail::warp_collective("wmma::mma_sync", file, line, &args, &detail::mma_all<M, N, K, TA, TB>);
}

}  // namespace cudasim::wmma

namespace nvcuda {
namespace wmma = ::cudasim::wmma;
}
