// Linear (ColumnParallelLinear / RowParallelLinear), activations, MLP (reference/linear.h,
// activations.h, mlp.h).
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <algorithm>
#include <cmath>

#include "counted_bound.h"
#include "dense_test_util.h"
#include "reference/activations.h"
#include "reference/linear.h"
#include "reference/mlp.h"
#include "reference/state_dict.h"
#include "tests/case_id.h"

using namespace twin;
using namespace twin::reference;
using namespace twin::reference::testing;

namespace {

// The definitions the activations implement, written out in double here (not taken from the code
// under test), with the constants derived rather than copied.
const double kPi = std::acos(-1.0);
const double kSqrt2OverPi = std::sqrt(2.0 / kPi);  // the tanh approximation's sqrt(2 / pi)
// The cubic coefficient of the tanh approximation as Hendrycks & Gimpel define it ("Gaussian Error
// Linear Units (GELUs)", 2016, section 2: 0.5 x (1 + tanh[sqrt(2/pi) (x + 0.044715 x^3)])).
constexpr double kGeluCubic = 0.044715;

double erf_gelu_def(double x) { return x * 0.5 * std::erfc(-x / std::sqrt(2.0)); }  // x Phi(x)
double tanh_gelu_def(double x) { return 0.5 * x * (1.0 + std::tanh(kSqrt2OverPi * (x + kGeluCubic * x * x * x))); }
double silu_def(double x) { return x / (1.0 + std::exp(-x)); }  // x sigmoid(x)

// Megatron writes sqrt(2 / pi) to a fixed number of decimals (0.79788456, 0.7978845608): a constant
// within `dc` of sqrt(2 / pi) moves 0.5 x (1 + tanh(c u)), u = x (1 + 0.044715 x^2), by at most
// |d/dc| dc = 0.5 |x| sech^2(c u) |u| dc <= 0.5 |x u| dc.
double tanh_constant_bound(double x, double dc) { return 0.5 * std::abs(x * x * (1.0 + kGeluCubic * x * x)) * dc; }

// One Linear case: weight [out, in], bias [out] and an input [rows, in] drawn from `seed`.
struct LinearCase : proptest::PropertyCase {
  static constexpr const char* kKind = "linear";
  int in = 1;
  int out = 1;
  int rows = 1;
  DType dtype = DType::F32;
  std::uint64_t seed = 0;
  template <class V>
  void fields(V& v) {
    v("in", in);
    v("out", out);
    v("rows", rows);
    v("dtype", dtype);
    v("seed", seed);
  }
};
rc::Gen<LinearCase> gen_linear_case(bool dtypes) {
  return proptest::rerunnable<LinearCase>(rc::gen::exec([dtypes] {
    LinearCase c;
    c.in = *rc::gen::inRange(1, 12);
    c.out = *rc::gen::inRange(1, 12);
    c.rows = *rc::gen::inRange(1, 6);
    if (dtypes) c.dtype = *proptest::gen_case_dtype();
    c.seed = *rc::gen::arbitrary<std::uint32_t>();
    return c;
  }));
}

// One MLP case (Megatron's MLP: linear_fc1, activation or GLU, linear_fc2) with its parameters
// and an input [rows, h] drawn from `seed`.
struct MlpCase : proptest::PropertyCase {
  static constexpr const char* kKind = "mlp";
  int h = 2;
  int ffn = 2;
  int rows = 1;
  std::string act = "gelu";  // gelu | silu | relu
  bool glu = false;
  bool bias = true;
  DType dtype = DType::F32;
  std::uint64_t seed = 0;
  template <class V>
  void fields(V& v) {
    v("h", h);
    v("ffn", ffn);
    v("rows", rows);
    v("act", act);
    v("glu", glu);
    v("bias", bias);
    v("dtype", dtype);
    v("seed", seed);
  }
};
rc::Gen<MlpCase> gen_mlp_case() {
  return proptest::rerunnable<MlpCase>(rc::gen::exec([] {
    MlpCase c;
    c.h = *rc::gen::inRange(1, 17);
    c.ffn = *rc::gen::inRange(1, 33);
    c.rows = *rc::gen::inRange(1, 7);
    c.act = *rc::gen::element<std::string>("gelu", "silu", "relu");
    c.glu = *rc::gen::arbitrary<bool>();
    c.bias = *rc::gen::arbitrary<bool>();
    c.dtype = *proptest::gen_case_dtype();
    c.seed = *rc::gen::arbitrary<std::uint32_t>();
    return c;
  }));
}

// One GLU case: an input [rows, 2 f] (spread 3) from `seed`, the offset added to the second half.
struct GluCase : proptest::PropertyCase {
  static constexpr const char* kKind = "glu";
  int f = 1;
  int rows = 3;
  double offset = 0.0;
  std::uint64_t seed = 0;
  template <class V>
  void fields(V& v) {
    v("f", f);
    v("rows", rows);
    v("offset", offset);
    v("seed", seed);
  }
};

}  // namespace

