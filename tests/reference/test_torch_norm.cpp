// LayerNorm / RMSNorm / L2Norm (reference/torch_norm.h).
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include "counted_bound.h"
#include "dense_test_util.h"
#include "reference/state_dict.h"
#include "reference/torch_norm.h"
#include "tests/case_id.h"

using namespace twin;
using namespace twin::reference;
using namespace twin::reference::testing;

namespace {

// One norm case: a LayerNorm or RMSNorm of width h over `rows` rows, its weight, bias and input
// drawn from `seed`; `scale` and `shift` for the invariance properties, `dtype` for the stored-dtype
// run (exact-mode properties draw fp32 only: Exact mode rounds nowhere, so a dtype changes nothing).
struct NormCase : proptest::PropertyCase {
  static constexpr const char* kKind = "norm";
  std::string norm = "ln";  // ln | rms
  int h = 2;
  int rows = 1;
  double scale = 1.0;
  double shift = 0.0;
  DType dtype = DType::F32;
  std::uint64_t seed = 0;
  template <class V>
  void fields(V& v) {
    v("norm", norm);
    v("h", h);
    v("rows", rows);
    v("scale", scale);
    v("shift", shift);
    v("dtype", dtype);
    v("seed", seed);
  }
};

struct NormDraw {
  std::vector<std::string> norms{"ln", "rms"};
  int min_h = 1, max_h = 24;
  bool scale_shift = false;  // draw scale in [0.1, 100) and (LayerNorm) shift in [-50/7, 50/7)
  bool dtypes = false;       // draw fp32 | bf16 | fp16
};

rc::Gen<NormCase> gen_norm_case(NormDraw d) {
  return proptest::rerunnable<NormCase>(rc::gen::exec([d] {
    NormCase c;
    c.norm = d.norms[*rc::gen::inRange<std::size_t>(0, d.norms.size())];
    c.h = *rc::gen::inRange(d.min_h, d.max_h + 1);
    c.rows = *rc::gen::inRange(1, 4);
    if (d.scale_shift) {
      c.scale = *rc::gen::inRange(1, 1000) / 10.0;
      if (c.norm == "ln") c.shift = *rc::gen::inRange(-50, 50) / 7.0;
    }
    if (d.dtypes) c.dtype = *proptest::gen_case_dtype();
    c.seed = *rc::gen::arbitrary<std::uint32_t>();
    return c;
  }));
}

// The case's data, in its dtype: input [rows, h] (spread 2), weight and bias [h].
struct NormData {
  Mat x;
  RowVec weight, bias;
};
NormData norm_data(const NormCase& c) {
  std::mt19937_64 g(c.seed);
  NormData d;
  d.x = round_mat(random_mat(g, c.rows, c.h, 2.0), c.dtype);
  d.weight = round_vec(random_mat(g, 1, c.h).row(0), c.dtype);
  d.bias = round_vec(random_mat(g, 1, c.h).row(0), c.dtype);
  return d;
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
  NormDraw draw;
  draw.norms = {"ln"};
  draw.min_h = 2;
  draw.max_h = 23;
  draw.scale_shift = true;
  const NormCase c = *gen_norm_case(draw);
  const NormData d = norm_data(c);
  LayerNorm ln(c.h, 1e-30, false, exact());
  ln.weight_ = d.weight;
  ln.bias_ = d.bias;
  const Mat xs = (c.scale * d.x).array() + c.shift;
  RC_ASSERT(max_abs_diff(ln.forward(d.x), ln.forward(xs)) < 1e-9);
}

// RMSNorm(a x) = RMSNorm(x) for a > 0; RMSNorm(-x) = -RMSNorm(x).
RC_GTEST_PROP(RMSNorm, InvariantToScalingOfTheInput, ()) {
  NormDraw draw;
  draw.norms = {"rms"};
  draw.max_h = 23;
  draw.scale_shift = true;
  const NormCase c = *gen_norm_case(draw);
  const NormData d = norm_data(c);
  RMSNorm rms(c.h, 1e-30, false, exact());
  rms.weight_ = d.weight;
  RC_ASSERT(max_abs_diff(rms.forward(d.x), rms.forward(c.scale * d.x)) < 1e-9);
  RC_ASSERT(max_abs_diff(rms.forward(-d.x), -rms.forward(d.x)) < 1e-12);
}

// Zero-centred gamma: weight w behaves as gamma = 1 + w.
RC_GTEST_PROP(Norms, ZeroCenteredGammaIsOnePlusWeight, ()) {
  NormDraw draw;
  draw.min_h = 2;
  draw.max_h = 15;
  const NormCase c = *gen_norm_case(draw);
  const NormData d = norm_data(c);
  const RowVec one_plus_w = (d.weight.array() + 1.0).matrix();
  if (c.norm == "ln") {
    LayerNorm a(c.h, 1e-5, true, exact()), b(c.h, 1e-5, false, exact());
    a.weight_ = d.weight;
    b.weight_ = one_plus_w;
    RC_ASSERT(max_abs_diff(a.forward(d.x), b.forward(d.x)) < 1e-12);
  } else {
    RMSNorm a(c.h, 1e-5, true, exact()), b(c.h, 1e-5, false, exact());
    a.weight_ = d.weight;
    b.weight_ = one_plus_w;
    RC_ASSERT(max_abs_diff(a.forward(d.x), b.forward(d.x)) < 1e-12);
  }
}

// fp32 mode: outputs are fp32 values and within a few fp32 ulps of the exact value.
RC_GTEST_PROP(Norms, Fp32ModeRoundsToFp32, ()) {
  NormDraw draw;
  draw.norms = {"ln"};
  draw.min_h = 2;
  draw.max_h = 31;
  const NormCase c = *gen_norm_case(draw);
  const Mat x = norm_data(c).x;
  const int h = c.h;
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

// LayerNorm and RMSNorm stored in fp32, bf16 or fp16 (Megatron's params_dtype; both norms run in
// each): the outputs are values of that dtype, within the golden bound of the rounding points the
// run counted from its Exact run on the same inputs. LayerNorm's error follows its
// error_magnitude (the shift by the rounded mean scales with |mean| rstd |gamma|), RMSNorm's the
// output's own magnitude (its roundings are all relative).
RC_GTEST_PROP(Norms, StoredDtypeRunIsWithinItsCountedRoundingsOfExact, ()) {
  NormDraw draw;
  draw.min_h = 2;
  draw.dtypes = true;
  const NormCase c = *gen_norm_case(draw);
  const NormData d = norm_data(c);
  const Precision p{ComputeMode::FP32, c.dtype};
  if (c.norm == "ln") {
    LayerNorm n(c.h, 1e-5, false, p), e(c.h, 1e-5, false, exact());
    n.weight_ = e.weight_ = d.weight;
    n.bias_ = e.bias_ = d.bias;
    const auto [y, rounding] = run_counted([&] { return n.forward(d.x); });
    RC_ASSERT(all_in_dtype(y, c.dtype));
    const std::string why = outside_counted_bound(y, e.forward(d.x), rounding, e.error_magnitude(d.x));
    RC_LOG() << why;
    RC_ASSERT(why.empty());
  } else {
    RMSNorm n(c.h, 1e-5, false, p), e(c.h, 1e-5, false, exact());
    n.weight_ = e.weight_ = d.weight;
    const auto [y, rounding] = run_counted([&] { return n.forward(d.x); });
    RC_ASSERT(all_in_dtype(y, c.dtype));
    const std::string why = outside_counted_bound(y, e.forward(d.x), rounding);
    RC_LOG() << why;
    RC_ASSERT(why.empty());
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
