// MoE config features that only these tests reach, checked against something independent of the
// reference's code:
// - moe_apply_probs_on_input (SequentialMLP.forward, megatron/core/transformer/moe/experts.py):
//   the top-1 probability scales the expert's input, then the expert runs with probability 1; a
//   constructed answer computed here in double.
// - moe_input_jitter_eps (TopKRouter.apply_input_jitter, router.py): the router's input times
//   Uniform(1 - eps, 1 + eps) noise, drawn afresh on every call, in training and in eval, and only
//   on the router's input. The reference draws from its own generator, not torch's stream, so the
//   noise is checked against its law (range, mean, Kolmogorov-Smirnov), not value by value.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "reference/moe/moe_layer.h"
#include "tests/reference/moe/moe_test_util.h"

namespace twin::reference::moe {
namespace {

using testing::f64_tensor;
using testing::random_mat;
using testing::random_moe_state_dict;
using testing::small_moe_config;

const Precision kFp32{ComputeMode::FP32, DType::F32};
const Precision kExact{ComputeMode::Exact, DType::F32};

// E = 3 experts on h = 4; token t is routed to expert a = t % 3 by router weight I (rows 0..2)
// and an input whose column a is the largest. Expert e: linear_fc1 = I (bias 0), squared_relu,
// linear_fc2 = (e + 1) I, linear_fc2.bias = e. With the top-1 probability p = softmax(logits)_a
// (moe_router_pre_softmax: the softmax over all E logits), Megatron computes
//   with moe_apply_probs_on_input:  (a + 1) relu(p x)^2 + a      (probs reset to 1)
//   without:                         p ((a + 1) relu(x)^2 + a)   (per_token_scale on the
//                                                                  activation and on the fc2 bias)
// squared_relu is not positively homogeneous and the bias is scaled only in the second form, so
// the two differ wherever p < 1.
TEST(MoEApplyProbsOnInput, TopOneProbabilityScalesTheExpertInput) {
  const int E = 3, h = 4, T = 12;
  TransformerConfig c = small_moe_config(E, 1);
  c.hidden_size = h;
  c.moe_ffn_hidden_size = h;
  c.activation_func = "squared_relu";
  c.add_bias_linear = true;
  c.moe_router_load_balancing_type = "none";
  c.moe_aux_loss_coeff = 0.0;
  std::mt19937_64 g(5);
  std::uniform_real_distribution<double> u(-0.5, 0.5);
  Mat x(T, h);
  for (Index t = 0; t < T; ++t) {
    for (Index j = 0; j < h; ++j) x(t, j) = u(g);
    x(t, t % E) = 1.0 + 0.1 * static_cast<double>(t);  // the largest logit: expert t % E
  }
  StateDict sd;
  Mat router = Mat::Zero(E, h);
  for (int e = 0; e < E; ++e) router(e, e) = 1.0;
  sd.set("mlp.router.weight", f64_tensor(router, {E, h}));
  sd.set("mlp.router.bias", f64_tensor(Mat::Zero(1, E), {E}));
  for (int e = 0; e < E; ++e) {
    const std::string k = "mlp.experts.local_experts." + std::to_string(e) + ".";
    sd.set(k + "linear_fc1.weight", f64_tensor(Mat(Mat::Identity(h, h)), {h, h}));
    sd.set(k + "linear_fc1.bias", f64_tensor(Mat::Zero(1, h), {h}));
    sd.set(k + "linear_fc2.weight", f64_tensor(Mat((e + 1.0) * Mat::Identity(h, h)), {h, h}));
    sd.set(k + "linear_fc2.bias", f64_tensor(Mat::Constant(1, h, static_cast<double>(e)), {h}));
  }
  auto relu2 = [](double v) { return v > 0 ? v * v : 0.0; };
  for (const bool on_input : {true, false}) {
    c.moe_apply_probs_on_input = on_input;
    for (const char* dispatcher : {"allgather", "alltoall"}) {
      SCOPED_TRACE(std::string(dispatcher) + (on_input ? " probs on input" : " probs on output"));
      c.moe_token_dispatcher_type = dispatcher;
      MoELayer layer(c, kExact);
      layer.load_state_dict(sd, "mlp.");
      MlpArgs args;
      args.lead = {T / 2, 2};
      const Mat out = layer.forward(x, args, Taps()).output;
      for (Index t = 0; t < T; ++t) {
        const int a = static_cast<int>(t % E);
        double sum = 0.0;
        for (int e = 0; e < E; ++e) sum += std::exp(x(t, e) - x(t, a));
        const double p = 1.0 / sum;
        ASSERT_LT(p, 0.99);  // far enough from 1 for the two forms to differ
        for (Index j = 0; j < h; ++j) {
          const double want = on_input ? (a + 1) * relu2(p * x(t, j)) + a : p * ((a + 1) * relu2(x(t, j)) + a);
          EXPECT_NEAR(out(t, j), want, 1e-12) << "token " << t << " column " << j;
        }
      }
    }
  }
}

TEST(MoEApplyProbsOnInput, NeedsTopOne) {
  TransformerConfig c = small_moe_config(4, 2);
  c.moe_apply_probs_on_input = true;
  try {
    MoELayer layer(c, kFp32);
    ADD_FAILURE() << "top-2 with moe_apply_probs_on_input accepted";
  } catch (const MoEError& e) {
    EXPECT_NE(std::string(e.what()).find("`moe_apply_probs_on_input` only works with `moe_router_topk`=1 "
                                         "(moe_router_topk=2)"),
              std::string::npos)
        << e.what();
  }
}

// The noise the router multiplies an all-ones input by, in fp32: every value in
// [fp32(1 - eps), fp32(1 + eps)], the mean within 5 standard errors of 1 (sigma = eps / sqrt(3)
// per draw), and the empirical distribution within the Kolmogorov-Smirnov bound of Uniform(1 - eps,
// 1 + eps) at a 1e-6 false-alarm level: D_n < sqrt(ln(2 / 1e-6) / 2) / sqrt(n) (about 2.69 / sqrt(n)).
// A second call draws new noise (Megatron calls rsample on every forward).
TEST(MoEInputJitter, NoiseIsUniformInOneMinusEpsToOnePlusEpsAndFreshEachCall) {
  const double eps = 0.1;
  TransformerConfig c = small_moe_config(4, 2);
  c.moe_input_jitter_eps = eps;
  TopKRouter router(c, kFp32);
  const Index rows = 100, cols = 100, n = rows * cols;
  const Mat ones = Mat::Ones(rows, cols);
  const Mat first = router.apply_input_jitter(ones), second = router.apply_input_jitter(ones);
  const double lo = round_to(DType::F32, 1.0 - eps), hi = round_to(DType::F32, 1.0 + eps);
  std::vector<double> v(first.data(), first.data() + n);
  double mean = 0.0;
  for (double e : v) {
    ASSERT_GE(e, lo);
    ASSERT_LE(e, hi);
    ASSERT_EQ(e, round_to(DType::F32, e)) << "noise is not an fp32 value";
    mean += e / n;
  }
  EXPECT_LT(std::abs(mean - 1.0), 5 * eps / std::sqrt(3.0 * n));
  std::sort(v.begin(), v.end());
  double d = 0.0;
  for (Index i = 0; i < n; ++i) {
    const double cdf = (v[i] - (1.0 - eps)) / (2 * eps);
    d = std::max({d, std::abs(cdf - static_cast<double>(i) / n), std::abs(cdf - static_cast<double>(i + 1) / n)});
  }
  EXPECT_LT(d, std::sqrt(std::log(2 / 1e-6) / 2) / std::sqrt(static_cast<double>(n)));
  Index same = 0;
  for (Index i = 0; i < n; ++i) same += first.data()[i] == second.data()[i];
  EXPECT_LT(same, n / 100) << "the second call repeated the first call's noise";
  // Without moe_input_jitter_eps the input is returned as is.
  TransformerConfig plain = small_moe_config(4, 2);
  TopKRouter unjittered(plain, kFp32);
  std::mt19937_64 g(3);
  const Mat x = random_mat(g, 5, 8);
  EXPECT_EQ(unjittered.apply_input_jitter(x), x);
}

// In an MoELayer the jitter reaches the router's logits only: each logit moves by at most
// eps sum_j |x_j w_ej| from the unjittered x W^T (the noise multiplies each x_j by 1 +- eps), and
// it does move; the experts get the unjittered tokens (their dispatched input is x's rows). Also
// in eval mode (apply_input_jitter does not look at self.training).
TEST(MoEInputJitter, OnlyTheRouterInputIsJitteredInTrainingAndEval) {
  const double eps = 0.05;
  TransformerConfig c = small_moe_config(4, 1);
  c.moe_input_jitter_eps = eps;
  c.moe_router_load_balancing_type = "none";
  c.moe_aux_loss_coeff = 0.0;
  std::mt19937_64 g(9);
  const StateDict sd = random_moe_state_dict(c, g);
  const Mat x = random_mat(g, 6, c.hidden_size);
  const Mat w = sd.matrix("mlp.router.weight", 4, c.hidden_size);
  for (const bool training : {true, false}) {
    SCOPED_TRACE(training ? "training" : "eval");
    MoELayer layer(c, kExact);
    layer.load_state_dict(sd, "mlp.");
    layer.router.training = training;
    MlpArgs args;
    args.lead = {3, 2};
    args.training = training;
    TapRecord rec;
    layer.forward(x, args, Taps(&rec, "mlp."));
    const std::vector<double> logits = rec.find("mlp.router.logits")->to_f64();  // [s, b, E]
    double moved = 0.0;
    for (Index t = 0; t < x.rows(); ++t)
      for (Index e = 0; e < 4; ++e) {
        double plain = 0.0, reach = 0.0;
        for (Index j = 0; j < x.cols(); ++j) {
          plain += x(t, j) * w(e, j);
          reach += std::abs(x(t, j) * w(e, j));
        }
        const double got = logits[t * 4 + e];
        EXPECT_LE(std::abs(got - plain), eps * reach * (1 + 1e-12)) << "token " << t << " expert " << e;
        moved = std::max(moved, std::abs(got - plain));
      }
    EXPECT_GT(moved, 1e-3) << "the logits were not jittered";
    // Dispatched rows are tokens of x, bitwise (exact mode stores nothing).
    const std::vector<double> dispatched = rec.find("mlp.experts.dispatched_input", Role::TapIn)->to_f64();
    ASSERT_EQ(dispatched.size(), static_cast<std::size_t>(x.size()));  // top-1, no capacity: each token once
    for (Index r = 0; r < x.rows(); ++r) {
      bool found = false;
      for (Index t = 0; t < x.rows() && !found; ++t) {
        bool eq = true;
        for (Index j = 0; j < x.cols() && eq; ++j) eq = dispatched[r * x.cols() + j] == x(t, j);
        found = eq;
      }
      EXPECT_TRUE(found) << "dispatched row " << r << " is not an unjittered token";
    }
  }
}

}  // namespace
}  // namespace twin::reference::moe
