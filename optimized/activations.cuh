/* Bias + activation forward, fused (reference/activations.h and mlp.py's forward between
 * linear_fc1 and linear_fc2): y = act(fc1 + bias), or with a gated linear unit
 * y = act(x_glu + b_glu) * (x_linear + b_linear) over the two halves of fc1's output.
 *
 * Design: one element-wise pass reading fc1's GEMM output once and writing the ffn-wide input of
 * linear_fc2 once (the unfused graph makes up to four passes). Inside, the stores of the unfused
 * torch graph are kept as rounding points (bias add in T, activation output in T, GLU product in
 * T), so relu and squared_relu have the reference's bits (every rounding point is one IEEE
 * operation); gelu, silu and quick_gelu call fp32 erff / expf and gelu and quick_gelu evaluate in
 * several fp32 operations what the reference rounds once, so they agree within a few ulp of T
 * (tests/optimized/test_ops.cpp). With tensor parallelism each rank holds
 * [its columns of the GLU half | its columns of the linear half], the layout linear_fc1's column
 * split produces, so the kernel is the same at every TP size.
 *
 * Backward (reference activation_backward / glu_backward; torch's gelu_backward, silu_backward,
 * threshold_backward and the composed forms' autograd): one element-wise pass from fc1's output,
 * its bias and dy to d(fc1 output + bias) [n, (glu ? 2 : 1) f], which is both fc1's dgrad GEMM
 * input and the summand of its bias grad (linear.cuh bias_grad). The biased input is recomputed
 * as the forward stored it; with a GLU, act(x_glu) is recomputed by the forward's activation()
 * (its stores), the mul's two grads dy x_linear and dy act(x_glu) are stored in T, then
 * act'(x_glu) is applied in fp32 and stored once, as torch's single-kernel backwards do. */
#pragma once

#include "kernel_common.cuh"
#include "optimized/layer/kernel_types.h"  // Act, act_from_name

