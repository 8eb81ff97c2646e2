/* A Linear's forward and backward GEMMs (reference Linear; megatron/core/tensor_parallel/layers.py,
 * LinearWithGradAccumulationAndAsyncCommunication.backward at TP 1, no gradient accumulation fusion).
 *   forward: y [rows, out]  = x @ W^T (+ bias)  fp32 accumulation over in, stored in T
 * From dy [rows, out], the gradient of the (biased) output,
 *   dgrad:  dx [rows, in]  = dy @ W           fp32 accumulation over out, stored in T
 *   wgrad:  dW [out, in]   = dy^T @ x         fp32 accumulation over rows, stored in the parameter dtype
 *   bias:   db [out]       = dy.sum(dim=0)    fp32 accumulation over rows, stored in the parameter dtype
 * (the parameter dtype is T: Megatron's main-grad-less path keeps param.grad in the param dtype,
 * which is the activation dtype here, as in the reference).
 *
 * Design: both GEMMs go through the GEMM interface (runtime/gemm.h: cuBLASLt on the GPU, the
 * simulator's fixed-order GEMM on the CPU), written as column-major products of the row-major
 * tensors (linear_gemm_args); cuBLASLt picks its
 * algorithm per shape, and the simulator's order is fixed, so two runs of one shape are bitwise
 * equal on either. The bias grad is a deterministic column sum (kernel_common.cuh column_sums). */
#pragma once

#include <initializer_list>

#include "kernel_common.cuh"
#include "optimized/runtime/collectives.h"
#include "optimized/runtime/gemm.h"

