// oob_kernels.cuh: out-of-bounds writes (off by one) to global memory and to a thread's local
// array (which lives on the thread's fiber stack), which the AddressSanitizer build must report
// with this file and the marked line.
#pragma once

#include "cuda_compat.h"

namespace oob {

inline const char* source_file() { return __FILE__; }

__global__ void off_by_one_write_forward_kernel(float* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i <= n) out[i] = 1.0f;  // @oob_write
}

// Thread `bad` writes one element past its local array. Through a pointer: UBSan's bounds check
// (which stops the test at its first report) sees only indexing of an array type, so the write
// past the fiber stack's array is left for ASan to report.
__global__ void local_array_overflow_forward_kernel(float* out, int bad) {
  float local[8];
  const int t = threadIdx.x;
  for (int i = 0; i < 8; ++i) local[i] = static_cast<float>(t + i);
  float* slot = local + (t == bad ? 8 : t % 8);
  *slot = 1.0f;  // @oob_local
  out[t] = local[t % 8];
}

}  // namespace oob