namespace twin::opt::TWIN_BACKEND {

// act(x) in fp32 with the rounding points of reference/activations.cpp.
template <class T>
__device__ inline float activation(Act a, float x) {
  switch (a) {
    case Act::Gelu:
      return round_to<T>(x * 0.5f * (1.0f + erff(x * 0.70710678118654752f)));  // rounds: output
    case Act::Silu:  // torch 1.13's CPU silu: x / (1 + exp(-x)), each op stored in T (reference/activations.cpp)
      return round_to<T>(x / round_to<T>(1.0f + round_to<T>(expf(-x))));  // rounds: exp(-x), 1 + ..., x / ...
    case Act::Relu:
      return x > 0.0f ? x : 0.0f;  // exact
    case Act::SquaredRelu: {
      const float r = x > 0.0f ? x : 0.0f;
      return round_to<T>(r * r);  // rounds: pow(relu(x), 2)
    }
    case Act::QuickGelu: {
      const float s = round_to<T>(1.0f / (1.0f + expf(-round_to<T>(1.702f * x))));  // rounds: 1.702 x, sigmoid
      return round_to<T>(x * s);                                                    // rounds: product
    }
  }
  return x;
}

// in: [n, glu ? 2 f : f] (fc1 output), bias: [glu ? 2 f : f] or null, out: [n, f].
template <class T>
__global__ void bias_activation_forward_kernel(const T* in, const T* bias, T* out, std::int64_t n, int f, Act act,
                                               bool glu) {
  const int in_width = glu ? 2 * f : f;
  const std::int64_t total = n * f;
  for (std::int64_t e = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += std::int64_t(gridDim.x) * blockDim.x) {
    const std::int64_t r = e / f;
    const int c = static_cast<int>(e % f);
    const T* row = in + r * in_width;  // [in_width]
    float a = Io<T>::load(row[c]);
    if (bias) a = round_to<T>(a + Io<T>::load(bias[c]));  // rounds: intermediate + bias, T
    float y = activation<T>(act, a);
    if (glu) {
      float lin = Io<T>::load(row[f + c]);
      if (bias) lin = round_to<T>(lin + Io<T>::load(bias[f + c]));  // rounds: intermediate + bias, T
      y = round_to<T>(y * lin);                                     // rounds: act(x_glu) * x_linear, T
    }
    out[e] = Io<T>::store(y);
  }
}

inline void bias_activation_forward(DType dt, const void* in, const void* bias, void* out, std::int64_t n, int f,
                                    Act act, bool glu, cudaStream_t stream) {
  require(n >= 0 && f > 0, "bias_activation_forward: bad shape n=" + std::to_string(n) + " f=" + std::to_string(f));
  require(in && out && in != out, "bias_activation_forward: null or aliased in / out");
  // counts: the bias add, the activation's stores on its longest path, the GLU product.
  const int act_stores = act == Act::Silu || act == Act::QuickGelu ? 3 : act == Act::Relu ? 0 : 1;
  rounding_store(dt, (bias ? 1 : 0) + act_stores + (glu ? 1 : 0));
  // cost: the fc1 output [n, (glu ? 2 : 1) f] read, [n, f] written, the bias once; ~8 FLOPs per
  // output element (bias add, the activation, the GLU product).
  const double in_width = (glu ? 2.0 : 1.0) * f;
  rt::declare_cost("bias_activation_forward",
                   double(dtype_size(dt)) * (double(n) * (in_width + f) + (bias ? in_width : 0.0)), 8.0 * n * f);
  if (n == 0) return;
  dispatch_dtype(dt, "bias_activation_forward", [&](auto tag) {
    using T = decltype(tag);
    const unsigned threads = elementwise_threads(n * f);
    launch_kernel(bias_activation_forward_kernel<T>, dim3(elementwise_blocks(n * f, threads)), dim3(threads), 0, stream,
                  static_cast<const T*>(in), static_cast<const T*>(bias), static_cast<T*>(out), n, f, act, glu);
  });
}

// ---- backward -----------------------------------------------------------------------------------
// act'(x) in fp32 (reference/activations.cpp act1_grad).
__device__ inline float activation_grad(Act a, float x) {
  switch (a) {
    case Act::Gelu:  // 0.5 (1 + erf(x / sqrt 2)) + x exp(-x^2 / 2) / sqrt(2 pi)
      return 0.5f * (1.0f + erff(x * 0.70710678118654752f)) + x * 0.39894228040143268f * expf(-0.5f * x * x);
    case Act::Silu: {  // torch's silu_backward: s (1 + x (1 - s))
      const float s = 1.0f / (1.0f + expf(-x));
      return s * (1.0f + x * (1.0f - s));
    }
    case Act::Relu:
      return x > 0.0f ? 1.0f : 0.0f;
    case Act::SquaredRelu:
      return x > 0.0f ? 2.0f * x : 0.0f;
    case Act::QuickGelu: {
      const float s = 1.0f / (1.0f + expf(-1.702f * x));
      return s + x * 1.702f * s * (1.0f - s);
    }
  }
  return 0.0f;
}

// Stores of the activation's backward on its longest path, as the reference counts them (one per
// autograd node that stores in T: gelu_backward and silu_backward are single kernels, relu's
// threshold_backward is exact, squared_relu's pow and threshold backwards, quick_gelu's three ops).
inline int activation_grad_stores(Act a) {
  switch (a) {
    case Act::Gelu:
    case Act::Silu:
      return 1;
    case Act::Relu:
      return 0;
    case Act::SquaredRelu:
      return 2;
    case Act::QuickGelu:
      return 3;
  }
  return 1;
}

// in: [n, w] fc1 output (w = glu ? 2 f : f), bias [w] or null, dy: [n, f], din: [n, w].
template <class T>
__global__ void bias_activation_backward_kernel(const T* in, const T* bias, const T* dy, T* din, std::int64_t n, int f,
                                                Act act, bool glu) {
  const int in_width = glu ? 2 * f : f;
  const std::int64_t total = n * f;
  for (std::int64_t e = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += std::int64_t(gridDim.x) * blockDim.x) {
    const std::int64_t r = e / f;
    const int c = static_cast<int>(e % f);
    const T* row = in + r * in_width;  // [in_width]
    T* drow = din + r * in_width;      // [in_width]
    float a = Io<T>::load(row[c]);
    if (bias) a = round_to<T>(a + Io<T>::load(bias[c]));  // the forward's stored intermediate + bias
    float g = Io<T>::load(dy[e]);
    if (glu) {
      float lin = Io<T>::load(row[f + c]);
      if (bias) lin = round_to<T>(lin + Io<T>::load(bias[f + c]));
      drow[f + c] = Io<T>::store(g * activation<T>(act, a));  // rounds: mul's grad of x_linear, T
      g = round_to<T>(g * lin);                               // rounds: mul's grad of act(x_glu), T
    }
    drow[c] = Io<T>::store(g * activation_grad(act, a));  // rounds: dy act'(x), T
  }
}

// d(fc1 output + bias) [n, (glu ? 2 : 1) f] from dy [n, f]; in and bias as bias_activation_forward
// took them. din may alias in (each thread reads the two inputs of its element before writing
// their grads); with a GLU it must not alias dy, whose [n, f] layout differs from din's.
inline void bias_activation_backward(DType dt, const void* in, const void* bias, const void* dy, void* din,
                                     std::int64_t n, int f, Act act, bool glu, cudaStream_t stream) {
  require(n >= 0 && f > 0, "bias_activation_backward: bad shape n=" + std::to_string(n) + " f=" + std::to_string(f));
  require(in && dy && din, "bias_activation_backward: null in / dy / din");
  require(!glu || din != dy, "bias_activation_backward: with a GLU, din [n, 2 f] must not alias dy [n, f]");
  // counts: with a GLU the mul's grad stored in T, then the activation's backward stores.
  rounding_store(dt, (glu ? 1 : 0) + activation_grad_stores(act));
  // cost: fc1's output [n, w] and dy [n, f] read, din [n, w] written, the bias once; ~16 FLOPs per
  // output element (the recomputed forward, act', the GLU products).
  const double in_width = (glu ? 2.0 : 1.0) * f;
  rt::declare_cost("bias_activation_backward",
                   double(dtype_size(dt)) * (double(n) * (2.0 * in_width + f) + (bias ? in_width : 0.0)), 16.0 * n * f);
  if (n == 0) return;
  dispatch_dtype(dt, "bias_activation_backward", [&](auto tag) {
    using T = decltype(tag);
    const unsigned threads = elementwise_threads(n * f);
    launch_kernel(bias_activation_backward_kernel<T>, dim3(elementwise_blocks(n * f, threads)), dim3(threads), 0,
                  stream, static_cast<const T*>(in), static_cast<const T*>(bias), static_cast<const T*>(dy),
                  static_cast<T*>(din), n, f, act, glu);
  });
}

}  // namespace twin::opt::TWIN_BACKEND
