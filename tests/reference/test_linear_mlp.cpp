// Linear (ColumnParallelLinear / RowParallelLinear), activations, MLP (reference/linear.h,
// activations.h, mlp.h).
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include "dense_test_util.h"
#include "reference/activations.h"
#include "reference/linear.h"
#include "reference/mlp.h"
#include "reference/state_dict.h"

using namespace twin;
using namespace twin::reference;
using namespace twin::reference::testing;

RC_GTEST_PROP(Linear, SkipBiasAddReturnsTheBiasSeparately, ()) {
  const int in = *rc::gen::inRange(1, 12), out = *rc::gen::inRange(1, 12);
  std::mt19937_64 g(*rc::gen::arbitrary<std::uint32_t>());
  Linear fused(in, out, true, false, exact()), skip(in, out, true, true, exact());
  fused.weight = skip.weight = random_mat(g, out, in);
  fused.bias = skip.bias = random_mat(g, 1, out).row(0);
  const Mat x = random_mat(g, 5, in);
  const OutputWithBias a = fused.forward(x), b = skip.forward(x);
  RC_ASSERT(!a.bias.has_value());
  RC_ASSERT(b.bias.has_value());
  Mat sum = b.output;
  sum.rowwise() += *b.bias;
  RC_ASSERT(max_abs_diff(a.output, sum) < kExactTol);
  RC_ASSERT(max_abs_diff(b.output, x * skip.weight.transpose()) < kExactTol);  // weight is [out, in]
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

// glu(x) = act(first half) * (second half + offset), with the clamp.
RC_GTEST_PROP(Activations, GluSplitsFirstHalfActivated, ()) {
  const int f = *rc::gen::inRange(1, 8);
  std::mt19937_64 g(*rc::gen::arbitrary<std::uint32_t>());
  const Mat x = random_mat(g, 3, 2 * f, 3.0);
  const double offset = *rc::gen::inRange(0, 3);
  const Mat y = glu(ActivationFunc::Silu, x, offset, std::nullopt, exact());
  const Mat a = apply_activation(ActivationFunc::Silu, x.leftCols(f), exact());
  RC_ASSERT(max_abs_diff(y, a.cwiseProduct((x.rightCols(f).array() + offset).matrix())) < kExactTol);
  const Mat yc = glu(ActivationFunc::Silu, x, 0.0, 1.0, exact());
  const Mat ac = apply_activation(ActivationFunc::Silu, x.leftCols(f).cwiseMin(1.0), exact());
  RC_ASSERT(max_abs_diff(yc, ac.cwiseProduct(x.rightCols(f).cwiseMin(1.0).cwiseMax(-1.0))) < kExactTol);
}

// MLP = fc2(act(fc1(x) + b1)) with fc2's bias returned separately; taps in order.
TEST(MLP, ComputesFc1ActivationFc2AndRecordsTaps) {
  TransformerConfig c = small_config(8, 2, 2, 12);
  c.activation_func = "gelu";
  MLP mlp(c, exact());
  std::mt19937_64 g(11);
  mlp.linear_fc1.weight = random_mat(g, 12, 8);
  mlp.linear_fc1.bias = random_mat(g, 1, 12).row(0);
  mlp.linear_fc2.weight = random_mat(g, 8, 12);
  mlp.linear_fc2.bias = random_mat(g, 1, 8).row(0);
  const Mat x = random_mat(g, 6, 8);
  TapRecord rec;
  MlpArgs args;
  args.lead = {3, 2};
  const OutputWithBias out = mlp.forward(x, args, Taps(&rec, "mlp."));
  Mat h = x * mlp.linear_fc1.weight.transpose();
  h.rowwise() += mlp.linear_fc1.bias;
  const Mat expect = apply_activation(ActivationFunc::Gelu, h, exact()) * mlp.linear_fc2.weight.transpose();
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
    mlp.linear_fc1.weight = random_mat(gw, mlp.linear_fc1.output_size(), 4);
    if (mlp.linear_fc1.has_bias()) mlp.linear_fc1.bias = random_mat(gw, 1, mlp.linear_fc1.output_size()).row(0);
    mlp.linear_fc2.weight = Mat::Identity(4, 6);
    MlpArgs args;
    args.lead = {5};
    return mlp.forward(x, args, Taps()).output;
  };
  std::mt19937_64 gw(13);
  const Mat w1 = random_mat(gw, 6, 4);
  const RowVec b1 = random_mat(gw, 1, 6).row(0);
  Mat h = x * w1.transpose();
  h.rowwise() += b1;
  const Mat tanh_gelu =
      h.unaryExpr([](double v) { return v * 0.5 * (1.0 + std::tanh(0.79788456 * v * (1 + 0.044715 * v * v))); });
  EXPECT_LT(max_abs_diff(run(c), tanh_gelu.leftCols(4)), kExactTol);
  TransformerConfig unfused = c;
  unfused.bias_activation_fusion = false;
  EXPECT_GT(max_abs_diff(run(c), run(unfused)), 1e-6);  // erf vs tanh gelu differ
  c.activation_func = unfused.activation_func = "silu";
  c.gated_linear_unit = unfused.gated_linear_unit = true;
  EXPECT_LT(max_abs_diff(run(c), run(unfused)), kExactTol);  // swiglu: same math
  c.activation_func = "quick_gelu";
  EXPECT_TRUE(throws_with<ConfigError>([&] { MLP(c, exact()); }, {"Only support fusion of gelu and swiglu"}));
}
