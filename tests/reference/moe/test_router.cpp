// TopKRouter: the loss variants against their definitions (seq_aux_loss = mean of each
// sequence's aux loss; global_aux_loss = aux loss with tokens per expert averaged over the
// forwards), z-loss logging, the expert-bias token counter, sinkhorn, gating dtype.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "reference/moe/router.h"
#include "tests/reference/moe/moe_test_util.h"

namespace twin::reference::moe {
namespace {

using testing::f64_tensor;
using testing::random_mat;
using testing::small_moe_config;

const Precision kExact{ComputeMode::Exact, DType::F32};

TopKRouter make_router(const TransformerConfig& c, const Mat& weight) {
  TopKRouter r(c, kExact);
  StateDict sd;
  sd.set("weight", f64_tensor(weight, {weight.rows(), weight.cols()}));
  if (c.moe_router_enable_expert_bias) sd.set("expert_bias", f64_tensor(Mat::Zero(1, weight.rows()), {weight.rows()}));
  r.load_state_dict(sd, "");
  return r;
}

TEST(TopKRouter, SeqAuxLossIsTheMeanOfEachSequencesAuxLoss) {
  TransformerConfig c = small_moe_config(4, 2);
  c.moe_router_load_balancing_type = "seq_aux_loss";
  std::mt19937_64 rng(3);
  const Mat w = random_mat(rng, 4, c.hidden_size);
  const Index s = 5, b = 3;
  const Mat x = random_mat(rng, s * b, c.hidden_size);  // token t = s_idx * b + b_idx
  AuxLosses all;
  TopKRouter r = make_router(c, w);
  r.forward(x, s, b, nullptr, Taps(), &all);

  TransformerConfig one = c;
  one.moe_router_load_balancing_type = "aux_loss";
  double mean = 0.0;
  for (Index bi = 0; bi < b; ++bi) {
    Mat seq(s, c.hidden_size);
    for (Index si = 0; si < s; ++si) seq.row(si) = x.row(si * b + bi);
    AuxLosses a;
    TopKRouter ra = make_router(one, w);
    ra.forward(seq, s, 1, nullptr, Taps(), &a);
    mean += a.at("load_balancing_loss") / b;
  }
  EXPECT_NEAR(all.at("seq_load_balancing_loss"), mean, 1e-12);
}

TEST(TopKRouter, GlobalAuxLossAveragesTokensPerExpertOverForwards) {
  TransformerConfig c = small_moe_config(4, 2);
  c.moe_router_load_balancing_type = "global_aux_loss";
  std::mt19937_64 rng(5);
  const Mat w = random_mat(rng, 4, c.hidden_size);
  const Mat x1 = random_mat(rng, 6, c.hidden_size), x2 = random_mat(rng, 6, c.hidden_size);
  TopKRouter r = make_router(c, w);
  AuxLosses first, second;
  r.forward(x1, 6, 1, nullptr, Taps(), &first);
  r.forward(x2, 6, 1, nullptr, Taps(), &second);

  TransformerConfig local = c;
  local.moe_router_load_balancing_type = "aux_loss";
  AuxLosses a1;
  TopKRouter ra = make_router(local, w);
  ra.forward(x1, 6, 1, nullptr, Taps(), &a1);
  EXPECT_NEAR(first.at("global_load_balancing_loss"), a1.at("load_balancing_loss"), 1e-12);  // one forward: equal

  // Second forward: scores of x2, tokens per expert (tpe(x1) + tpe(x2)) / 2.
  const AuxScores s1 =
      compute_routing_scores_for_aux_loss(r.gating(x1), 2, "softmax", nullptr, DType::F64, Rounding{true});
  const AuxScores s2 =
      compute_routing_scores_for_aux_loss(r.gating(x2), 2, "softmax", nullptr, DType::F64, Rounding{true});
  std::vector<double> avg(4);
  for (int e = 0; e < 4; ++e) avg[e] = (s1.routing_map.col(e).count() + s2.routing_map.col(e).count()) / 2.0;
  EXPECT_NEAR(second.at("global_load_balancing_loss"), switch_load_balancing_loss_func(s2.scores, avg, 6, 2, 4, 1.0),
              1e-12);
  EXPECT_EQ(r.ga_steps, 2.0);
}

TEST(TopKRouter, ZLossLoggedDividedByItsCoefficient) {
  TransformerConfig c = small_moe_config(4, 2);
  c.moe_router_load_balancing_type = "none";
  c.moe_z_loss_coeff = 0.5;
  TopKRouter r = make_router(c, Mat::Zero(4, c.hidden_size));  // logits 0: logsumexp = log 4
  AuxLosses a;
  r.forward(Mat::Ones(3, c.hidden_size), 3, 1, nullptr, Taps(), &a);
  EXPECT_NEAR(a.at("z_loss"), std::log(4.0) * std::log(4.0), 1e-14);
  EXPECT_EQ(a.count("load_balancing_loss"), 0u);
  r.training = false;  // no losses in eval
  AuxLosses eval;
  r.forward(Mat::Ones(3, c.hidden_size), 3, 1, nullptr, Taps(), &eval);
  EXPECT_TRUE(eval.empty());
}

TEST(TopKRouter, ExpertBiasCounterSkipsPaddingTokens) {
  TransformerConfig c = small_moe_config(4, 1);
  c.moe_router_score_function = "sigmoid";
  c.moe_router_enable_expert_bias = true;
  Mat w = Mat::Zero(4, c.hidden_size);
  w(2, 0) = 1.0;  // every token with x0 > 0 goes to expert 2
  TopKRouter r = make_router(c, w);
  Mat x = Mat::Zero(4, c.hidden_size);
  x.col(0).setConstant(1.0);
  const std::vector<bool> pad = {false, true, false, true};
  r.forward(x, 4, 1, &pad, Taps(), nullptr);
  EXPECT_EQ(r.local_tokens_per_expert, (std::vector<double>{0, 0, 2, 0}));
  r.forward(x, 4, 1, nullptr, Taps(), nullptr);  // accumulates until Megatron's update resets it
  EXPECT_EQ(r.local_tokens_per_expert, (std::vector<double>{0, 0, 6, 0}));
}

TEST(TopKRouter, SinkhornIsDoublyNormalised) {
  std::mt19937_64 rng(9);
  const Mat cost = random_mat(rng, 6, 3);
  const Mat p = sinkhorn(cost);
  // Row sums 1 / T and column sums 1 / E (to the 1e-4 tolerance of the iteration).
  for (Index c = 0; c < p.cols(); ++c) EXPECT_NEAR(p.col(c).sum(), 1.0 / 3, 1e-3);
  for (Index r = 0; r < p.rows(); ++r) EXPECT_NEAR(p.row(r).sum(), 1.0 / 6, 1e-3);
}

TEST(TopKRouter, GatingRoundsToTheRouterDtype) {
  TransformerConfig c = small_moe_config(2, 1);
  c.moe_router_dtype = "fp32";
  const Precision bf16{ComputeMode::FP32, DType::BF16};
  TopKRouter r(c, bf16);
  EXPECT_EQ(r.router_dtype(), DType::F32);  // fp32 logits from bf16 parameters
  TopKRouter plain(small_moe_config(2, 1), bf16);
  EXPECT_EQ(plain.router_dtype(), DType::BF16);  // default: the input dtype
  c.moe_router_dtype = "fp16";
  EXPECT_THROW(TopKRouter(c, bf16), MoEError);
}

TEST(TopKRouter, LogitsProbsAndMapAreTapped) {
  const TransformerConfig c = small_moe_config(4, 2);
  std::mt19937_64 rng(1);
  TopKRouter r = make_router(c, random_mat(rng, 4, c.hidden_size));
  TapRecord rec;
  r.forward(random_mat(rng, 6, c.hidden_size), 3, 2, nullptr, Taps(&rec, "mlp.router."), nullptr);
  ASSERT_NE(rec.find("mlp.router.logits"), nullptr);
  EXPECT_EQ(rec.find("mlp.router.logits")->shape(), (Shape{3, 2, 4}));
  EXPECT_EQ(rec.find("mlp.router.0")->shape(), (Shape{6, 4}));
  EXPECT_EQ(rec.find("mlp.router.1")->dtype(), DType::BOOL);
}

}  // namespace
}  // namespace twin::reference::moe
