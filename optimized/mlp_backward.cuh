/* The MLP half of the dense layer's backward on one tensor-parallel rank (reference
 * TransformerLayer::backward's mlp_bda, mlp and pre_mlp_layernorm steps; megatron/core/transformer/
 * transformer_layer.py, mlp.py and tensor_parallel/layers.py under autograd), from the gradient of
 * the layer's output (n_local = the rank's rows: all n without SP, its sequence slice with it):
 *   mlp_bda:            d residual = dout; d mlp = dropout's backward of dout; d fc2.bias = sum_rows d mlp
 *                       (with SP each rank's rows, summed over the ranks)
 *   linear_fc2 (row parallel): with SP d mlp all-gathered to n rows (the reduce-scatter's dual);
 *                       d act = d mlp @ W2; dW2 = d mlp^T act (this rank's columns of W2)
 *   activation (+GLU):  d fc1 = act'(fc1 + b1) ...; d fc1.bias = sum_rows d fc1 (this rank's columns)
 *   linear_fc1 (column parallel): dW1 = d fc1^T ln2 (this rank's rows of W1); d ln2 = d fc1 @ W1,
 *                       each rank's partial summed over the ranks (all-reduce, or with SP
 *                       reduce-scatter to the rank's rows)
 *   pre_mlp_layernorm:  d hidden = norm backward(d ln2) + d residual (autograd's sum, stored in T);
 *                       with SP the norm's parameter grads summed over the ranks
 * Each step is the op's launcher (counting its rounding points); nothing is synchronised, so the
 * sequence can be captured into a graph like the forward. */
#pragma once

#include "optimized/activations.cuh"
#include "optimized/fused_bias_dropout.cuh"
#include "optimized/linear.cuh"
#include "optimized/torch_norm.cuh"

