// graph_kernels.cuh: three elementwise kernels run eagerly and from a captured graph.
#pragma once

#include "cuda_compat.h"

namespace graphk {

// y[i] = a * x[i]
__global__ void scale_forward_kernel(const float* x, float* y, float a, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = a * x[i];
}

// y[i] += bias[i % h]   (y is [n / h, h])
__global__ void add_bias_forward_kernel(float* y, const float* bias, int h, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] += bias[i % h];
}

// out[i] = bf16(tanh(y[i]) * y[i])
__global__ void tanh_mul_forward_kernel(const float* y, __nv_bfloat16* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = __float2bfloat16(tanhf(y[i]) * y[i]);
}

}  // namespace graphk