// Exact mode (no dtype enters): skip_bias_add moves the bias out of the product, nothing else.
RC_GTEST_PROP(Linear, SkipBiasAddReturnsTheBiasSeparately, ()) {
  const LinearCase lc = *gen_linear_case(false);
  const int in = lc.in, out = lc.out;
  std::mt19937_64 g(lc.seed);
  Linear fused(in, out, true, false, exact()), skip(in, out, true, true, exact());
  skip.set_weight(random_mat(g, out, in));
  fused.set_weight(skip.weight());
  fused.bias = skip.bias = random_mat(g, 1, out).row(0);
  const Mat x = random_mat(g, lc.rows, in);
  const OutputWithBias a = fused.forward(x), b = skip.forward(x);
  RC_ASSERT(!a.bias.has_value());
  RC_ASSERT(b.bias.has_value());
  Mat sum = b.output;
  sum.rowwise() += *b.bias;
  RC_ASSERT(max_abs_diff(a.output, sum) < kExactTol);
  RC_ASSERT(max_abs_diff(b.output, x * skip.weight().transpose()) < kExactTol);  // weight is [out, in]
}

TEST(Linear, WeightShapeMismatchNamesKeyAndShapes) {
  Linear l(8, 4, true, true, exact());
  StateDict sd;
  sd.set("mlp.linear_fc1.weight", Tensor::zeros(DType::F32, {8, 4}));  // transposed
  sd.set("mlp.linear_fc1.bias", Tensor::zeros(DType::F32, {4}));
  EXPECT_TRUE(throws_with<ShapeError>([&] { l.load_state_dict(sd, "mlp.linear_fc1."); },
                                      {"mlp.linear_fc1.weight", "expected shape [4, 8]", "got [8, 4]"}));
  EXPECT_TRUE(throws_with<ShapeError>([&] { l.forward(Mat::Zero(2, 5)); }, {"Linear", "5"}));
}

TEST(Activations, KnownValues) {
  const Precision p = exact();
  Mat x(1, 4);
  x << -1.0, 0.0, 0.5, 2.0;
  const Mat gelu = apply_activation(ActivationFunc::Gelu, x, p);
  EXPECT_NEAR(gelu(0, 0), -0.15865525393145707, 1e-15);  // x * Phi(x)
  EXPECT_NEAR(gelu(0, 3), 1.9544997361036416, 1e-15);
  const Mat silu = apply_activation(ActivationFunc::Silu, x, p);
  EXPECT_NEAR(silu(0, 3), 2.0 / (1.0 + std::exp(-2.0)), 1e-15);
  const Mat sq = apply_activation(ActivationFunc::SquaredRelu, x, p);
  EXPECT_EQ(sq(0, 0), 0.0);
  EXPECT_EQ(sq(0, 3), 4.0);
  const Mat qg = apply_activation(ActivationFunc::QuickGelu, x, p);
  EXPECT_NEAR(qg(0, 2), 0.5 / (1.0 + std::exp(-0.851)), 1e-15);
  const Mat relu = apply_activation(ActivationFunc::Relu, x, p);
  EXPECT_EQ(relu(0, 0), 0.0);
  EXPECT_EQ(relu(0, 2), 0.5);
  EXPECT_TRUE(throws_with<ConfigError>([] { activation_from_name("swishy"); }, {"activation_func", "swishy"}));
}

