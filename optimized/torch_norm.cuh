/* LayerNorm and RMSNorm forward (reference/torch_norm.h; megatron/core/transformer/torch_norm.py).
 *
 * Design: one row per warp when the row is short (<= 1024 elements: qk-layernorm over kv_channels,
 * small hidden sizes; up to 4 rows per 128-thread block, shuffle-only reductions, no barrier), one row per
 * block otherwise (256 threads, warp shuffles + one shared-memory step). Statistics in fp32:
 * LayerNorm takes the mean first, then the biased variance of (x - mean) (two passes over the row,
 * which stays in L1/L2; no catastrophic cancellation of E[x^2] - mean^2). The output is stored once
 * in T; RMSNorm also stores x * rstd in T before the weight multiply, as torch's rms_norm does.
 * Rows are addressed through NormRows so the same kernel normalises the q and k heads in place
 * inside the fused linear_qkv output (qk-layernorm) without copying them out. */
#pragma once

#include "kernel_common.cuh"

namespace twin::opt::TWIN_BACKEND {

// Row r starts at (r / rows_per_chunk) * chunk_stride + (r % rows_per_chunk) * row_stride
// elements from the base pointer and holds `width` contiguous elements.
struct NormRows {
  std::int64_t n_rows = 0;
  int width = 0;
  std::int64_t rows_per_chunk = 1;
  std::int64_t chunk_stride = 0;
  std::int64_t row_stride = 0;
  __host__ __device__ std::int64_t offset(std::int64_t r) const {
    return (r / rows_per_chunk) * chunk_stride + (r % rows_per_chunk) * row_stride;
  }
  static NormRows dense(std::int64_t n_rows, int width) { return NormRows{n_rows, width, 1, width, 0}; }
};

constexpr int kNormWarpRowsPerBlock = 4;
constexpr int kNormBlockThreads = 256;

// The lanes of one row: a warp (WARP_ROW) or the block. Returns the sum over the row's lanes.
template <bool WARP_ROW>
__device__ inline float row_sum(float v, float* scratch) {
  if (WARP_ROW) return warp_sum(v);
  return block_sum(v, scratch);
}

template <class T, bool WARP_ROW>
__global__ void layernorm_forward_kernel(const T* x, T* y, const T* weight, const T* bias, NormRows rows, float eps,
                                         bool zero_centered_gamma) {
  __shared__ float scratch[32];
  const int lanes = WARP_ROW ? 32 : blockDim.x;
  const int lane = WARP_ROW ? threadIdx.x % 32 : threadIdx.x;
  const std::int64_t r = WARP_ROW ? std::int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32 : blockIdx.x;
  if (WARP_ROW && r >= rows.n_rows) return;  // whole warps leave together; no block barrier follows
  const T* xr = x + rows.offset(r);          // [width]
  T* yr = y + rows.offset(r);                // [width]
  const int n = rows.width;
  float s = 0.0f;
  for (int c = lane; c < n; c += lanes) s += Io<T>::load(xr[c]);
  const float mean = row_sum<WARP_ROW>(s, scratch) / static_cast<float>(n);
  float v = 0.0f;
  for (int c = lane; c < n; c += lanes) {
    const float d = Io<T>::load(xr[c]) - mean;
    v += d * d;
  }
  const float var = row_sum<WARP_ROW>(v, scratch) / static_cast<float>(n);
  const float rstd = 1.0f / sqrtf(var + eps);
  for (int c = lane; c < n; c += lanes) {
    const float g = Io<T>::load(weight[c]) + (zero_centered_gamma ? 1.0f : 0.0f);
    const float b = bias ? Io<T>::load(bias[c]) : 0.0f;
    yr[c] = Io<T>::store((Io<T>::load(xr[c]) - mean) * rstd * g + b);  // rounds: output, T
  }
}

template <class T, bool WARP_ROW>
__global__ void rmsnorm_forward_kernel(const T* x, T* y, const T* weight, NormRows rows, float eps,
                                       bool zero_centered_gamma) {
  __shared__ float scratch[32];
  const int lanes = WARP_ROW ? 32 : blockDim.x;
  const int lane = WARP_ROW ? threadIdx.x % 32 : threadIdx.x;
  const std::int64_t r = WARP_ROW ? std::int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32 : blockIdx.x;
  if (WARP_ROW && r >= rows.n_rows) return;
  const T* xr = x + rows.offset(r);  // [width]
  T* yr = y + rows.offset(r);        // [width]
  const int n = rows.width;
  float ss = 0.0f;
  for (int c = lane; c < n; c += lanes) {
    const float a = Io<T>::load(xr[c]);
    ss += a * a;
  }
  const float rstd = 1.0f / sqrtf(row_sum<WARP_ROW>(ss, scratch) / static_cast<float>(n) + eps);
  for (int c = lane; c < n; c += lanes) {
    const float g = Io<T>::load(weight[c]) + (zero_centered_gamma ? 1.0f : 0.0f);
    const float xhat = round_to<T>(Io<T>::load(xr[c]) * rstd);  // rounds: x * rstd, T (torch rms_norm)
    yr[c] = Io<T>::store(xhat * g);                             // rounds: output, T
  }
}

// y = norm(x) row by row; x == y (in place) is allowed. bias may be null (RMSNorm has none).
// weight/bias are [width] in dt.
inline void norm_forward(bool rms, DType dt, const void* x, void* y, const void* weight, const void* bias,
                         const NormRows& rows, double eps, bool zero_centered_gamma, cudaStream_t stream) {
  const char* op = rms ? "rmsnorm_forward" : "layernorm_forward";
  require(rows.width > 0, std::string(op) + ": row width must be > 0, got " + std::to_string(rows.width));
  require(rows.n_rows >= 0 && rows.rows_per_chunk > 0, std::string(op) + ": bad row layout");
  require(weight != nullptr, std::string(op) + ": weight is null");
  // counts: LayerNorm reduces twice (mean, variance); its stores are counted as torch 1.13's CPU
  // kernel makes them (mean, variance, rstd, the shift -rstd * mean and the output, all in T), so
  // the bound holds against goldens from that kernel too (reference/torch_norm.cpp has the
  // measurement). RMSNorm reduces once, stores rstd in fp32, x * rstd and the output in T.
  rounding_reduce((rms ? 1 : 2) * std::int64_t(rows.width));
  if (rms) rounding_store(DType::F32);
  rounding_store(dt, rms ? 2 : 5);
  // cost: x read and y written once, the weight (and bias) once; LayerNorm ~8 FLOPs per element
  // (mean, centre, square, sum, rstd, gamma, beta), RMSNorm ~4 (square, sum, rstd, gamma).
  rt::declare_cost(op, double(dtype_size(dt)) * (2.0 * rows.n_rows * rows.width + (bias ? 2 : 1) * rows.width),
                   (rms ? 4.0 : 8.0) * rows.n_rows * rows.width);
  require(x != nullptr && y != nullptr, std::string(op) + ": x / y is null");
  require(eps >= 0.0, std::string(op) + ": eps must be >= 0");
  if (rows.n_rows == 0) return;
  dispatch_dtype(dt, op, [&](auto tag) {
    using T = decltype(tag);
    const T* xx = static_cast<const T*>(x);
    T* yy = static_cast<T*>(y);
    const T* w = static_cast<const T*>(weight);
    const T* b = static_cast<const T*>(bias);
    const float e = static_cast<float>(eps);
    if (rows.width <= 1024) {
      const int warps =
          static_cast<int>(std::min<std::int64_t>(kNormWarpRowsPerBlock, rows.n_rows));  // no idle warps on tiny inputs
      const dim3 grid(ceil_div(rows.n_rows, warps)), block(32 * warps);
      if (rms)
        launch_kernel(rmsnorm_forward_kernel<T, true>, grid, block, 0, stream, xx, yy, w, rows, e, zero_centered_gamma);
      else
        launch_kernel(layernorm_forward_kernel<T, true>, grid, block, 0, stream, xx, yy, w, b, rows, e,
                      zero_centered_gamma);
    } else {
      const dim3 grid(static_cast<unsigned>(rows.n_rows)), block(kNormBlockThreads);
      if (rms)
        launch_kernel(rmsnorm_forward_kernel<T, false>, grid, block, 0, stream, xx, yy, w, rows, e,
                      zero_centered_gamma);
      else
        launch_kernel(layernorm_forward_kernel<T, false>, grid, block, 0, stream, xx, yy, w, b, rows, e,
                      zero_centered_gamma);
    }
  });
}

}  // namespace twin::opt::TWIN_BACKEND
