// The numeric policy of the reference.
//
// Every value is computed in double (Eigen matrices of double). What makes the reference equal to
// Megatron is WHERE it rounds: a value is rounded exactly at the points where Megatron's tensor is
// stored in a narrower dtype, and nowhere else. Each such point in the code carries a comment
// `// rounds: ...`. Two modes:
//
//   ComputeMode::FP32  mirror Megatron. Two storage dtypes exist:
//     - the activation dtype = the parameter dtype (fp32, bf16 or fp16): module outputs (every
//       tap), residuals, GEMM outputs (accumulated in fp32, i.e. here in double, then rounded
//       ONCE to the activation dtype), bias adds, activations, RoPE products, attention scores;
//     - fp32: norm statistics (mean, rstd; torch computes norms in fp32 for bf16 inputs), the
//       softmax input/output when attention_softmax_in_fp32, RoPE cos/sin tables.
//     For fp32 parameters both points round to fp32: every op of torch's fp32 graph stores once.
//   ComputeMode::Exact no rounding at all: the true value of the same formula on the same (already
//     representable) parameters and inputs, for measuring how far any implementation is from it.
//   ComputeMode::Fast  FP32's rounding points, but the GEMMs (linear layers, attention's q k^T and
//     probs v) accumulate in fp32 through a BLAS (reference/fast/fast_gemm.h) in the library's order,
//     as Megatron's own GEMMs do, instead of in double; GeLU / SiLU, and with 16-bit activations
//     the attention softmax, run in fp32 arithmetic (a few fp32 ulps between the same stores).
//     Everything else is FP32 mode's code, in fused loops with the same roundings. Its
//     results stay within the counted bound of Exact (parity::golden_bound: a reduction
//     accumulated in fp32 is one of the rounding points counted, 2 gamma_K(u_fp32)), so it may
//     stand in for FP32 mode where speed matters (benchmarks, large shapes); goldens and the
//     bounds themselves are FP32 and Exact mode's business, and FP32 stays the default.
//
// Matrices hold [s, b, h] activations as (s * b) x h, sequence-major: row = s_idx * b + b_idx,
// exactly the memory order of Megatron's [s, b, h] tensors.
#pragma once

#include <Eigen/Core>
#include <cstdint>

#include "core/config.h"
#include "core/dtype.h"
#include "core/rounding.h"
#include "core/tensor.h"

// The functions that run fast mode's (and FP32 mode's) per-element loops, cloned for AVX-512 and
// AVX2 and chosen at load time by the CPU: the build targets baseline x86-64, whose 4-wide SSE2
// makes these loops the slowest part of the reference's elementwise ops. The same scalar code,
// so the same values, on every clone.
#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__) && !defined(__CUDACC__)
#define TWIN_VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#define TWIN_ALWAYS_INLINE __attribute__((always_inline)) inline
#else
#define TWIN_VECTOR_CLONES
#define TWIN_ALWAYS_INLINE inline
#endif

namespace twin::reference {

using Mat = RowMatrix<double>;  // [rows, cols], row-major
using RowVec = Eigen::RowVectorXd;

enum class ComputeMode { FP32, Exact, Fast };

struct Precision {
  ComputeMode mode = ComputeMode::FP32;
  DType params_dtype = DType::F32;  // F32, BF16 or F16: the dtype Megatron stores activations in

  // params_dtype from the config (bf16 / fp16 flags win, as Megatron's Float16Module casts).
  static Precision from_config(const TransformerConfig& c, ComputeMode mode = ComputeMode::FP32);

  bool exact() const { return mode == ComputeMode::Exact; }
  // GEMMs accumulate in fp32 through reference/fast/fast_gemm.h (ComputeMode::Fast).
  bool fast() const { return mode == ComputeMode::Fast; }

  // rounds: to the activation (parameter) dtype; identity in Exact mode. bf16/fp16 go through
  // fp32 first, as torch's kernels compute in fp32 and store once. Inline (round_to's float and
  // bf16 cases, the same bits): the reference rounds every element of every activation.
  double act(double x) const {
    if (exact()) return x;
    const float f = static_cast<float>(x);  // round_to(F32, x)
    switch (params_dtype) {
      case DType::F32:
        return f;
      case DType::BF16:
        return bf16_bits_to_float(float_to_bf16_bits(f));
      default:
        return round_to(params_dtype, f);
    }
  }
  // rounds: to fp32; identity in Exact mode.
  double f32(double x) const { return exact() ? x : static_cast<double>(static_cast<float>(x)); }

