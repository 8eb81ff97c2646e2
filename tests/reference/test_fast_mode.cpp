// The reference's fast mode (ComputeMode::Fast: fp32 GEMMs through BLAS, reference/fast/fast_gemm.h)
// against its Exact mode, within the bound of the rounding points the fast run counted
// (parity::golden_bound through the one comparison, parity::diff_taps): every tap and the output,
// on random dense layers in fp32 and bf16, and on the benchmark's scaled 1.3B-GPT and Llama shapes
// where the reductions are long. No tolerance is written here: the bound is the golden one.
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <cmath>
#include <string>

#include "parity/bounds.h"
#include "parity/dense_run.h"
#include "parity/golden.h"
#include "reference/fast/fast_gemm.h"
#include "reference/linear.h"
#include "tests/parity/dense_case_gen.h"
#include "tests/reference/counted_bound.h"

namespace twin::reference {
namespace {

using parity::DenseCase;

// The fast run's taps and output against the exact run's; "" when all are within the bound.
std::string fast_vs_exact(const DenseCase& c) {
  const parity::DenseInputs in = parity::make_inputs(c);
  Record fast, exact;
  parity::reference_forward(c, in, ComputeMode::Fast, &fast);
  parity::reference_forward(c, in, ComputeMode::Exact, &exact);
  const parity::TapDiff d = parity::diff_taps(fast, exact, parity::golden_bound);
  return d.pass() ? std::string() : parity::to_id(c) + "\n" + d.format();
}

// Random small layers (every feature the case generator draws: norms, activations, GLU, GQA,
// RoPE, masks, biases, dropout), fp32 and bf16, tensor parallel size 1 (the reference's own).
RC_GTEST_PROP(FastMode, WithinTheCountedBoundOfExactOnRandomDenseLayers, ()) {
  parity::CaseLimits lim;
  lim.max_tp = 1;
  lim.allow_dropout = true;
  lim.any_dtype = false;
  lim.dtype = *rc::gen::element(DType::F32, DType::BF16);
  const DenseCase c = *parity::gen_dense_case(lim);
  const std::string why = fast_vs_exact(c);
  RC_LOG() << why;
  RC_ASSERT(why.empty());
}

// The benchmark's shapes (bench/bench_reference_layers.cpp): reductions of length 256 to 1024.
TEST(FastMode, WithinTheCountedBoundOfExactOnTheBenchmarkShapes) {
  for (const char* shape :
       {"h=256,a=8,g=8,d=32,ffn=1024,norm=ln,act=gelu,glu=0,bias=1,qkv_bias=1,rope=none,rot=1,qkln=0,mask=causal",
        "h=256,a=8,g=2,d=32,ffn=704,norm=rms,act=silu,glu=1,bias=0,qkv_bias=0,rope=half,rot=1,qkln=0,mask=causal"})
    for (const char* dtype : {"fp32", "bf16"}) {
      const std::string id = std::string("dense(") + shape + ",s=64,b=2,dtype=" + dtype + ",tp=1,sp=0,drop=0,seed=3)";
      EXPECT_EQ(fast_vs_exact(parity::parse_case_id(id)), "") << id;
    }
}

// The GEMMs themselves: fp32 sums of length k, within 2 gamma_k(u_fp32) sum |a_i b_i| of the
// double product (Higham: |fl(sum) - sum| <= gamma_k sum |terms|, one order against another), for
// fp32 inputs, bf16 inputs (the bf16 matmul where the backend has one) and inputs flagged bf16
// that are not (the backend must notice and not read them as bf16).
TEST(FastGemm, MatmulsAreFp32SumsWithinGammaK) {
  const int m = 7, n = 5, k = 300;
  const double g = parity::gamma_n(k, unit_roundoff(DType::F32));
  for (const bool round_inputs : {false, true})
    for (const bool flag_bf16 : {false, true}) {
      FMat a = FMat::Random(m, k), bt = FMat::Random(n, k);
      if (round_inputs) {
        a = testing::round_mat(a.cast<double>(), DType::BF16).cast<float>();
        bt = testing::round_mat(bt.cast<double>(), DType::BF16).cast<float>();
      }
      const FMat b = bt.transpose();
      const FMat nt = matmul_nt(a, bt, 0.5f, flag_bf16), nn = matmul_nn(a, b, flag_bf16);
      const Mat ad = a.cast<double>(), bd = b.cast<double>();
      const FMat ntd = matmul_nt(ad, Mat(bd.transpose()), flag_bf16);  // the double-input form
      // a prepared operand (GemmOperand) is read as the matrix it was made from: the same call
      const GemmOperand bt_prepared(bt, flag_bf16), b_prepared(b, flag_bf16);
      const GemmOperand bt_prepared_d(Mat(bd.transpose()), flag_bf16);
      EXPECT_EQ(matmul_nt(a, bt_prepared, 0.5f, flag_bf16), nt) << round_inputs << flag_bf16;
      EXPECT_EQ(matmul_nn(a, b_prepared, flag_bf16), nn) << round_inputs << flag_bf16;
      EXPECT_EQ(matmul_nt(ad, bt_prepared_d, flag_bf16), ntd) << round_inputs << flag_bf16;
      const Mat exact = ad * bd, mag = ad.cwiseAbs() * bd.cwiseAbs();
      for (int i = 0; i < m; ++i)
        for (int j = 0; j < n; ++j) {
          EXPECT_LE(std::fabs(nn(i, j) - exact(i, j)), 2 * g * mag(i, j))
              << i << "," << j << " bf16 values " << round_inputs << " flagged " << flag_bf16;
          EXPECT_LE(std::fabs(nt(i, j) - 0.5 * exact(i, j)), 2 * g * 0.5 * mag(i, j))
              << i << "," << j << " bf16 values " << round_inputs << " flagged " << flag_bf16;
          EXPECT_LE(std::fabs(ntd(i, j) - exact(i, j)), 2 * g * mag(i, j))
              << i << "," << j << " bf16 values " << round_inputs << " flagged " << flag_bf16;
        }
    }
  EXPECT_FALSE(gemm_backend().empty());
}

TEST(FastGemm, MismatchedInnerDimensionsAreAnError) {
  EXPECT_THROW(matmul_nt(FMat(FMat::Zero(2, 3)), FMat(FMat::Zero(2, 4))), std::invalid_argument);
  EXPECT_THROW(matmul_nt(DMat(DMat::Zero(2, 3)), DMat(DMat::Zero(2, 4)), true), std::invalid_argument);
  EXPECT_THROW(matmul_nn(FMat::Zero(2, 3), FMat::Zero(4, 2)), std::invalid_argument);
  EXPECT_THROW(set_gemm_threads(0), std::invalid_argument);
  EXPECT_EQ(matmul_nt(FMat(FMat::Zero(2, 0)), FMat(FMat::Zero(3, 0))), FMat(FMat::Zero(2, 3)));  // empty sums are 0
}

// A Linear's weight, converted once for fast mode's GEMM, follows set_weight: a forward after it
// reads the new weight (the same output as a Linear built with it), in bf16 (the bf16 matmul's
// operand) and fp32; a weight of the wrong shape is refused.
TEST(FastMode, LinearReadsTheWeightLastSet) {
  for (const DType dt : {DType::BF16, DType::F32}) {
    const Precision fast{ComputeMode::Fast, dt};
    const Mat x = testing::round_mat(Mat::Random(6, 16), dt);
    const Mat w1 = testing::round_mat(Mat::Random(8, 16), dt), w2 = testing::round_mat(Mat::Random(8, 16), dt);
    Linear changed(16, 8, false, false, fast), fresh(16, 8, false, false, fast);
    changed.set_weight(w1);
    const Mat y1 = changed.forward(x).output;
    changed.set_weight(w2);
    fresh.set_weight(w2);
    const Mat y2 = changed.forward(x).output;
    EXPECT_EQ(y2, fresh.forward(x).output) << dtype_name(dt);
    EXPECT_NE(y2, y1) << dtype_name(dt);
    EXPECT_EQ(changed.weight(), w2);
    EXPECT_THROW(changed.set_weight(Mat::Zero(16, 8)), ShapeError);
  }
}

// Exact mode stays what the bounds come from, and FP32 the default the goldens run in.
TEST(FastMode, IsNotTheDefault) {
  EXPECT_EQ(Precision{}.mode, ComputeMode::FP32);
  EXPECT_EQ(Precision::from_config(TransformerConfig{}).mode, ComputeMode::FP32);
  const Precision fast{ComputeMode::Fast, DType::BF16};
  EXPECT_TRUE(fast.fast());
  EXPECT_FALSE(fast.exact());
  EXPECT_EQ(fast.act(1.0 + 1.0 / 512), 1.0);  // rounds like FP32 mode: to bf16, ties to even
}

}  // namespace
}  // namespace twin::reference
