// wmma_kernels.cuh: kernels using nvcuda::wmma as CUDA spells it, for the WMMA tests
// (wmma_cases.inc on the simulator and on a GPU) and for the simulator's misuse reports
// (test_cudasim_wmma.cpp). A `// @name` marker ends the line a report must name. The misuse
// kernels compile with nvcc too but are only run in the simulator (on a GPU they are undefined).
#pragma once

#include "cuda_compat.h"

#include <type_traits>

namespace wmma_kernels {

inline const char* source_file() { return __FILE__; }

// D = A B + C for a [warps * M, k_total] x [k_total, N] product: warp w computes the rows
// [w * M, (w + 1) * M) of D, k_total / K mma_sync calls accumulating into one fragment.
// A is row- or column-major per LA (lda its leading dimension), B per LB; C and D are row-major
// [warps * M, N] (ldc = ldd = N) or column-major when d_col.
template <class T, class LA, class LB, int M, int N, int K>
__global__ void product_kernel(const T* a, int lda, const T* b, int ldb, const float* c, float* d, int k_total,
                               bool d_col) {
  namespace wmma = nvcuda::wmma;
  const int warp = threadIdx.x / 32;
  const int rows = blockDim.x / 32 * M;  // of C and D
  constexpr bool a_col = std::is_same<LA, wmma::col_major>::value, b_col = std::is_same<LB, wmma::col_major>::value;
  const wmma::layout_t cd_layout = d_col ? wmma::mem_col_major : wmma::mem_row_major;
  const int ldcd = d_col ? rows : N;
  const std::size_t cd_off = d_col ? std::size_t(warp) * M : std::size_t(warp) * M * N;
  wmma::fragment<wmma::accumulator, M, N, K, float> acc;
  wmma::load_matrix_sync(acc, c + cd_off, ldcd, cd_layout);
  for (int k0 = 0; k0 < k_total; k0 += K) {
    wmma::fragment<wmma::matrix_a, M, N, K, T, LA> fa;
    wmma::fragment<wmma::matrix_b, M, N, K, T, LB> fb;
    const int r0 = warp * M;
    wmma::load_matrix_sync(fa, a + (a_col ? std::size_t(k0) * lda + r0 : std::size_t(r0) * lda + k0), lda);
    wmma::load_matrix_sync(fb, b + (b_col ? std::size_t(k0) : std::size_t(k0) * ldb), ldb);
    wmma::mma_sync(acc, fa, fb, acc);
  }
  wmma::store_matrix_sync(d + cd_off, acc, ldcd, cd_layout);
}

// fill_fragment and elementwise work on x[]: D = s * (fill value) for every element.
__global__ void fill_scale_kernel(float* d, float v, float s) {
  namespace wmma = nvcuda::wmma;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
  wmma::fill_fragment(acc, v);
  for (int i = 0; i < acc.num_elements; ++i) acc.x[i] *= s;
  wmma::store_matrix_sync(d, acc, 16, wmma::mem_row_major);
}

// ---- misuse (simulator only) ----

// The two half-warps call mma_sync at two different lines.
__global__ void diverged_mma_kernel(const __nv_bfloat16* a, float* d) {
  namespace wmma = nvcuda::wmma;
  wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa;
  wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> fb;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
  wmma::fill_fragment(acc, 0.0f);
  wmma::load_matrix_sync(fa, a, 16);
  wmma::load_matrix_sync(fb, a, 16);
  if (threadIdx.x % 32 < 16) {
    wmma::mma_sync(acc, fa, fb, acc);  // @diverged_low
  } else {
    wmma::mma_sync(acc, fa, fb, acc);  // @diverged_high
  }
  wmma::store_matrix_sync(d, acc, 16, wmma::mem_row_major);
}

// Lane 3 returns before the load its warp-mates execute.
__global__ void returned_lane_kernel(const __half* a, float* d) {
  namespace wmma = nvcuda::wmma;
  if (threadIdx.x % 32 == 3) return;
  wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> fa;
  wmma::load_matrix_sync(fa, a, 16);  // @returned_lane
  d[threadIdx.x] = __half2float(fa.x[0]);
}

// A leading dimension that is not a multiple of 8 elements (16 bytes) of a 16-bit type.
__global__ void bad_ldm_kernel(const __nv_bfloat16* a, float* d) {
  namespace wmma = nvcuda::wmma;
  wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa;
  wmma::load_matrix_sync(fa, a, 20);  // @bad_ldm
  d[threadIdx.x] = __bfloat162float(fa.x[0]);
}

// A float store whose leading dimension is not a multiple of 4 elements.
__global__ void bad_store_ldm_kernel(float* d) {
  namespace wmma = nvcuda::wmma;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
  wmma::fill_fragment(acc, 1.0f);
  wmma::store_matrix_sync(d, acc, 18, wmma::mem_row_major);  // @bad_store_ldm
}

// Lanes pass different leading dimensions (each valid on its own).
__global__ void nonuniform_ldm_kernel(const __half* a, float* d) {
  namespace wmma = nvcuda::wmma;
  wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::row_major> fb;
  wmma::load_matrix_sync(fb, a, threadIdx.x % 32 == 9 ? 32 : 16);  // @nonuniform_ldm
  d[threadIdx.x] = __half2float(fb.x[0]);
}

// A matrix pointer that is not 32-byte aligned.
__global__ void misaligned_kernel(const __half* a, float* d) {
  namespace wmma = nvcuda::wmma;
  wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::col_major> fa;
  wmma::load_matrix_sync(fa, a + 8, 16);  // @misaligned
  d[threadIdx.x] = __half2float(fa.x[0]);
}

// A block of 48 threads: its second warp has 16 lanes.
__global__ void partial_warp_kernel(float* d) {
  namespace wmma = nvcuda::wmma;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
  wmma::fill_fragment(acc, 2.0f);
  wmma::store_matrix_sync(d + (threadIdx.x / 32) * 256, acc, 16, wmma::mem_row_major);  // @partial_warp
}

}  // namespace wmma_kernels
