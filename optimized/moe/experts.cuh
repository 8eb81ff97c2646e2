/* The routed experts as grouped GEMMs (reference/moe/experts.h SequentialMLP; Megatron's
 * GroupedMLP computes the same function with one grouped GEMM per linear).
 *
 * Design: all local experts' linear_fc1 run as ONE grouped GEMM over the expert-major permuted
 * rows (group e = the tokens_per_expert[e] rows of expert e against its weight), then one fused
 * element-wise pass: the expert's fc1 bias, the activation (GLU), and the routing probability of
 * the row (Megatron's per_token_scale: the probability multiplies the activation, stored in T);
 * then ONE grouped GEMM for linear_fc2 and, with biases, one pass adding bias * probability.
 * Group sizes are host values (tokens per expert downloaded after routing), as Megatron's grouped
 * MLP syncs them: the GEMM interface's run_grouped validates every group first, then runs the
 * simulator's GEMM per group, or on the GPU one cuBLASLt matmul per group (gemm_cublaslt.cpp; a
 * single cublasGemmGroupedBatchedEx call is not wired in yet). Each row's expert is
 * found from the expert offsets (a few experts: a linear scan). The rounding points are those of
 * the reference's MLP (bias add, activation, GLU product, scale, each stored in T). */
#pragma once

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

#include "optimized/activations.cuh"
#include "optimized/linear.cuh"
#include "optimized/moe/router.cuh"  // RouterCompute, Io<double>
#include "optimized/runtime/gemm.h"