// Every GELU form against its definition in double, over [-6, 6]: gelu is x Phi(x); openai_gelu and
// fast_gelu are the tanh approximation with sqrt(2 / pi) written to 16 and 10 decimals; erf_gelu
// divides by 1.41421 for sqrt(2). Each bound is what that written-out constant can move the value
// (plus kExactTol for double's own rounding), so a wrong coefficient (1e-5 off) fails by orders
// of magnitude.
TEST(Activations, GeluFormsMatchTheirDefinitions) {
  const Precision p = exact();
  Mat x(1, 241);
  for (int i = 0; i < x.cols(); ++i) x(0, i) = -6.0 + 0.05 * i;
  const Mat gelu = apply_activation(ActivationFunc::Gelu, x, p);
  const Mat openai = apply_activation(ActivationFunc::OpenAIGelu, x, p);
  const Mat fast = apply_activation(ActivationFunc::FastGelu, x, p);
  const Mat erf_form = apply_activation(ActivationFunc::ErfGelu, x, p);
  const double sqrt2 = std::sqrt(2.0);
  for (int i = 0; i < x.cols(); ++i) {
    const double v = x(0, i);
    EXPECT_NEAR(gelu(0, i), erf_gelu_def(v), kExactTol) << v;
    EXPECT_NEAR(openai(0, i), tanh_gelu_def(v), tanh_constant_bound(v, 0.5e-16) + kExactTol) << v;
    EXPECT_NEAR(fast(0, i), tanh_gelu_def(v), tanh_constant_bound(v, 0.5e-10) + kExactTol) << v;
    // d/dd 0.5 x erf(x / d) = -0.5 x erf'(x / d) x / d^2, erf' <= 2 / sqrt(pi); |1.41421 - sqrt 2| < 4e-6
    const double erf_bound = 0.5 * v * v * (2.0 / std::sqrt(kPi)) / (1.41421 * 1.41421) * std::abs(1.41421 - sqrt2);
    EXPECT_NEAR(erf_form(0, i), erf_gelu_def(v), erf_bound + kExactTol) << v;
  }
}

// glu(x) = act(first half) * (second half + offset), with the clamp.
// Exact mode (no dtype enters).
RC_GTEST_PROP(Activations, GluSplitsFirstHalfActivated, ()) {
  const GluCase gc = *proptest::rerunnable<GluCase>(rc::gen::exec([] {
    GluCase c;
    c.f = *rc::gen::inRange(1, 8);
    c.offset = *rc::gen::inRange(0, 3);
    c.seed = *rc::gen::arbitrary<std::uint32_t>();
    return c;
  }));
  const int f = gc.f;
  std::mt19937_64 g(gc.seed);
  const Mat x = random_mat(g, gc.rows, 2 * f, 3.0);
  const double offset = gc.offset;
  const Mat y = glu(ActivationFunc::Silu, x, offset, std::nullopt, exact());
  const Mat yc = glu(ActivationFunc::Silu, x, 0.0, 1.0, exact());
  for (Eigen::Index r = 0; r < x.rows(); ++r)
    for (Eigen::Index c = 0; c < f; ++c) {
      const double first = x(r, c), second = x(r, f + c);
      RC_ASSERT(std::abs(y(r, c) - silu_def(first) * (second + offset)) < kExactTol);
      // activation_func_clamp_value 1: the first half clamped above, the second to [-1, 1]
      RC_ASSERT(std::abs(yc(r, c) - silu_def(std::min(first, 1.0)) * std::clamp(second, -1.0, 1.0)) < kExactTol);
    }
}

// Linear stored in fp32, bf16 or fp16: the output is a value of that dtype within the golden bound
// of its counted rounding points (one store after an fp32-accumulated product of length in) of the
// Exact run on the same dtype-valued weight, bias and input.
RC_GTEST_PROP(Linear, StoredDtypeRunIsWithinItsCountedRoundingsOfExact, ()) {
  const LinearCase lc = *gen_linear_case(true);
  std::mt19937_64 g(lc.seed);
  Linear l(lc.in, lc.out, true, false, Precision{ComputeMode::FP32, lc.dtype}), e(lc.in, lc.out, true, false, exact());
  e.set_weight(round_mat(random_mat(g, lc.out, lc.in), lc.dtype));
  l.set_weight(e.weight());
  l.bias = e.bias = round_vec(random_mat(g, 1, lc.out).row(0), lc.dtype);
  const Mat x = round_mat(random_mat(g, lc.rows, lc.in), lc.dtype);
  const auto [y, rounding] = run_counted([&] { return l.forward(x).output; });
  RC_ASSERT(all_in_dtype(y, lc.dtype));
  // The error of x W^T + b follows |x| |W|^T + |b| (the product's store rounds relative to the
  // product, which the bias may cancel), not the output's own size.
  Mat mag = x.cwiseAbs() * e.weight().cwiseAbs().transpose();
  mag.rowwise() += e.bias.cwiseAbs();
  const std::string why = outside_counted_bound(y, e.forward(x).output, rounding, mag.maxCoeff());
  RC_LOG() << why;
  RC_ASSERT(why.empty());
}

