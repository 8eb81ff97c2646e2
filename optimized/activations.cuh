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
 * split produces, so the kernel is the same at every TP size. */
#pragma once

#include "kernel_common.cuh"

namespace twin::opt::TWIN_BACKEND {

enum class Act : int { Gelu, Silu, Relu, SquaredRelu, QuickGelu };

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

// Act for a Megatron activation_func name; invalid_argument for names the kernel does not have.
inline Act act_from_name(const std::string& name) {
  if (name == "gelu") return Act::Gelu;
  if (name == "silu" || name == "swish") return Act::Silu;
  if (name == "relu") return Act::Relu;
  if (name == "squared_relu") return Act::SquaredRelu;
  if (name == "quick_gelu") return Act::QuickGelu;
  throw std::invalid_argument("bias_activation_forward: activation '" + name +
                              "' has no optimized kernel (gelu, silu, relu, squared_relu, quick_gelu)");
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

}  // namespace twin::opt::TWIN_BACKEND
