// cuda_check.h: turns CUDA/cuBLAS/NCCL status codes into CudaError exceptions naming the call
// (CUDA builds only).
#pragma once

#include "optimized/runtime/device.h"

#include <cuda_runtime_api.h>

#include <string>

namespace twin::rt {

inline void cuda_check(cudaError_t err, const std::string& call) {
  if (err != cudaSuccess) throw CudaError(call + ": " + cudaGetErrorName(err) + ": " + cudaGetErrorString(err));
}

}  // namespace twin::rt