// The MLP (gelu / silu / relu, with or without GLU and biases) stored in fp32, bf16 or fp16: the
// output a value of that dtype, within the golden bound of the rounding points the run counted
// (fc1's and fc2's stores and reductions, the activation's) of its Exact run.
RC_GTEST_PROP(MLP, StoredDtypeRunIsWithinItsCountedRoundingsOfExact, ()) {
  const MlpCase mc = *gen_mlp_case();
  TransformerConfig c = small_config(mc.h, 1, 1, mc.ffn);
  c.activation_func = mc.act;
  c.gated_linear_unit = mc.glu;
  c.add_bias_linear = mc.bias;
  MLP mlp(c, Precision{ComputeMode::FP32, mc.dtype}), ex(c, exact());
  std::mt19937_64 g(mc.seed);
  const int fc1_out = mc.glu ? 2 * mc.ffn : mc.ffn;
  ex.linear_fc1.set_weight(round_mat(random_mat(g, fc1_out, mc.h), mc.dtype));
  mlp.linear_fc1.set_weight(ex.linear_fc1.weight());
  ex.linear_fc2.set_weight(round_mat(random_mat(g, mc.h, mc.ffn), mc.dtype));
  mlp.linear_fc2.set_weight(ex.linear_fc2.weight());
  if (mc.bias) {
    mlp.linear_fc1.bias = ex.linear_fc1.bias = round_vec(random_mat(g, 1, fc1_out).row(0), mc.dtype);
    mlp.linear_fc2.bias = ex.linear_fc2.bias = round_vec(random_mat(g, 1, mc.h).row(0), mc.dtype);
  }
  const Mat x = round_mat(random_mat(g, mc.rows, mc.h), mc.dtype);
  MlpArgs args;
  args.lead = {mc.rows};
  const auto [y, rounding] = run_counted([&] { return mlp.forward(x, args, Taps()).output; });
  RC_ASSERT(all_in_dtype(y, mc.dtype));
  // The magnitude each rounding error propagates with, layer by layer (running error analysis):
  // fc1's output errors follow m1 = |x| |W1|^T + |b1|; the activation passes them on scaled by at
  // most its largest slope L (GELU's is 1.129 at x = 1.5, SiLU's 1.100, ReLU's 1) and is itself at
  // most |y| <= m1 in size; GLU's act(y1) y2 moves by L m1a |y2| + |act(y1)| m1b <= (L + 1) m1a m1b;
  // fc2 then sums them with |W2| (its bias is returned apart: skip_bias_add). Each store's error is
  // at most u times this magnitude at the output, so the count's eps times it bounds them all.
  const double L = 1.13;
  const Mat m1 = [&] {
    Mat m = x.cwiseAbs() * ex.linear_fc1.weight().cwiseAbs().transpose();
    if (mc.bias) m.rowwise() += ex.linear_fc1.bias.cwiseAbs();
    return m;
  }();
  const Mat ma = mc.glu ? Mat((L + 1.0) * m1.leftCols(mc.ffn).cwiseProduct(m1.rightCols(mc.ffn))) : Mat(L * m1);
  const Mat mag = ma * ex.linear_fc2.weight().cwiseAbs().transpose();
  const std::string why = outside_counted_bound(y, ex.forward(x, args, Taps()).output, rounding, mag.maxCoeff());
  RC_LOG() << why;
  RC_ASSERT(why.empty());
}