namespace twin::opt::TWIN_BACKEND {

// out = a + b, stored in T (the gradient reaching a tensor used twice: autograd adds the two).
template <class T>
__global__ void grad_sum_kernel(const T* a, const T* b, T* out, std::int64_t n) {
  for (std::int64_t e = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += std::int64_t(gridDim.x) * blockDim.x)
    out[e] = Io<T>::store(Io<T>::load(a[e]) + Io<T>::load(b[e]));  // rounds: the sum, T
}

inline void grad_sum(DType dt, const void* a, const void* b, void* out, std::int64_t n, cudaStream_t stream) {
  require(n >= 0 && a && b && out, "grad_sum: null tensor or negative size");
  // counts: the sum stored in T (the larger of the two paths' counts is the caller's join).
  rounding_store(dt);
  rt::declare_cost("grad_sum", 3.0 * double(dtype_size(dt)) * n, double(n));
  if (n == 0) return;
  dispatch_dtype(dt, "grad_sum", [&](auto tag) {
    using T = decltype(tag);
    const unsigned threads = elementwise_threads(n);
    launch_kernel(grad_sum_kernel<T>, dim3(elementwise_blocks(n, threads)), dim3(threads), 0, stream,
                  static_cast<const T*>(a), static_cast<const T*>(b), static_cast<T*>(out), n);
  });
}

template <class T>
__global__ void copy_elements_kernel(const T* src, T* dst, std::int64_t n) {
  for (std::int64_t e = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += std::int64_t(gridDim.x) * blockDim.x)
    dst[e] = src[e];
}

// dst = src, n elements of dt on the stream (a tensor the backward reads that the forward then
// overwrites in place, or a gradient passing through unchanged). No rounding.
inline void copy_elements(DType dt, const void* src, void* dst, std::int64_t n, cudaStream_t stream) {
  require(n >= 0 && src && dst, "copy_elements: null tensor or negative size");
  rt::declare_cost("copy_elements", 2.0 * double(dtype_size(dt)) * n, 0.0);
  if (n == 0) return;
  dispatch_dtype(dt, "copy_elements", [&](auto tag) {
    using T = decltype(tag);
    const unsigned threads = elementwise_threads(n);
    launch_kernel(copy_elements_kernel<T>, dim3(elementwise_blocks(n, threads)), dim3(threads), 0, stream,
                  static_cast<const T*>(src), static_cast<T*>(dst), n);
  });
}

inline std::size_t mlp_half_backward_workspace_bytes(bool rms, std::int64_t n, int h, int ffn, bool glu) {
  return std::max({norm_backward_workspace_bytes(rms, n, h), column_sum_workspace_bytes(1, n, h),
                   column_sum_workspace_bytes(1, n, glu ? 2 * ffn : ffn)});
}

inline void mlp_half_backward(const MlpHalfBackward& a, cudaStream_t st) {
  require(a.n >= 0 && a.h > 0 && a.ffn > 0 && a.tp.size >= 1 && (!a.tp.sp || a.n % a.tp.size == 0),
          "mlp_half_backward: bad shape");
  require(a.hidden && a.ln2 && a.fc1 && a.act_out && a.ln2_w && a.fc1_w && a.fc2_w && a.dout && a.dhidden &&
              a.d_ln2_w && a.d_fc1_w && a.d_fc2_w && a.d_mlp && a.d_act && a.d_fc1 && a.d_ln2,
          "mlp_half_backward: a required tensor is null");
  require((a.tp.size == 1 || a.d_ln2_partial) && (!a.tp.sp || a.d_mlp_full),
          "mlp_half_backward: tensor parallelism needs d_ln2_partial (and with SP d_mlp_full)");
  require(!a.rms || !a.d_ln2_b, "mlp_half_backward: RMSNorm has no bias");
  const int w = a.glu ? 2 * a.ffn : a.ffn;
  const std::int64_t n_local = a.tp.rows_local(a.n);
  const RoundingCount at_input = rounding_now();
  GradLeaves leaves(at_input);
  // ---- mlp_bda: d residual = dout (used below); d mlp, d fc2.bias      // [n_local, h]
  bias_dropout_add_backward(a.dt, a.dout, a.d_mlp, nullptr, nullptr, n_local, a.h, a.drop, a.tp.element_base(a.n, a.h),
                            nullptr, 0, st);
  const RoundingCount at_fc2 = rounding_now();
  if (a.fc2_bias) {
    require(a.d_fc2_b != nullptr, "mlp_half_backward: fc2 has a bias but d_fc2_b is null");
    linear_backward_bias(a.dt, a.d_mlp, a.d_fc2_b, n_local, a.h, a.workspace, a.workspace_bytes, st);
    if (a.tp.sp) tp_sum_param_grads(a.tp, a.dt, {a.d_fc2_b}, a.h, leaves, st);  // each rank summed its rows
    leaves.done(at_fc2);
  }
  // ---- linear_fc2 (row parallel)                                        // [n, ffn], [h, ffn]
  const void* d_mlp = tp_gather_rows(a.tp, a.dt, a.d_mlp, a.d_mlp_full, a.n, a.h, st);  // [n, h]
  linear_backward_wgrad(a.dt, d_mlp, a.act_out, a.d_fc2_w, a.n, a.ffn, a.h, st);
  leaves.done(at_fc2);
  linear_backward_dgrad(a.dt, d_mlp, a.fc2_w, a.d_act, a.n, a.ffn, a.h, st);
  // ---- activation / GLU, fc1.bias                                       // [n, w]
  bias_activation_backward(a.dt, a.fc1, a.fc1_b, a.d_act, a.d_fc1, a.n, a.ffn, a.act, a.glu, st);
  const RoundingCount at_fc1 = rounding_now();
  if (a.fc1_b) {
    require(a.d_fc1_b != nullptr, "mlp_half_backward: fc1 has a bias but d_fc1_b is null");
    linear_backward_bias(a.dt, a.d_fc1, a.d_fc1_b, a.n, w, a.workspace, a.workspace_bytes, st);
    leaves.done(at_fc1);
  }
  // ---- linear_fc1 (column parallel)                                     // [n_local, h], [w, h]
  linear_backward_wgrad(a.dt, a.d_fc1, a.ln2, a.d_fc1_w, a.n, a.h, w, st);
  leaves.done(at_fc1);
  void* const d_ln2_partial = a.tp.size > 1 ? a.d_ln2_partial : a.d_ln2;
  linear_backward_dgrad(a.dt, a.d_fc1, a.fc1_w, d_ln2_partial, a.n, a.h, w, st);
  tp_reduce(a.tp, a.dt, d_ln2_partial, a.d_ln2, a.n, a.h, st);
  // ---- pre_mlp_layernorm, then the residual's gradient added             // [n_local, h]
  norm_backward(a.rms, a.dt, a.d_ln2, a.hidden, a.dhidden, a.ln2_w, a.d_ln2_w, a.d_ln2_b, NormRows::dense(n_local, a.h),
                a.eps, a.zero_centered_gamma, a.workspace, a.workspace_bytes, st);
  if (a.tp.sp)  // each rank's rows gave a part of the norm's parameter grads
    tp_sum_param_grads(a.tp, a.dt, {a.d_ln2_w, a.d_ln2_b}, a.h, leaves, st);
  rounding_join(at_input);  // the residual path: dout as it came in
  grad_sum(a.dt, a.dhidden, a.dout, a.dhidden, n_local * a.h, st);
  leaves.join_all();
}

}  // namespace twin::opt::TWIN_BACKEND
