/* LayerNorm and RMSNorm forward (reference/torch_norm.h; megatron/core/transformer/torch_norm.py).
 *
 * Design: one row per warp when the row is short (<= 1024 elements: qk-layernorm over kv_channels,
 * small hidden sizes; up to 4 rows per 128-thread block, shuffle-only reductions, no barrier), one row per
 * block otherwise (256 threads, warp shuffles + one shared-memory step). Statistics in fp32:
 * LayerNorm takes the mean first, then the biased variance of (x - mean) (two passes over the row,
 * which stays in L1/L2; no catastrophic cancellation of E[x^2] - mean^2). The output is stored once
 * in T; RMSNorm also stores x * rstd in T before the weight multiply, as torch's rms_norm does.
 * Rows are addressed through NormRows so the same kernel normalises the q and k heads in place
 * inside the fused linear_qkv output (qk-layernorm) without copying them out.
 *
 * Backward (reference Norm::backward; torch's layer_norm_backward and rms_norm's autograd graph):
 * dx by the forward's row layout (warp or block rows), the statistics recomputed from x by the
 * forward's very code (so they are the forward's bits) and kept in an fp32 workspace [n_rows];
 * LayerNorm dx = rstd (dxhat - mean(dxhat) - xhat mean(dxhat xhat)), dxhat = dy gamma, all in
 * fp32 and stored once in T; RMSNorm stores dxhat = dy gamma in T (mul's grad), then
 * dx = rstd dxhat - x rstd^3 mean(dxhat x) in fp32, stored in T. dgamma (and dbeta) are sums over
 * the rows, in fp32 with a fixed order (kernel_common.cuh column_sums: per-chunk partials, then
 * one reduction), so two runs are bitwise equal; RMSNorm's per-row product dy x_hat is stored in T
 * before the sum, as its autograd graph stores the mul's grad. */
#pragma once

#include "kernel_common.cuh"

