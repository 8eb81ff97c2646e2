/* The shared experts' sigmoid gate (reference/moe/shared_experts.h; Megatron's SharedExpertMLP with
 * use_shared_expert_gate): out = mlp_output * sigmoid(linear(x, gate_weight)), forward and
 * backward. The gate's GEMM (linear(x, gate_weight) [T, 1], its weight gradient) runs through the
 * GEMM interface in the caller; here the element-wise parts.
 *
 * Backward (autograd of the forward's three ops, as the reference writes it out):
 *   d mlp_output = d out * gate_score                            stored in T
 *   d gate_score = sum_j d out[t, j] mlp_output[t, j]            fp32 in j order, stored in T
 *   d logits     = d gate_score * s (1 - s)  (sigmoid_backward)   stored in T
 *   d x         += d logits gate_weight  (the gate GEMM's dgrad, each product and sum stored in T) */
#pragma once

#include "optimized/kernel_common.cuh"

namespace twin::opt::TWIN_BACKEND {

// The gate score of a stored logit: sigmoid in fp32, stored in T.
template <class T>
__host__ __device__ inline float shared_expert_gate_score(T logit) {
  return round_to<T>(1.0f / (1.0f + expf(-Io<T>::load(logit))));  // rounds: sigmoid, T
}

// out[t, :] = in[t, :] * sigmoid(gate_logits[t]), the sigmoid and the product each stored in T.
template <class T>
__global__ void shared_expert_gate_kernel(const T* in, const T* gate_logits, T* out, std::int64_t n, int h) {
  const std::int64_t total = n * h;
  for (std::int64_t i = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += std::int64_t(gridDim.x) * blockDim.x)
    out[i] = Io<T>::store(Io<T>::load(in[i]) * shared_expert_gate_score(gate_logits[i / h]));  // rounds: product, T
}

// One thread per token: d mlp_output [n, h] and d logits [n] from d out [n, h].
template <class T>
__global__ void shared_expert_gate_backward_kernel(const T* dout, const T* mlp_out, const T* gate_logits, T* d_mlp,
                                                   T* d_logits, std::int64_t n, int h) {
  for (std::int64_t t = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; t < n;
       t += std::int64_t(gridDim.x) * blockDim.x) {
    const float s = shared_expert_gate_score(gate_logits[t]);
    float dscore = 0.0f;
    for (int j = 0; j < h; ++j) {
      const float d = Io<T>::load(dout[t * h + j]);
      dscore += d * Io<T>::load(mlp_out[t * h + j]);
      d_mlp[t * h + j] = Io<T>::store(d * s);  // rounds: grad * gate_score, T
    }
    dscore = round_to<T>(dscore);                         // rounds: the broadcast's reduction, T
    d_logits[t] = Io<T>::store(dscore * s * (1.0f - s));  // rounds: sigmoid_backward, T
  }
}

// dx[t, j] += d_logits[t] gate_weight[j], the product and the sum each stored in T.
template <class T>
__global__ void shared_expert_gate_input_backward_kernel(const T* d_logits, const T* gate_w, T* dx, std::int64_t n,
                                                         int h) {
  const std::int64_t total = n * h;
  for (std::int64_t i = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += std::int64_t(gridDim.x) * blockDim.x) {
    const float prod = round_to<T>(Io<T>::load(d_logits[i / h]) * Io<T>::load(gate_w[i % h]));  // rounds: d x, T
    dx[i] = Io<T>::store(Io<T>::load(dx[i]) + prod);                                            // rounds: sum, T
  }
}

// ---- launchers

// out [n, h] = in [n, h] * sigmoid(gate_logits [n]); out may alias in.
inline void shared_expert_gate_forward(DType dt, const void* in, const void* gate_logits, void* out, std::int64_t n,
                                       int h, cudaStream_t stream) {
  require(n >= 0 && h > 0 && in && gate_logits && out, "shared_expert_gate_forward: bad shape or null buffer");
  rounding_store(dt);  // counts: the product (the gate is a shorter branch from the input)
  // cost: the shared experts' output read and written, the gate logits [n] read; the sigmoid once
  // per token, the product per element.
  rt::declare_cost("shared_expert_gate", double(dtype_size(dt)) * (2.0 * n * h + n), double(n) * (h + 4));
  if (n == 0) return;
  dispatch_dtype(dt, "shared_expert_gate", [&](auto tag) {
    using T = decltype(tag);
    const unsigned threads = elementwise_threads(n * h);
    launch_kernel(shared_expert_gate_kernel<T>, dim3(elementwise_blocks(n * h, threads)), dim3(threads), 0, stream,
                  static_cast<const T*>(in), static_cast<const T*>(gate_logits), static_cast<T*>(out), n, h);
  });
}

// The gate's element-wise backward: d_mlp [n, h] (the MLP's output gradient) and d_logits [n].
// Counts the MLP branch (grad * gate_score); returns the gate branch's count (the reduction over
// h, then the two stores), which the caller joins where the branches meet.
inline RoundingCount shared_expert_gate_backward(DType dt, const void* dout, const void* mlp_out,
                                                 const void* gate_logits, void* d_mlp, void* d_logits, std::int64_t n,
                                                 int h, cudaStream_t stream) {
  require(n >= 0 && h > 0 && dout && mlp_out && gate_logits && d_mlp && d_logits && d_mlp != dout,
          "shared_expert_gate_backward: bad shape, null or aliased buffer");
  rounding_store(dt);  // counts: grad * gate_score, the MLP's branch
  RoundingCount gate_branch = rounding_now();
  gate_branch.reduction += h;
  gate_branch.store(dt, 2);
  // cost: d out and the MLP's output [n, h] read, d_mlp written, the logits read and their
  // gradient written; 3 FLOPs per element.
  rt::declare_cost("shared_expert_gate_backward", double(dtype_size(dt)) * (3.0 * n * h + 2.0 * n), 3.0 * n * h);
  if (n == 0) return gate_branch;
  dispatch_dtype(dt, "shared_expert_gate_backward", [&](auto tag) {
    using T = decltype(tag);
    const unsigned threads = elementwise_threads(n);
    launch_kernel(shared_expert_gate_backward_kernel<T>, dim3(elementwise_blocks(n, threads)), dim3(threads), 0, stream,
                  static_cast<const T*>(dout), static_cast<const T*>(mlp_out), static_cast<const T*>(gate_logits),
                  static_cast<T*>(d_mlp), static_cast<T*>(d_logits), n, h);
  });
  return gate_branch;
}

// dx [n, h] += d_logits [n] gate_weight [h] (linear(x, gate_weight)'s dgrad added to the MLP's).
inline void shared_expert_gate_input_backward(DType dt, const void* d_logits, const void* gate_w, void* dx,
                                              std::int64_t n, int h, cudaStream_t stream) {
  require(n >= 0 && h > 0 && d_logits && gate_w && dx, "shared_expert_gate_input_backward: null buffer");
  rounding_store(dt, 2);  // counts: the product, the sum
  // cost: dx read and written, the logits' gradient and the gate weight read; a multiply-add.
  rt::declare_cost("shared_expert_gate_input_backward", double(dtype_size(dt)) * (2.0 * n * h + n + h), 2.0 * n * h);
  if (n == 0) return;
  dispatch_dtype(dt, "shared_expert_gate_input_backward", [&](auto tag) {
    using T = decltype(tag);
    const unsigned threads = elementwise_threads(n * h);
    launch_kernel(shared_expert_gate_input_backward_kernel<T>, dim3(elementwise_blocks(n * h, threads)), dim3(threads),
                  0, stream, static_cast<const T*>(d_logits), static_cast<const T*>(gate_w), static_cast<T*>(dx), n, h);
  });
}

}  // namespace twin::opt::TWIN_BACKEND
