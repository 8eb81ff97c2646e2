// LayerNorm / RMSNorm / L2Norm (reference/torch_norm.h).
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include "dense_test_util.h"
#include "reference/state_dict.h"
#include "reference/torch_norm.h"

using namespace twin;
using namespace twin::reference;
using namespace twin::reference::testing;

namespace {
Mat gen_rows(int rows, int cols) {
  const auto seed = *rc::gen::arbitrary<std::uint32_t>();
  std::mt19937_64 g(seed);
  return random_mat(g, rows, cols, 2.0);
}
RowVec gen_vec(int n) {
  std::mt19937_64 g(*rc::gen::arbitrary<std::uint32_t>());
  return random_mat(g, 1, n).row(0);
}
}  // namespace

TEST(LayerNorm, KnownValues) {
  LayerNorm ln(3, 0.0, false, exact());
  Mat x(1, 3);
  x << 1.0, 2.0, 3.0;  // mean 2, var 2/3
  const Mat y = ln.forward(x);
  const double r = 1.0 / std::sqrt(2.0 / 3.0);
  EXPECT_NEAR(y(0, 0), -r, 1e-15);
  EXPECT_NEAR(y(0, 1), 0.0, 1e-15);
  EXPECT_NEAR(y(0, 2), r, 1e-15);
}

// LayerNorm(a x + c) = LayerNorm(x) for a > 0 (eps -> 0), per row.
RC_GTEST_PROP(LayerNorm, InvariantToScaleAndShiftOfTheInput, ()) {
  const int h = *rc::gen::inRange(2, 24);
  const double a = *rc::gen::inRange(1, 1000) / 10.0;
  const double c = *rc::gen::inRange(-50, 50) / 7.0;
  LayerNorm ln(h, 1e-30, false, exact());
  ln.weight_ = gen_vec(h);
  ln.bias_ = gen_vec(h);
  const Mat x = gen_rows(3, h);
  const Mat xs = (a * x).array() + c;
  RC_ASSERT(max_abs_diff(ln.forward(x), ln.forward(xs)) < 1e-9);
}

// RMSNorm(a x) = RMSNorm(x) for a > 0; RMSNorm(-x) = -RMSNorm(x).
RC_GTEST_PROP(RMSNorm, InvariantToScalingOfTheInput, ()) {
  const int h = *rc::gen::inRange(1, 24);
  const double a = *rc::gen::inRange(1, 1000) / 10.0;
  RMSNorm rms(h, 1e-30, false, exact());
  rms.weight_ = gen_vec(h);
  const Mat x = gen_rows(3, h);
  RC_ASSERT(max_abs_diff(rms.forward(x), rms.forward(a * x)) < 1e-9);
  RC_ASSERT(max_abs_diff(rms.forward(-x), -rms.forward(x)) < 1e-12);
}

// Zero-centred gamma: weight w behaves as gamma = 1 + w.
RC_GTEST_PROP(Norms, ZeroCenteredGammaIsOnePlusWeight, ()) {
  const int h = *rc::gen::inRange(2, 16);
  const RowVec w = gen_vec(h);
  const Mat x = gen_rows(2, h);
  LayerNorm a(h, 1e-5, true, exact()), b(h, 1e-5, false, exact());
  a.weight_ = w;
  b.weight_ = (w.array() + 1.0).matrix();
  RC_ASSERT(max_abs_diff(a.forward(x), b.forward(x)) < 1e-12);
  RMSNorm c(h, 1e-5, true, exact()), d(h, 1e-5, false, exact());
  c.weight_ = w;
  d.weight_ = (w.array() + 1.0).matrix();
  RC_ASSERT(max_abs_diff(c.forward(x), d.forward(x)) < 1e-12);
}

// fp32 mode: outputs are fp32 values and within a few fp32 ulps of the exact value.
RC_GTEST_PROP(Norms, Fp32ModeRoundsToFp32, ()) {
  const int h = *rc::gen::inRange(2, 32);
  const Mat x = gen_rows(2, h);
  LayerNorm f(h, 1e-5, false, Precision{}), e(h, 1e-5, false, exact());
  const Mat yf = f.forward(x), ye = e.forward(x);
  // Bound from the three fp32 rounding points (mean, rstd, output; unit roundoff u = 2^-24):
  // rounding the mean shifts x - mean by u|mean|, which the normalisation scales by rstd, so the
  // bound must carry u * |mean| * rstd (large when a row's spread is small against its mean);
  // rstd and the output each add u * |y|. Factor 4 covers the products' own roundings.
  const double u = std::ldexp(1.0, -24);
  for (Eigen::Index r = 0; r < x.rows(); ++r) {
    const double mean = x.row(r).mean();
    const double rstd = 1.0 / std::sqrt((x.row(r).array() - mean).square().mean() + 1e-5);
    for (Eigen::Index c = 0; c < x.cols(); ++c) {
      RC_ASSERT(yf(r, c) == static_cast<double>(static_cast<float>(yf(r, c))));
      RC_ASSERT(std::abs(yf(r, c) - ye(r, c)) <= 4 * u * (1 + std::abs(ye(r, c)) + std::abs(mean) * rstd));
    }
  }
}

TEST(Norms, Bf16OutputsAreBf16Values) {
  std::mt19937_64 g(3);
  const Mat x = random_mat(g, 4, 8);
  RMSNorm n(8, 1e-5, false, Precision{ComputeMode::FP32, DType::BF16});
  const Mat y = n.forward(x);
  for (Eigen::Index i = 0; i < y.size(); ++i) EXPECT_EQ(y.data()[i], round_to(DType::BF16, y.data()[i]));
}

TEST(Norms, L2NormHasUnitMeanSquare) {
  std::mt19937_64 g(5);
  const Mat x = random_mat(g, 3, 10);
  const Mat y = L2Norm(10, 0.0, exact()).forward(x);
  for (Eigen::Index r = 0; r < 3; ++r) EXPECT_NEAR(y.row(r).squaredNorm() / 10.0, 1.0, 1e-12);
}

TEST(Norms, WrongWidthAndWrongWeightShapeAreErrors) {
  LayerNorm ln(8, 1e-5, false, exact());
  EXPECT_TRUE(throws_with<ShapeError>([&] { ln.forward(Mat::Zero(2, 7)); }, {"LayerNorm", "7", "[8]"}));
  StateDict sd;
  sd.set("input_layernorm.weight", Tensor::zeros(DType::F32, {7}));
  sd.set("input_layernorm.bias", Tensor::zeros(DType::F32, {8}));
  EXPECT_TRUE(throws_with<ShapeError>([&] { ln.load_state_dict(sd, "input_layernorm."); },
                                      {"input_layernorm.weight", "expected shape [8]", "got [7]"}));
  TransformerConfig c;
  c.layernorm_zero_centered_gamma = true;
  EXPECT_TRUE(throws_with<ConfigError>([&] { wrapped_torch_norm(c, 8, 1e-5, exact()); },
                                       {"zero_centered_gamma not supported"}));
  c.layernorm_zero_centered_gamma = false;
  c.normalization = "BatchNorm";
  EXPECT_TRUE(
      throws_with<ConfigError>([&] { wrapped_torch_norm(c, 8, 1e-5, exact()); }, {"normalization", "BatchNorm"}));
}
