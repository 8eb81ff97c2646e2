// oob_kernels.cuh: an out-of-bounds global write (off by one), which the AddressSanitizer build
// must report with this file and the line marked `// @oob_write`.
#pragma once

#include "cuda_compat.h"

namespace oob {

inline const char* source_file() { return __FILE__; }

__global__ void off_by_one_write_forward_kernel(float* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i <= n) out[i] = 1.0f;  // @oob_write
}

}  // namespace oob