// MLP = fc2(act(fc1(x) + b1)) with fc2's bias returned separately; taps in order.
TEST(MLP, ComputesFc1ActivationFc2AndRecordsTaps) {
  TransformerConfig c = small_config(8, 2, 2, 12);
  c.activation_func = "gelu";
  MLP mlp(c, exact());
  std::mt19937_64 g(11);
  mlp.linear_fc1.set_weight(random_mat(g, 12, 8));
  mlp.linear_fc1.bias = random_mat(g, 1, 12).row(0);
  mlp.linear_fc2.set_weight(random_mat(g, 8, 12));
  mlp.linear_fc2.bias = random_mat(g, 1, 8).row(0);
  const Mat x = random_mat(g, 6, 8);
  TapRecord rec;
  MlpArgs args;
  args.lead = {3, 2};
  const OutputWithBias out = mlp.forward(x, args, Taps(&rec, "mlp."));
  Mat h = x * mlp.linear_fc1.weight().transpose();
  h.rowwise() += mlp.linear_fc1.bias;
  const Mat expect = h.unaryExpr(&erf_gelu_def) * mlp.linear_fc2.weight().transpose();
  EXPECT_LT(max_abs_diff(out.output, expect), kExactTol);
  ASSERT_TRUE(out.bias);
  EXPECT_LT((*out.bias - mlp.linear_fc2.bias).cwiseAbs().maxCoeff(), kExactTol);
  std::vector<std::string> names;
  for (const auto& e : rec.entries) names.push_back(e.name);
  EXPECT_EQ(names, (std::vector<std::string>{"mlp.linear_fc1.0", "mlp.linear_fc1.1", "mlp.linear_fc2.0",
                                             "mlp.linear_fc2.1", "mlp.0", "mlp.1"}));
  EXPECT_EQ(rec.find("mlp.linear_fc1.0")->shape(), (Shape{3, 2, 12}));
}

TEST(MLP, GatedLinearUnitDoublesFc1) {
  TransformerConfig c = small_config(8, 2, 2, 12);
  c.gated_linear_unit = true;
  c.add_bias_linear = false;
  MLP mlp(c, exact());
  EXPECT_EQ(mlp.linear_fc1.output_size(), 24);
  EXPECT_EQ(mlp.linear_fc2.input_size(), 12);
  StateDict sd;
  sd.set("mlp.linear_fc1.weight", Tensor::zeros(DType::F32, {12, 8}));
  sd.set("mlp.linear_fc2.weight", Tensor::zeros(DType::F32, {8, 12}));
  EXPECT_TRUE(throws_with<ShapeError>([&] { mlp.load_state_dict(sd, "mlp."); },
                                      {"mlp.linear_fc1.weight", "expected shape [24, 8]", "got [12, 8]"}));
}

// bias_activation_fusion: gelu becomes bias_gelu_impl's tanh form; swiglu is silu(y1) * y2.
TEST(MLP, BiasActivationFusionMirrorsTheFusedFunctions) {
  TransformerConfig c = small_config(4, 2, 2, 6);
  c.bias_activation_fusion = true;
  std::mt19937_64 g(12);
  const Mat x = random_mat(g, 5, 4);
  auto run = [&](const TransformerConfig& cc) {
    MLP mlp(cc, exact());
    std::mt19937_64 gw(13);
    mlp.linear_fc1.set_weight(random_mat(gw, mlp.linear_fc1.output_size(), 4));
    if (mlp.linear_fc1.has_bias()) mlp.linear_fc1.bias = random_mat(gw, 1, mlp.linear_fc1.output_size()).row(0);
    mlp.linear_fc2.set_weight(Mat::Identity(4, 6));
    MlpArgs args;
    args.lead = {5};
    return mlp.forward(x, args, Taps()).output;
  };
  std::mt19937_64 gw(13);
  const Mat w1 = random_mat(gw, 6, 4);
  const RowVec b1 = random_mat(gw, 1, 6).row(0);
  Mat h = x * w1.transpose();
  h.rowwise() += b1;
  // bias_gelu_impl is the tanh approximation with sqrt(2 / pi) written as 0.79788456 (8 decimals).
  const Mat fused = run(c);
  for (Eigen::Index r = 0; r < fused.rows(); ++r)
    for (Eigen::Index j = 0; j < fused.cols(); ++j)
      EXPECT_NEAR(fused(r, j), tanh_gelu_def(h(r, j)), tanh_constant_bound(h(r, j), 0.5e-8) + kExactTol)
          << "row " << r << " column " << j << " (fc2 is the identity: column j is fc1's)";
  TransformerConfig unfused = c;
  unfused.bias_activation_fusion = false;
  EXPECT_GT(max_abs_diff(run(c), run(unfused)), 1e-6);  // erf vs tanh gelu differ
  c.activation_func = unfused.activation_func = "silu";
  c.gated_linear_unit = unfused.gated_linear_unit = true;
  EXPECT_LT(max_abs_diff(run(c), run(unfused)), kExactTol);  // swiglu: same math
  c.activation_func = "quick_gelu";
  EXPECT_TRUE(throws_with<ConfigError>([&] { MLP(c, exact()); }, {"Only support fusion of gelu and swiglu"}));
}
