/* Bias-dropout-add forward (reference/fused_bias_dropout.h; megatron/core/fusions/
 * fused_bias_dropout.py): out = residual + dropout(x + bias), in one pass over memory.
 *
 * Design: element-wise, one thread per element with a grid-stride loop; the rounding points of the
 * unfused torch graph are kept inside the fused kernel (x + bias stored in T, the dropout product
 * stored in T, the sum stored in T) so the result equals the reference's bits, not just its value.
 * The dropout mask comes from philox.cuh keyed by the element's GLOBAL flat index
 * (element_base + local index): a rank holding a slice of the sequence (SP) or the layer at any TP
 * size draws exactly the mask of the unsharded tensor.
 *
 * Backward (reference bias_dropout_add_backward): d residual = d out (the add passes it; the
 * caller may use dout's buffer itself, or have it copied); d x = dropout's backward of d out, the
 * forward's Philox mask regenerated from the same (seed, offset, global element), kept elements
 * scaled as the forward scaled them and stored in T, dropped ones 0; d bias = the column sums of
 * d x over the rows (kernel_common.cuh column_sums: fp32, fixed order, stored once in T), which in
 * the reference the linear owning the bias computes. */
#pragma once

#include "philox.cuh"

namespace twin::opt::TWIN_BACKEND {

template <class T>
__global__ void bias_dropout_add_forward_kernel(const T* x, const T* bias, const T* residual, T* out,
                                                std::int64_t n_rows, int h, DropoutArgs drop,
                                                std::uint64_t element_base) {
  const std::int64_t n = n_rows * h;
  for (std::int64_t e = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += std::int64_t(gridDim.x) * blockDim.x) {
    float v = Io<T>::load(x[e]);
    if (bias) v = round_to<T>(v + Io<T>::load(bias[e % h]));  // rounds: x + bias, T
    if (drop.active) {
      const bool keep =
          philox_keep(drop.seed, drop.offset, element_base + static_cast<std::uint64_t>(e), drop.threshold);
      v = keep ? dropout_scaled<T>(v, drop.scale) : 0.0f;  // rounds: dropout product, T
    }
    out[e] = Io<T>::store(Io<T>::load(residual[e]) + v);  // rounds: residual + out, T
  }
}

// x, residual, out: [n_rows, h] in dt (out may alias x or residual); bias [h] or null.
inline void bias_dropout_add_forward(DType dt, const void* x, const void* bias, const void* residual, void* out,
                                     std::int64_t n_rows, int h, const DropoutArgs& drop, std::uint64_t element_base,
                                     cudaStream_t stream) {
  require(h > 0 && n_rows >= 0,
          "bias_dropout_add_forward: bad shape [" + std::to_string(n_rows) + ", " + std::to_string(h) + "]");
  require(x && residual && out, "bias_dropout_add_forward: null x / residual / out");
  // counts: x + bias, the dropout product, residual + out (the residual was computed before x).
  rounding_store(dt, (bias ? 1 : 0) + (drop.active ? 1 : 0) + 1);
  // cost: x and residual read, out written, the bias once; bias add, dropout product, residual add.
  rt::declare_cost("bias_dropout_add_forward", double(dtype_size(dt)) * (3.0 * n_rows * h + (bias ? h : 0)),
                   double(n_rows) * h * ((bias ? 1 : 0) + (drop.active ? 1 : 0) + 1));
  if (n_rows == 0) return;
  dispatch_dtype(dt, "bias_dropout_add_forward", [&](auto tag) {
    using T = decltype(tag);
    const std::int64_t n = n_rows * h;
    const unsigned threads = elementwise_threads(n);
    launch_kernel(bias_dropout_add_forward_kernel<T>, dim3(elementwise_blocks(n, threads)), dim3(threads), 0, stream,
                  static_cast<const T*>(x), static_cast<const T*>(bias), static_cast<const T*>(residual),
                  static_cast<T*>(out), n_rows, h, drop, element_base);
  });
}

// ---- backward -----------------------------------------------------------------------------------
template <class T>
__global__ void bias_dropout_add_backward_kernel(const T* dout, T* dx, T* dresidual, std::int64_t n, DropoutArgs drop,
                                                 std::uint64_t element_base) {
  for (std::int64_t e = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += std::int64_t(gridDim.x) * blockDim.x) {
    const T g = dout[e];
    float v = Io<T>::load(g);
    if (drop.active) {
      const bool keep =
          philox_keep(drop.seed, drop.offset, element_base + static_cast<std::uint64_t>(e), drop.threshold);
      v = keep ? dropout_scaled<T>(v, drop.scale) : 0.0f;  // rounds: dy * mask * scale, T
    }
    if (dresidual) dresidual[e] = g;
    dx[e] = Io<T>::store(v);
  }
}

// Workspace bias_dropout_add_backward needs when it computes d bias (none otherwise).
inline std::size_t bias_dropout_add_backward_workspace_bytes(std::int64_t n_rows, int h) {
  return column_sum_workspace_bytes(1, n_rows, h);
}

// dout, dx, dresidual: [n_rows, h] in dt; dx may alias dout. dresidual null: the caller uses dout
// as d residual (they are equal); otherwise a copy is written. dbias [h] or null (no bias).
// drop and element_base as the forward had them.
inline void bias_dropout_add_backward(DType dt, const void* dout, void* dx, void* dresidual, void* dbias,
                                      std::int64_t n_rows, int h, const DropoutArgs& drop, std::uint64_t element_base,
                                      void* workspace, std::size_t workspace_bytes, cudaStream_t stream) {
  require(h > 0 && n_rows >= 0,
          "bias_dropout_add_backward: bad shape [" + std::to_string(n_rows) + ", " + std::to_string(h) + "]");
  require(dout && dx, "bias_dropout_add_backward: null dout / dx");
  require(dresidual != dx, "bias_dropout_add_backward: dresidual and dx must be different buffers");
  // counts: dx is dropout's backward product stored in T (nothing when dropout is off: dx = dout);
  // d bias then adds the row reduction and its store (the running count after the call is d bias's,
  // which includes dx's).
  if (drop.active) rounding_store(dt);
  // cost: dout read, dx (and d residual) written; the mask regenerated on chip; 1 FLOP per element.
  const std::int64_t n = n_rows * h;
  rt::declare_cost("bias_dropout_add_backward", double(dtype_size(dt)) * double(n) * (dresidual ? 3 : 2), double(n));
  dispatch_dtype(dt, "bias_dropout_add_backward", [&](auto tag) {
    using T = decltype(tag);
    if (n > 0) {
      const unsigned threads = elementwise_threads(n);
      launch_kernel(bias_dropout_add_backward_kernel<T>, dim3(elementwise_blocks(n, threads)), dim3(threads), 0, stream,
                    static_cast<const T*>(dout), static_cast<T*>(dx), static_cast<T*>(dresidual), n, drop,
                    element_base);
    }
    if (dbias) {
      rounding_reduce(n_rows);
      rounding_store(dt);
      T* const outs[1] = {static_cast<T*>(dbias)};
      column_sums<T, 1>("bias_dropout_add_bias_grad", MatrixTerms<T>{static_cast<const T*>(dx), h}, n_rows, h, outs,
                        workspace, workspace_bytes, double(dtype_size(dt)), 0.0, stream);
    }
  });
}

}  // namespace twin::opt::TWIN_BACKEND