  // f(round) with `round(x)` equal to act(x), of a function-object type fixed per dtype: a loop
  // of roundings inside f has neither the mode's nor the dtype's branch per element, so it
  // inlines and vectorises (for the per-element loops of bf16 and fp32 activations). Always
  // inlined, so that in a TWIN_VECTOR_CLONES function the loops are compiled for each clone's ISA.
  template <class F>
  TWIN_ALWAYS_INLINE decltype(auto) with_act(F&& f) const {
    if (exact()) return f([](double x) { return x; });
    if (params_dtype == DType::F32) return f([](double x) { return static_cast<double>(static_cast<float>(x)); });
    if (params_dtype == DType::BF16) return f([](double x) { return round_bf16(x); });
    return f([this](double x) { return act(x); });
  }
  // act(x) for bf16 written without calls or branches (float_to_bf16_bits' rounding: a NaN stays a
  // quiet NaN, else round to nearest even on the upper half).
  static double round_bf16(double x) { return round_bf16(static_cast<float>(x)); }
  static float round_bf16(float f) {
    const std::uint32_t u = float_bits(f);
    const std::uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    const std::uint32_t nan = (u | 0x00400000u) & 0xffff0000u;
    return bits_float((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
  }

  // Counts the rounding points a `rounds:` site executes (core/rounding.h), once per tensor, not
  // per element: n stores to the activation dtype, n to fp32, a reduction of length k accumulated
  // in fp32. Nothing in Exact mode, which rounds nowhere.
  void count_act(int n = 1) const { count_store(params_dtype, n); }
  void count_store(DType dt, int n = 1) const {
    if (!exact()) rounding_store(dt, n);
  }
  void count_f32(int n = 1) const {
    if (!exact()) rounding_store(DType::F32, n);
  }
  void count_reduce(std::int64_t k) const {
    if (!exact()) rounding_reduce(k);
  }

  void act_inplace(Mat& m) const;
  void f32_inplace(Mat& m) const;
  void act_inplace(RowVec& v) const;
  // rounds: n fp32 values to the activation dtype, in place (identity for fp32 activations and in
  // Exact mode): act() of each, for fast mode's loops that stay in fp32. act(x) of a double is
  // act of float(x) (it rounds to fp32 first), so an fp32 op followed by this equals act() of the
  // op done in double for +, -, *, / (double's 53 bits round an fp32 op's result to the same float).
  void act_inplace(float* v, Eigen::Index n) const;
  Mat act(Mat m) const {
    act_inplace(m);
    return m;
  }
  Mat f32(Mat m) const {
    f32_inplace(m);
    return m;
  }

  // dtype of the tensors the reference hands out (taps, outputs): the activation dtype, or F64
  // in Exact mode (no rounding happened, none is applied on the way out).
  DType storage_dtype() const { return exact() ? DType::F64 : params_dtype; }
  DType fp32_storage_dtype() const { return exact() ? DType::F64 : DType::F32; }

  // unit roundoff of the activation dtype (0 in Exact mode)
  double unit_roundoff_act() const { return exact() ? 0.0 : unit_roundoff(params_dtype); }

  // Matrix -> tensor of `shape` in storage_dtype() (values already rounded: conversion is exact).
  Tensor to_tensor(const Mat& m, Shape shape) const;
  Tensor to_tensor(const RowVec& v, Shape shape) const;
  Tensor to_tensor_f32(const Mat& m, Shape shape) const;  // a tensor stored in fp32
};

// Tensor (any float dtype, contiguous) viewed as rows x cols of doubles; ShapeError when the
// element count differs (names `what`).
Mat to_mat(const Tensor& t, std::int64_t rows, std::int64_t cols, const std::string& what);
// The inverse: m's values in dt (RNE for a narrower float) with `shape` (ShapeError when the
// element count differs).
Tensor to_tensor(DType dt, const Mat& m, Shape shape);
RowVec to_rowvec(const Tensor& t, const std::string& what);

}  // namespace twin::reference