namespace twin::opt::TWIN_BACKEND {

// The group of row r: the e with offsets[e] <= r < offsets[e + 1].
__host__ __device__ inline int expert_of_row(const std::int64_t* offsets, int E, std::int64_t r) {
  int e = 0;
  while (e + 1 < E && offsets[e + 1] <= r) ++e;
  return e;
}

// in: [N, glu ? 2 f : f] (fc1 output, rows grouped by expert); bias: [E, glu ? 2 f : f] or null;
// scale: [N] in the router dtype R or null. out: [N, f].
template <class T, class R>
__global__ void grouped_bias_activation_kernel(const T* in, const T* bias, const R* scale, T* out,
                                               const std::int64_t* offsets, int E, std::int64_t n, int f, Act act,
                                               bool glu) {
  const int in_width = glu ? 2 * f : f;
  const std::int64_t total = n * f;
  for (std::int64_t i = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += std::int64_t(gridDim.x) * blockDim.x) {
    const std::int64_t r = i / f;
    const int c = static_cast<int>(i % f);
    const T* row = in + r * in_width;
    const T* b = bias ? bias + std::int64_t(expert_of_row(offsets, E, r)) * in_width : nullptr;
    float a = Io<T>::load(row[c]);
    if (b) a = round_to<T>(a + Io<T>::load(b[c]));  // rounds: intermediate + bias, T
    float y = activation<T>(act, a);
    if (glu) {
      float lin = Io<T>::load(row[f + c]);
      if (b) lin = round_to<T>(lin + Io<T>::load(b[f + c]));  // rounds: intermediate + bias, T
      y = round_to<T>(y * lin);                               // rounds: act(x_glu) * x_linear, T
    }
    if (scale) {  // rounds: (x * per_token_scale).to(T), the product in the promoted dtype
      if constexpr (std::is_same<R, double>::value)
        y = static_cast<float>(static_cast<double>(y) * scale[r]);
      else
        y = y * Io<R>::load(scale[r]);
    }
    out[i] = Io<T>::store(y);
  }
}

// out[r, :] += bias[expert(r), :] * scale[r], the product in the promoted dtype, the sum in T.
template <class T, class R>
__global__ void grouped_scaled_bias_add_kernel(T* out, const T* bias, const R* scale, const std::int64_t* offsets,
                                               int E, std::int64_t n, int h) {
  const std::int64_t total = n * h;
  for (std::int64_t i = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += std::int64_t(gridDim.x) * blockDim.x) {
    const std::int64_t r = i / h;
    const int c = static_cast<int>(i % h);
    const float b = Io<T>::load(bias[std::int64_t(expert_of_row(offsets, E, r)) * h + c]);
    float prod;
    if constexpr (std::is_same<R, double>::value)
      prod = static_cast<float>(b * scale[r]);
    else if constexpr (std::is_same<R, float>::value)
      prod = b * scale[r];  // rounds: fp32 product
    else
      prod = round_to<T>(b * Io<R>::load(scale[r]));    // rounds: product in T
    out[i] = Io<T>::store(Io<T>::load(out[i]) + prod);  // rounds: sum, T
  }
}

template <class F>
void dispatch_scale_dtype(DType rdt, const char* op, F&& f) {
  if (rdt == DType::F64) return f(double{});
  dispatch_dtype(rdt, op, std::forward<F>(f));
}

inline void grouped_bias_activation_forward(DType dt, DType rdt, const void* in, const void* bias, const void* scale,
                                            void* out, const std::int64_t* offsets, int E, std::int64_t n, int f,
                                            Act act, bool glu, cudaStream_t stream) {
  require(n >= 0 && f > 0 && E > 0, "grouped_bias_activation_forward: bad shape n=" + std::to_string(n) +
                                        " f=" + std::to_string(f) + " E=" + std::to_string(E));
  require(n == 0 || (in && out && in != out), "grouped_bias_activation_forward: null or aliased in / out");
  // counts: the bias add, the activation's stores on its longest path, the GLU product, the scale.
  const int act_stores = act == Act::Silu || act == Act::QuickGelu ? 3 : act == Act::Relu ? 0 : 1;
  rounding_store(dt, (bias ? 1 : 0) + act_stores + (glu ? 1 : 0) + (scale ? 1 : 0));
  // cost: the grouped fc1 output [n, (glu ? 2 : 1) f] read, [n, f] written, every expert's bias
  // once, a scale per row; ~8 FLOPs per output element, as the dense bias_activation.
  const double in_width = (glu ? 2.0 : 1.0) * f, e = dtype_size(dt);
  rt::declare_cost("grouped_bias_activation_forward",
                   e * (double(n) * (in_width + f) + (bias ? double(E) * in_width : 0.0)) +
                       (scale ? double(n) * (rdt == DType::F64 ? 8 : dtype_size(rdt)) : 0.0),
                   8.0 * n * f);
  if (n == 0) return;
  dispatch_dtype(dt, "grouped_bias_activation_forward", [&](auto a) {
    using T = decltype(a);
    dispatch_scale_dtype(rdt, "grouped_bias_activation_forward", [&](auto b) {
      using R = decltype(b);
      const unsigned threads = elementwise_threads(n * f);
      launch_kernel(grouped_bias_activation_kernel<T, R>, dim3(elementwise_blocks(n * f, threads)), dim3(threads), 0,
                    stream, static_cast<const T*>(in), static_cast<const T*>(bias), static_cast<const R*>(scale),
                    static_cast<T*>(out), offsets, E, n, f, act, glu);
    });
  });
}

inline void grouped_scaled_bias_add_forward(DType dt, DType rdt, void* out, const void* bias, const void* scale,
                                            const std::int64_t* offsets, int E, std::int64_t n, int h,
                                            cudaStream_t stream) {
  require(bias && scale && out, "grouped_scaled_bias_add_forward: null buffer");
  rounding_store(dt);  // counts: the sum (the product is a branch from parameters and scales)
  // cost: out [n, h] read and written, every expert's bias once, a scale per row; a multiply-add.
  rt::declare_cost(
      "grouped_scaled_bias_add_forward",
      double(dtype_size(dt)) * (2.0 * n * h + double(E) * h) + double(n) * (rdt == DType::F64 ? 8 : dtype_size(rdt)),
      2.0 * n * h);
  if (n == 0) return;
  dispatch_dtype(dt, "grouped_scaled_bias_add_forward", [&](auto a) {
    using T = decltype(a);
    dispatch_scale_dtype(rdt, "grouped_scaled_bias_add_forward", [&](auto b) {
      using R = decltype(b);
      const unsigned threads = elementwise_threads(n * h);
      launch_kernel(grouped_scaled_bias_add_kernel<T, R>, dim3(elementwise_blocks(n * h, threads)), dim3(threads), 0,
                    stream, static_cast<T*>(out), static_cast<const T*>(bias), static_cast<const R*>(scale), offsets, E,
                    n, h);
    });
  });
}

// One GEMM per expert over its rows, as one grouped call (the simulator runs the same interface
// per group): group(e, row, n) gives expert e's GemmArgs for its n rows from `row` on (the rows
// grouped by expert, tokens_per_expert host sizes), or nothing to leave the expert out.
template <class Group>
void run_expert_gemms(rt::Backend backend, const std::vector<std::int64_t>& tokens_per_expert, Group group,
                      cudaStream_t stream) {
  std::vector<rt::GemmArgs> groups;
  std::int64_t row = 0;
  for (std::size_t e = 0; e < tokens_per_expert.size(); ++e) {
    if (const std::optional<rt::GemmArgs> g = group(e, row, tokens_per_expert[e])) groups.push_back(*g);
    row += tokens_per_expert[e];
  }
  if (!groups.empty()) rt::gemm(backend).run_grouped(groups, stream);
}

// y[rows_e, out] = x[rows_e, in] @ w_e[out, in]^T for every expert e, as one grouped GEMM: groups
// follow the host-side tokens_per_expert (row-major torch Linear as column-major cuBLAS, see
// runtime/gemm.h, linear_uncounted's form). w: [E, out, in] contiguous.
inline void grouped_linear_forward(rt::Backend backend, DType dt, const void* x, const void* w, void* y,
                                   const std::vector<std::int64_t>& tokens_per_expert, std::int64_t in,
                                   std::int64_t out, cudaStream_t stream) {
  const std::size_t es = dtype_size(dt);
  run_expert_gemms(
      backend, tokens_per_expert,
      [&](std::size_t e, std::int64_t row, std::int64_t n) -> std::optional<rt::GemmArgs> {
        return linear_gemm_args(dt, rt::Op::T, static_cast<const char*>(w) + e * std::size_t(out) * in * es, in,
                                rt::Op::N, static_cast<const char*>(x) + std::size_t(row) * in * es, in,
                                static_cast<char*>(y) + std::size_t(row) * out * es, out, n, in);
      },
      stream);
  // counts: one fp32-accumulated reduction of length in, stored once in T
  rounding_reduce(in);
  rounding_store(dt);
}

// ---- backward (reference SequentialMLP::backward: each expert's MLP backward with its
// per_token_scale, on its slice of the expert-major rows) -------------------------------------------

// One thread per row r of expert rows [n, f]: the forward's activation recomputed from the fc1
// output `in` [n, w] (w = glu ? 2 f : f) with the forward's code (so it is the forward's bits),
// then, from dy [n, f] (the gradient of the scaled activation):
//   d scale[r] = sum_j dy[r, j] act[r, j] (fp32, j ascending), stored in the scale's dtype R;
//   d act = dy * scale stored in T; then the activation's (GLU's) backward into din [n, w].
template <class T, class R>
__global__ void grouped_scaled_activation_backward_kernel(const T* in, const R* scale, const T* dy, T* din, R* dscale,
                                                          std::int64_t n, int f, Act act, bool glu) {
  const int w = glu ? 2 * f : f;
  for (std::int64_t r = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; r < n;
       r += std::int64_t(gridDim.x) * blockDim.x) {
    const T* row = in + r * w;  // [w]
    T* drow = din + r * w;      // [w]
    const RouterCompute<R> s = Io<R>::load(scale[r]);
    RouterCompute<R> ds = 0;
    for (int c = 0; c < f; ++c) {
      const float a = Io<T>::load(row[c]);
      const float lin = glu ? Io<T>::load(row[f + c]) : 0.0f;
      const float y = glu ? round_to<T>(activation<T>(act, a) * lin) : activation<T>(act, a);  // the forward's
      const float g0 = Io<T>::load(dy[r * f + c]);
      ds += static_cast<RouterCompute<R>>(g0) * y;
      float g = round_to<T>(static_cast<float>(g0 * s));  // rounds: grad * per_token_scale, T
      if (glu) {
        drow[f + c] = Io<T>::store(g * activation<T>(act, a));  // rounds: mul's grad of x_linear, T
        g = round_to<T>(g * lin);                               // rounds: mul's grad of act(x_glu), T
      }
      drow[c] = Io<T>::store(g * activation_grad(act, a));  // rounds: dy act'(x), T
    }
    dscale[r] = Io<R>::store(ds);  // rounds: (grad * act).sum(-1) in the scale's dtype
  }
}

// The routed experts' activation backward with the routing probabilities as per_token_scale:
// in [n, (glu ? 2 : 1) f] the grouped fc1 output (no fc1 bias: the backward refuses expert
// biases), scale [n] in rdt, dy [n, f] -> din [n, (glu ? 2 : 1) f], dscale [n] in rdt.
inline void grouped_scaled_activation_backward(DType dt, DType rdt, const void* in, const void* scale, const void* dy,
                                               void* din, void* dscale, std::int64_t n, int f, Act act, bool glu,
                                               cudaStream_t stream) {
  require(n >= 0 && f > 0,
          "grouped_scaled_activation_backward: bad shape n=" + std::to_string(n) + " f=" + std::to_string(f));
  require(n == 0 || (in && scale && dy && din && dscale && din != dy && din != in),
          "grouped_scaled_activation_backward: null or aliased buffer");
  // counts: as the reference MLP::backward with per_token_scale: grad * scale stored in T, the
  // reduction over f stored in the scale's dtype (fp32 for an fp32 / fp64 scale), then the
  // activation's backward (GLU's mul stored in T, the activation's stores).
  const bool scale_fp32 = rdt == DType::F32 || rdt == DType::F64;
  rounding_store(dt);
  rounding_reduce(f);
  rounding_store(scale_fp32 ? DType::F32 : dt);
  rounding_store(dt, (glu ? 1 : 0) + activation_grad_stores(act));
  // cost: fc1's output [n, w] and dy [n, f] read, din [n, w] written, a scale read and written per
  // row; ~20 FLOPs per element (the recomputed forward, act', the products, the sum).
  const double w = (glu ? 2.0 : 1.0) * f, rs = rdt == DType::F64 ? 8.0 : double(dtype_size(rdt));
  rt::declare_cost("grouped_scaled_activation_backward",
                   double(dtype_size(dt)) * double(n) * (2.0 * w + f) + 2.0 * rs * double(n), 20.0 * n * f);
  if (n == 0) return;
  dispatch_dtype(dt, "grouped_scaled_activation_backward", [&](auto a) {
    using T = decltype(a);
    dispatch_scale_dtype(rdt, "grouped_scaled_activation_backward", [&](auto b) {
      using R = decltype(b);
      const unsigned threads = elementwise_threads(n);
      launch_kernel(grouped_scaled_activation_backward_kernel<T, R>, dim3(elementwise_blocks(n, threads)),
                    dim3(threads), 0, stream, static_cast<const T*>(in), static_cast<const R*>(scale),
                    static_cast<const T*>(dy), static_cast<T*>(din), static_cast<R*>(dscale), n, f, act, glu);
    });
  });
}

// dx[rows_e, in] = dy[rows_e, out] @ w_e[out, in] for every expert e, as one grouped GEMM (each
// group linear_backward_dgrad's column-major form). An expert without rows has no group.
inline void grouped_linear_backward_dgrad(rt::Backend backend, DType dt, const void* dy, const void* w, void* dx,
                                          const std::vector<std::int64_t>& tokens_per_expert, std::int64_t in,
                                          std::int64_t out, cudaStream_t stream) {
  const std::size_t es = dtype_size(dt);
  run_expert_gemms(
      backend, tokens_per_expert,
      [&](std::size_t e, std::int64_t row, std::int64_t n) -> std::optional<rt::GemmArgs> {
        if (n == 0) return std::nullopt;
        return linear_gemm_args(dt, rt::Op::N, static_cast<const char*>(w) + e * std::size_t(out) * in * es, in,
                                rt::Op::N, static_cast<const char*>(dy) + std::size_t(row) * out * es, out,
                                static_cast<char*>(dx) + std::size_t(row) * in * es, in, n, out);
      },
      stream);
  // counts: one fp32-accumulated reduction of length out, stored once in T
  rounding_reduce(out);
  rounding_store(dt);
}

// dw_e[out, in] = scale * dy[rows_e, out]^T @ x[rows_e, in] for every expert e, as one grouped
// GEMM (scale in fp32 on the accumulated sum, as the GEMM's alpha); an expert without rows gets
// zeros (its module still ran, on no tokens). dw: [E, out, in].
inline void grouped_linear_backward_wgrad(rt::Backend backend, DType dt, const void* dy, const void* x, void* dw,
                                          const std::vector<std::int64_t>& tokens_per_expert, std::int64_t in,
                                          std::int64_t out, float scale, cudaStream_t stream) {
  const std::size_t es = dtype_size(dt);
  run_expert_gemms(
      backend, tokens_per_expert,
      [&](std::size_t e, std::int64_t row, std::int64_t n) -> std::optional<rt::GemmArgs> {
        rt::GemmArgs g = linear_gemm_args(dt, rt::Op::N, static_cast<const char*>(x) + std::size_t(row) * in * es, in,
                                          rt::Op::T, static_cast<const char*>(dy) + std::size_t(row) * out * es, out,
                                          static_cast<char*>(dw) + e * std::size_t(out) * in * es, in, out, n);
        g.alpha = scale;
        return g;
      },
      stream);  // k == 0 gives D = 0
  const std::int64_t most =
      tokens_per_expert.empty() ? 0 : *std::max_element(tokens_per_expert.begin(), tokens_per_expert.end());
  // counts: the fp32 reduction over an expert's rows (the longest), the scale's fp32 product
  // unless it is a power of two (exact), stored in the param dtype
  rounding_reduce(most);
  int exponent = 0;
  if (std::frexp(scale, &exponent) != 0.5f) rounding_store(DType::F32);
  rounding_store(dt);
}

}  // namespace twin::opt::TWIN_BACKEND