namespace twin::opt::TWIN_BACKEND {

constexpr int kNormWarpRowsPerBlock = 4;
constexpr int kNormBlockThreads = 256;

// The lanes of one row: a warp (WARP_ROW) or the block. Returns the sum over the row's lanes.
template <bool WARP_ROW>
__device__ inline float row_sum(float v, float* scratch) {
  if (WARP_ROW) return warp_sum(v);
  return block_sum(v, scratch);
}

// A row's statistics in fp32 over its lanes, the forward's and the backward's alike (the backward
// recomputes them): LayerNorm's mean and rstd = 1 / sqrt(var + eps) (biased variance), RMSNorm's
// rstd = 1 / sqrt(mean(x^2) + eps).
template <class T, bool WARP_ROW>
__device__ inline void layernorm_row_stats(const T* xr, int n, int lane, int lanes, float eps, float* scratch,
                                           float& mean, float& rstd) {
  float s = 0.0f;
  for (int c = lane; c < n; c += lanes) s += Io<T>::load(xr[c]);
  mean = row_sum<WARP_ROW>(s, scratch) / static_cast<float>(n);
  float v = 0.0f;
  for (int c = lane; c < n; c += lanes) {
    const float d = Io<T>::load(xr[c]) - mean;
    v += d * d;
  }
  rstd = 1.0f / sqrtf(row_sum<WARP_ROW>(v, scratch) / static_cast<float>(n) + eps);
}
template <class T, bool WARP_ROW>
__device__ inline float rmsnorm_row_rstd(const T* xr, int n, int lane, int lanes, float eps, float* scratch) {
  float ss = 0.0f;
  for (int c = lane; c < n; c += lanes) {
    const float a = Io<T>::load(xr[c]);
    ss += a * a;
  }
  return 1.0f / sqrtf(row_sum<WARP_ROW>(ss, scratch) / static_cast<float>(n) + eps);
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
  float mean, rstd;
  layernorm_row_stats<T, WARP_ROW>(xr, n, lane, lanes, eps, scratch, mean, rstd);
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
  const float rstd = rmsnorm_row_rstd<T, WARP_ROW>(xr, n, lane, lanes, eps, scratch);
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

// ---- backward -----------------------------------------------------------------------------------
// dy, x, dx: rows of the forward's layout; mean / rstd: [n_rows] fp32 (mean unused by RMSNorm).
template <class T, bool WARP_ROW>
__global__ void layernorm_backward_kernel(const T* dy, const T* x, T* dx, const T* weight, NormRows rows, float eps,
                                          bool zero_centered_gamma, float* mean_out, float* rstd_out) {
  __shared__ float scratch[32];
  const int lanes = WARP_ROW ? 32 : blockDim.x;
  const int lane = WARP_ROW ? threadIdx.x % 32 : threadIdx.x;
  const std::int64_t r = WARP_ROW ? std::int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32 : blockIdx.x;
  if (WARP_ROW && r >= rows.n_rows) return;  // whole warps leave together; no block barrier follows
  const T* xr = x + rows.offset(r);          // [width]
  const T* dyr = dy + rows.offset(r);        // [width]
  T* dxr = dx + rows.offset(r);              // [width]
  const int n = rows.width;
  float mean, rstd;  // the forward's statistics, by the forward's code
  layernorm_row_stats<T, WARP_ROW>(xr, n, lane, lanes, eps, scratch, mean, rstd);
  // mean(dxhat) and mean(dxhat xhat) over the row
  float s1 = 0.0f, s2 = 0.0f;
  for (int c = lane; c < n; c += lanes) {
    const float g = Io<T>::load(weight[c]) + (zero_centered_gamma ? 1.0f : 0.0f);
    const float dxhat = Io<T>::load(dyr[c]) * g;
    s1 += dxhat;
    s2 += dxhat * ((Io<T>::load(xr[c]) - mean) * rstd);
  }
  const float m1 = row_sum<WARP_ROW>(s1, scratch) / static_cast<float>(n);
  const float m2 = row_sum<WARP_ROW>(s2, scratch) / static_cast<float>(n);
  for (int c = lane; c < n; c += lanes) {
    const float g = Io<T>::load(weight[c]) + (zero_centered_gamma ? 1.0f : 0.0f);
    const float xhat = (Io<T>::load(xr[c]) - mean) * rstd;
    dxr[c] = Io<T>::store(rstd * (Io<T>::load(dyr[c]) * g - m1 - xhat * m2));  // rounds: dx, T
  }
  if (lane == 0) {
    mean_out[r] = mean;
    rstd_out[r] = rstd;
  }
}

template <class T, bool WARP_ROW>
__global__ void rmsnorm_backward_kernel(const T* dy, const T* x, T* dx, const T* weight, NormRows rows, float eps,
                                        bool zero_centered_gamma, float* rstd_out) {
  __shared__ float scratch[32];
  const int lanes = WARP_ROW ? 32 : blockDim.x;
  const int lane = WARP_ROW ? threadIdx.x % 32 : threadIdx.x;
  const std::int64_t r = WARP_ROW ? std::int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32 : blockIdx.x;
  if (WARP_ROW && r >= rows.n_rows) return;
  const T* xr = x + rows.offset(r);    // [width]
  const T* dyr = dy + rows.offset(r);  // [width]
  T* dxr = dx + rows.offset(r);        // [width]
  const int n = rows.width;
  const float rstd = rmsnorm_row_rstd<T, WARP_ROW>(xr, n, lane, lanes, eps, scratch);
  float s = 0.0f;
  for (int c = lane; c < n; c += lanes) {
    const float g = Io<T>::load(weight[c]) + (zero_centered_gamma ? 1.0f : 0.0f);
    s += round_to<T>(Io<T>::load(dyr[c]) * g) * Io<T>::load(xr[c]);  // rounds: dxhat = dy * weight, T
  }
  const float m = row_sum<WARP_ROW>(s, scratch) / static_cast<float>(n);  // mean(dxhat x), fp32
  for (int c = lane; c < n; c += lanes) {
    const float g = Io<T>::load(weight[c]) + (zero_centered_gamma ? 1.0f : 0.0f);
    const float dxhat = round_to<T>(Io<T>::load(dyr[c]) * g);
    dxr[c] = Io<T>::store(rstd * dxhat - Io<T>::load(xr[c]) * rstd * rstd * rstd * m);  // rounds: dx (fp32), T
  }
  if (lane == 0) rstd_out[r] = rstd;
}

// The per-element terms of dgamma (and LayerNorm's dbeta) for column_sums.
template <class T>
struct LayerNormParamGradTerms {
  const T* dy;
  const T* x;
  const float* mean;
  const float* rstd;
  NormRows rows;
  __device__ void operator()(std::int64_t r, int c, float* v) const {
    const std::int64_t o = rows.offset(r) + c;
    const float g = Io<T>::load(dy[o]);
    v[0] = g * ((Io<T>::load(x[o]) - mean[r]) * rstd[r]);  // dy x_hat
    v[1] = g;                                              // dy
  }
};
template <class T>
struct RMSNormParamGradTerms {
  const T* dy;
  const T* x;
  const float* rstd;
  NormRows rows;
  __device__ void operator()(std::int64_t r, int c, float* v) const {
    const std::int64_t o = rows.offset(r) + c;
    const float xhat = round_to<T>(Io<T>::load(x[o]) * rstd[r]);  // the forward's stored x * rstd
    v[0] = round_to<T>(Io<T>::load(dy[o]) * xhat);                // rounds: mul's grad of the weight, T
  }
};

// Workspace norm_backward needs: the per-row statistics and the column sums' partials.
inline std::size_t norm_backward_workspace_bytes(bool rms, std::int64_t n_rows, int width) {
  return sizeof(float) * 2 * std::size_t(std::max<std::int64_t>(n_rows, 1)) +
         column_sum_workspace_bytes(rms ? 1 : 2, n_rows, width);
}

// Gradients of norm_forward: dx (rows of `rows`' layout, like dy and x; must not alias them: the
// parameter grads read dy and x after dx is written), dweight [width] and, for LayerNorm with a
// bias, dbias [width] (null: not computed; RMSNorm has none). x is the forward's input.
inline void norm_backward(bool rms, DType dt, const void* dy, const void* x, void* dx, const void* weight,
                          void* dweight, void* dbias, const NormRows& rows, double eps, bool zero_centered_gamma,
                          void* workspace, std::size_t workspace_bytes, cudaStream_t stream) {
  const char* op = rms ? "rmsnorm_backward" : "layernorm_backward";
  require(rows.width > 0, std::string(op) + ": row width must be > 0, got " + std::to_string(rows.width));
  require(rows.n_rows >= 0 && rows.rows_per_chunk > 0, std::string(op) + ": bad row layout");
  require(dy && x && dx && weight && dweight, std::string(op) + ": dy / x / dx / weight / dweight is null");
  require(dx != dy && dx != x, std::string(op) + ": dx must not alias dy or x (the parameter grads read them after)");
  require(!(rms && dbias), std::string(op) + ": RMSNorm has no bias to take a gradient of");
  require(eps >= 0.0, std::string(op) + ": eps must be >= 0");
  require(workspace && workspace_bytes >= norm_backward_workspace_bytes(rms, rows.n_rows, rows.width),
          std::string(op) + ": workspace of " + std::to_string(workspace_bytes) +
              " bytes is null or smaller than the " +
              std::to_string(norm_backward_workspace_bytes(rms, rows.n_rows, rows.width)) + " bytes needed");
  // counts: as the reference's backward. LayerNorm: the two row means of dx (width long each) and
  // the column sums (n_rows long), dx / dgamma / dbeta each stored once in T. RMSNorm: dxhat and
  // the weight's per-row product stored in T, mean(dxhat x) and dx in fp32, the row reduction and
  // the column sums, then dx / dgamma stored in T.
  rounding_reduce((rms ? 1 : 2) * std::int64_t(rows.width) + rows.n_rows);
  if (rms) {
    rounding_store(dt, 2);
    rounding_store(DType::F32, 2);
  }
  rounding_store(dt);
  const double esz = double(dtype_size(dt)), elems = double(rows.n_rows) * rows.width;
  // cost: dx pass: x and dy read, dx written, the weight once, the statistics written; ~12 FLOPs
  // per element (statistics, the two means, dx). The parameter grads' pass reads x and dy again.
  rt::declare_cost(op, esz * (3.0 * elems + rows.width) + 4.0 * (rms ? 1 : 2) * rows.n_rows, 12.0 * elems);
  float* stats = static_cast<float*>(workspace);
  const std::int64_t n_stats = std::max<std::int64_t>(rows.n_rows, 1);
  float* mean = stats;            // [n_rows]
  float* rstd = stats + n_stats;  // [n_rows]
  void* partials = stats + 2 * n_stats;
  const std::size_t partial_bytes = workspace_bytes - sizeof(float) * 2 * std::size_t(n_stats);
  dispatch_dtype(dt, op, [&](auto tag) {
    using T = decltype(tag);
    const T* gy = static_cast<const T*>(dy);
    const T* xx = static_cast<const T*>(x);
    T* gx = static_cast<T*>(dx);
    const T* w = static_cast<const T*>(weight);
    const float e = static_cast<float>(eps);
    if (rows.n_rows > 0) {
      if (rows.width <= 1024) {
        const int warps = static_cast<int>(std::min<std::int64_t>(kNormWarpRowsPerBlock, rows.n_rows));
        const dim3 grid(ceil_div(rows.n_rows, warps)), block(32 * warps);
        if (rms)
          launch_kernel(rmsnorm_backward_kernel<T, true>, grid, block, 0, stream, gy, xx, gx, w, rows, e,
                        zero_centered_gamma, rstd);
        else
          launch_kernel(layernorm_backward_kernel<T, true>, grid, block, 0, stream, gy, xx, gx, w, rows, e,
                        zero_centered_gamma, mean, rstd);
      } else {
        const dim3 grid(static_cast<unsigned>(rows.n_rows)), block(kNormBlockThreads);
        if (rms)
          launch_kernel(rmsnorm_backward_kernel<T, false>, grid, block, 0, stream, gy, xx, gx, w, rows, e,
                        zero_centered_gamma, rstd);
        else
          launch_kernel(layernorm_backward_kernel<T, false>, grid, block, 0, stream, gy, xx, gx, w, rows, e,
                        zero_centered_gamma, mean, rstd);
      }
    }
    // dgamma (and dbeta): x and dy read again, ~5 FLOPs per element.
    if (rms) {
      T* const outs[1] = {static_cast<T*>(dweight)};
      column_sums<T, 1>("rmsnorm_weight_grad", RMSNormParamGradTerms<T>{gy, xx, rstd, rows}, rows.n_rows, rows.width,
                        outs, partials, partial_bytes, 2.0 * esz, 4.0, stream);
    } else {
      T* const outs[2] = {static_cast<T*>(dweight), static_cast<T*>(dbias)};
      column_sums<T, 2>("layernorm_weight_grad", LayerNormParamGradTerms<T>{gy, xx, mean, rstd, rows}, rows.n_rows,
                        rows.width, outs, partials, partial_bytes, 2.0 * esz, 3.0, stream);
    }
  });
}

}  // namespace twin::opt::TWIN_BACKEND