namespace twin::opt::TWIN_BACKEND {

inline rt::Backend this_backend() { return TWIN_SIM ? rt::Backend::Sim : rt::Backend::Cuda; }
inline rt::Gemm& linear_gemm() { return rt::gemm(this_backend()); }

// D[m, n] = op(A) op(B) in dtype dt, column-major, D written in place of C (beta 0): every Linear
// GEMM here, the row-major tensors read as their column-major transposes.
inline rt::GemmArgs linear_gemm_args(DType dt, rt::Op transa, const void* a, std::int64_t lda, rt::Op transb,
                                     const void* b, std::int64_t ldb, void* d, std::int64_t m, std::int64_t n,
                                     std::int64_t k) {
  rt::GemmArgs g;
  g.transa = transa;
  g.transb = transb;
  g.m = m;
  g.n = n;
  g.k = k;
  g.ab_dtype = g.cd_dtype = dt;
  g.a = a;
  g.lda = lda;
  g.b = b;
  g.ldb = ldb;
  g.d = d;
  g.ldd = m;
  g.c = d;
  g.ldc = m;
  return g;
}

// y[rows, out] = x[rows, in] @ w[out, in]^T (+ bias via the epilogue): torch's Linear on
// row-major tensors as a column-major cuBLASLt GEMM (y^T = W x^T), counting nothing (the caller
// counts).
inline void linear_uncounted(DType dt, const void* x, const void* w, const void* bias, void* y, std::int64_t rows,
                             std::int64_t in, std::int64_t out, cudaStream_t stream) {
  rt::GemmArgs g = linear_gemm_args(dt, rt::Op::T, w, in, rt::Op::N, x, in, y, out, rows, in);
  if (bias) {
    g.epilogue = rt::Epilogue::Bias;
    g.bias = bias;
    g.bias_dtype = dt;
  }
  linear_gemm().run(g, stream);
}

// linear_uncounted with its rounding points counted.
inline void linear_forward(DType dt, const void* x, const void* w, const void* bias, void* y, std::int64_t rows,
                           std::int64_t in, std::int64_t out, cudaStream_t stream) {
  linear_uncounted(dt, x, w, bias, y, rows, in, out, stream);
  // counts: Megatron stores the GEMM output and then the biased sum; an epilogue storing once
  // differs from that by at most the one rounding counted for the bias.
  rounding_reduce(in);
  rounding_store(dt, bias ? 2 : 1);
}

// A row-major operand's place: its pointer and row stride in elements (0: contiguous, the row
// stride its width). The Linear GEMMs below read and write column slices of wider tensors this
// way (multi-latent attention's latent, whose columns are split and sliced by rank) at no copy.
struct Rows {
  const void* ptr = nullptr;
  std::int64_t ld = 0;
  std::int64_t ld_or(std::int64_t width) const { return ld ? ld : width; }
};
struct RowsOut {
  void* ptr = nullptr;
  std::int64_t ld = 0;
  std::int64_t ld_or(std::int64_t width) const { return ld ? ld : width; }
};

// y[rows, out] = x[rows, in] @ w[out, in]^T, x and y strided (no bias), counted.
inline void linear_forward(DType dt, Rows x, const void* w, RowsOut y, std::int64_t rows, std::int64_t in,
                           std::int64_t out, cudaStream_t stream) {
  rt::GemmArgs g = linear_gemm_args(dt, rt::Op::T, w, in, rt::Op::N, x.ptr, x.ld_or(in), y.ptr, out, rows, in);
  g.ldd = g.ldc = y.ld_or(out);
  linear_gemm().run(g, stream);
  rounding_reduce(in);
  rounding_store(dt);
}

// dx[rows, in] (+)= dy[rows, out] @ w[out, in], dy and dx strided; accumulate: added to dx (one
// rounding of the sum). Column-major: dx^T (in x rows) = W^T (in x out, w's row-major storage read
// as is, ld in) * dy^T (out x rows, ld dy's row stride).
inline void linear_backward_dgrad(DType dt, Rows dy, const void* w, RowsOut dx, std::int64_t rows, std::int64_t in,
                                  std::int64_t out, bool accumulate, cudaStream_t stream) {
  require(rows >= 0 && in > 0 && out > 0, "linear_backward_dgrad: bad shape rows=" + std::to_string(rows) +
                                              " in=" + std::to_string(in) + " out=" + std::to_string(out));
  require(dy.ptr && w && dx.ptr, "linear_backward_dgrad: null dy / w / dx");
  // counts: as the reference: the GEMM's fp32 reduction over out, its output stored in T (with
  // accumulate, the sum with dx: the store of the two paths' sum).
  rounding_reduce(out);
  rounding_store(dt);
  if (rows == 0) return;
  rt::GemmArgs g = linear_gemm_args(dt, rt::Op::N, w, in, rt::Op::N, dy.ptr, dy.ld_or(out), dx.ptr, in, rows, out);
  g.ldd = g.ldc = dx.ld_or(in);
  if (accumulate) g.beta = 1.0f;
  linear_gemm().run(g, stream);
}

// dx[rows, in] = dy[rows, out] @ w[out, in]. Column-major: dx^T (in x rows) = W^T (in x out, w's
// row-major storage read as is, ld in) * dy^T (out x rows, dy as is, ld out).
inline void linear_backward_dgrad(DType dt, const void* dy, const void* w, void* dx, std::int64_t rows, std::int64_t in,
                                  std::int64_t out, cudaStream_t stream) {
  linear_backward_dgrad(dt, Rows{dy}, w, RowsOut{dx}, rows, in, out, false, stream);
}

// dw[out, in] = dy[rows, out]^T @ x[rows, in], dy and x strided. Column-major: dW^T (in x out) =
// X^T (in x rows, x's storage as is, ld its row stride) * dy (rows x out: dy's storage transposed,
// ld its row stride). rows == 0 gives dw = 0 (an empty sum).
inline void linear_backward_wgrad(DType dt, Rows dy, Rows x, void* dw, std::int64_t rows, std::int64_t in,
                                  std::int64_t out, cudaStream_t stream) {
  require(rows >= 0 && in > 0 && out > 0, "linear_backward_wgrad: bad shape rows=" + std::to_string(rows) +
                                              " in=" + std::to_string(in) + " out=" + std::to_string(out));
  require(dy.ptr && x.ptr && dw, "linear_backward_wgrad: null dy / x / dw");
  // counts: as the reference: the GEMM's fp32 reduction over the rows, stored in the param dtype.
  rounding_reduce(rows);
  rounding_store(dt);
  const rt::GemmArgs g =
      linear_gemm_args(dt, rt::Op::N, x.ptr, x.ld_or(in), rt::Op::T, dy.ptr, dy.ld_or(out), dw, in, out, rows);
  if (rows > 0)
    linear_gemm().run(g, stream);
  else
    linear_gemm().run_grouped({g}, stream);  // the grouped entry point allows k == 0 (D = 0)
}

inline void linear_backward_wgrad(DType dt, const void* dy, const void* x, void* dw, std::int64_t rows, std::int64_t in,
                                  std::int64_t out, cudaStream_t stream) {
  linear_backward_wgrad(dt, Rows{dy}, Rows{x}, dw, rows, in, out, stream);
}

// Workspace linear_backward_bias needs.
inline std::size_t linear_backward_bias_workspace_bytes(std::int64_t rows, std::int64_t out) {
  return column_sum_workspace_bytes(1, rows, static_cast<int>(out));
}

// db[out] = sum over rows of dy[rows, out], fp32 in a fixed order, stored in T.
inline void linear_backward_bias(DType dt, const void* dy, void* db, std::int64_t rows, std::int64_t out,
                                 void* workspace, std::size_t workspace_bytes, cudaStream_t stream) {
  require(rows >= 0 && out > 0 && out <= (1LL << 30),
          "linear_backward_bias: bad shape rows=" + std::to_string(rows) + " out=" + std::to_string(out));
  require(dy && db, "linear_backward_bias: null dy / db");
  // counts: as the reference: the fp32 reduction over the rows, stored in the param dtype.
  rounding_reduce(rows);
  rounding_store(dt);
  dispatch_dtype(dt, "linear_backward_bias", [&](auto tag) {
    using T = decltype(tag);
    T* const outs[1] = {static_cast<T*>(db)};
    column_sums<T, 1>("linear_backward_bias", MatrixTerms<T>{static_cast<const T*>(dy), out}, rows,
                      static_cast<int>(out), outs, workspace, workspace_bytes, double(dtype_size(dt)), 0.0, stream);
  });
}

// ---- tensor parallelism (TensorParallel, layer/kernel_args.h): the collectives around one rank's
// column- and row-parallel Linears.

// Each rank's partial [rows, cols] summed over the ranks into out: all-reduced (out [rows, cols]
// on every rank) or with SP reduce-scattered (out [rows_local, cols], this rank's rows). The
// row-parallel forward's reduction and its dual, the column-parallel dgrad's. Size 1: nothing
// (the partial is out).
inline void tp_reduce(const TensorParallel& tp, DType dt, void* partial, void* out, std::int64_t rows,
                      std::int64_t cols, cudaStream_t st) {
  if (tp.size == 1) return;
  require(tp.comm && partial && out && (!tp.sp || rows % tp.size == 0), "tp_reduce: bad tensor-parallel arguments");
  rounding_store(dt, tp.size - 1);  // counts: the sum over the ranks
  if (tp.sp)
    tp.comm->reduce_scatter(partial, out, std::size_t(tp.rows_local(rows)) * cols, dt, st);
  else
    tp.comm->all_reduce(partial, out, std::size_t(rows) * cols, dt, st);
}

// The gradient of a row-parallel Linear's output: with SP this rank's rows [rows_local, cols]
// all-gathered into full [rows, cols] (the dual of the forward's reduce-scatter), which is
// returned; without SP every rank holds the full gradient (the all-reduce's dual is the identity)
// and `local` is returned. No rounding.
inline const void* tp_gather_rows(const TensorParallel& tp, DType dt, const void* local, void* full, std::int64_t rows,
                                  std::int64_t cols, cudaStream_t st) {
  if (!tp.sp) return local;
  require(tp.comm && local && full, "tp_gather_rows: sequence parallelism without a communicator or buffer");
  tp.comm->all_gather(local, full, std::size_t(tp.rows_local(rows)) * cols, dt, st);
  return full;
}

// Replicated parameters' grads of which each rank computed a part (a norm's or a row-parallel
// bias's over its SP rows, a qk-layernorm's over its heads), `count` elements each: each summed in
// place over the ranks, as finalize_model_grads all-reduces them, a leaf ending here. Null grads
// (absent parameters) are skipped; at size 1 nothing is summed.
inline void tp_sum_param_grads(const TensorParallel& tp, DType dt, std::initializer_list<void*> grads,
                               std::int64_t count, GradLeaves& leaves, cudaStream_t st) {
  const RoundingCount at = rounding_now();
  for (void* grad : grads) {
    if (tp.size == 1 || !grad) continue;
    require(tp.comm != nullptr, "tp_sum_param_grads: no communicator");
    rounding_store(dt, tp.size - 1);  // counts: the sum over the ranks
    tp.comm->all_reduce(grad, grad, std::size_t(count), dt, st);
    leaves.done(at);
  }
}

}  // namespace twin::opt::TWIN_BACKEND
