// The fp32 GEMMs of the reference's fast mode (ComputeMode::Fast, reference/precision.h).
//
// C = alpha A op(B) with fp32 accumulation, as Megatron's own GEMMs (torch.matmul, baddbmm, bmm)
// accumulate, through the best library the build found (gemm_backend() says which):
//   oneDNN   fp32 inputs: dnnl_sgemm; inputs that are all bf16 values (inputs_bf16): oneDNN's bf16
//            matmul, fp32 accumulation and output (what torch's CPU bf16 matmul runs)
//   OpenBLAS cblas_sgemm
//   Eigen    its own float GEMM (the fallback: same arithmetic class, slower)
// A bf16 value is exact in fp32 and the product of two is exact in fp32, so every backend computes
// the same fp32 sums, in its own order: what the counted bound allows for (two fp32 reductions of
// length K in any orders are at most 2 gamma_K(u_fp32) apart).
//
// Threads: the library's own pool (OMP_NUM_THREADS / OPENBLAS_NUM_THREADS, or set_gemm_threads);
// the Eigen fallback is single-threaded.
#pragma once

#include <Eigen/Core>
#include <cstdint>
#include <string>
#include <vector>

namespace twin::reference {

using FMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;  // [rows, cols], row-major

// a [m, k], b [n, k]: alpha a b^T [m, n] (x @ weight^T, q k^T). inputs_bf16: every value of a and
// b is a bf16 value (the caller's activation dtype is bf16).
FMat matmul_nt(const FMat& a, const FMat& b, float alpha = 1.0f, bool inputs_bf16 = false);
// a [m, k], b [k, n]: a b [m, n] (probs @ v).
FMat matmul_nn(const FMat& a, const FMat& b, bool inputs_bf16 = false);
// matmul_nt on double matrices whose values are fp32 values (bf16 ones with inputs_bf16): each
// is converted once, straight into the format the backend reads (x @ weight^T of a Linear).
using DMat = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;  // reference/precision.h's Mat
FMat matmul_nt(const DMat& a, const DMat& b, bool inputs_bf16 = false);

// fp32 <-> double conversions of n values (exact to double, rounding to fp32), in loops cloned for
// the CPU's widest vectors: fast mode converts every activation between its fp32 and double stages.
void to_double(const float* src, double* dst, Eigen::Index n);
void to_float(const double* src, float* dst, Eigen::Index n);

// A GEMM operand converted once into the format the backend reads, for one that many GEMMs read
// unchanged (a Linear's weight): the upper halves of its fp32 bits when inputs_bf16 and every
// value is a bf16 value and the backend has a bf16 matmul, else its fp32 values. `m`'s values
// must be fp32 values (its fp32 rounding is what is read, as matmul_nt reads it).
class GemmOperand {
 public:
  GemmOperand() = default;
  GemmOperand(const DMat& m, bool inputs_bf16);
  GemmOperand(const FMat& m, bool inputs_bf16);
  Eigen::Index rows() const { return rows_; }
  Eigen::Index cols() const { return cols_; }
  bool holds_bf16() const { return !bf16_.empty(); }
  const std::vector<std::uint16_t>& bf16_bits() const { return bf16_; }  // row-major, or empty
  FMat f32() const;                                // the fp32 values (from the bf16 bits when holds_bf16())
  const FMat& f32_values() const { return f32_; }  // the fp32 values; empty when holds_bf16()

 private:
  Eigen::Index rows_ = 0, cols_ = 0;
  std::vector<std::uint16_t> bf16_;  // row-major bf16 bits, or empty
  FMat f32_;                         // row-major fp32 values when bf16_ is empty
};
// a [m, k] times b^T, b a prepared [n, k] operand: the same sums as matmul_nt(a, b's matrix).
FMat matmul_nt(const DMat& a, const GemmOperand& b, bool inputs_bf16 = false);
FMat matmul_nt(const FMat& a, const GemmOperand& b, float alpha = 1.0f, bool inputs_bf16 = false);
// a [m, k] times b, b a prepared [k, n] operand: the same sums as matmul_nn(a, b's matrix).
FMat matmul_nn(const FMat& a, const GemmOperand& b, bool inputs_bf16 = false);

// "oneDNN ...", "OpenBLAS ..." or "Eigen ...": recorded by benchmarks.
std::string gemm_backend();
// Threads of the library's pool; no effect on the single-threaded Eigen fallback.
void set_gemm_threads(int n);

}  // namespace twin::reference
