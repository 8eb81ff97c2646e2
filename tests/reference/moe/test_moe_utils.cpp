// moe_utils: losses, capacity, top-k rules, group-limited top-k, score functions, token dropping
// and permutation, each on a small case whose answer follows from the formula by hand.
#include <gtest/gtest.h>

#include <cmath>

#include "reference/moe/moe_utils.h"

namespace twin::reference::moe {
namespace {

Mat mat(Index r, Index c, std::initializer_list<double> v) {
  Mat m(r, c);
  std::copy(v.begin(), v.end(), m.data());
  return m;
}

TEST(MoEUtils, BalancedUniformRoutingHasAuxLossOne) {
  // scores 1/E everywhere, every expert T k / E tokens: E * coeff / (k T^2) * E * (T / E) * (T k / E) = coeff.
  const int E = 4, k = 2;
  const Index T = 8;
  const Mat scores = Mat::Constant(T, E, 1.0 / E);
  const std::vector<double> tokens(E, static_cast<double>(T * k / E));
  EXPECT_NEAR(switch_load_balancing_loss_func(scores, tokens, T, k, E, 0.01), 0.01, 1e-15);
}

TEST(MoEUtils, ZLossIsMeanSquaredLogsumexpOverValidTokens) {
  Mat logits = Mat::Zero(3, 4);
  logits.row(2).setConstant(50.0);  // a padding token with huge logits
  const double z = std::log(4.0) * std::log(4.0);
  const std::vector<bool> pad = {false, false, true};
  EXPECT_NEAR(z_loss_func(logits, 1e-3, &pad), 1e-3 * z, 1e-15);
  const double with_padding_row = (2 * z + std::pow(50.0 + std::log(4.0), 2)) / 3;
  EXPECT_NEAR(z_loss_func(logits, 1e-3, nullptr), 1e-3 * with_padding_row, 1e-12);
}

TEST(MoEUtils, CapacityIsCeilOfTokensTimesFactorOverExperts) {
  EXPECT_EQ(get_capacity(16, 4, 1.0), 4);
  EXPECT_EQ(get_capacity(10, 3, 1.5), 5);  // ceil(5.0)
  EXPECT_EQ(get_capacity(10, 3, 1.0), 4);  // ceil(3.33)
}

TEST(MoEUtils, TopkBreaksTiesByLowerIndex) {
  Eigen::RowVectorXd v(5);
  v << 1.0, 3.0, 3.0, 2.0, 3.0;
  EXPECT_EQ(topk_indices(v, 3), (std::vector<Index>{1, 2, 4}));
  EXPECT_THROW(topk_indices(v, 6), MoEError);
}

TEST(MoEUtils, GroupLimitedTopkChoosesTheBestGroupFirst) {
  // Groups {0, 1} and {2, 3}; group score = sum of its top (k / group_topk) = 2 scores:
  // 0.9 + 0.0 < 0.8 + 0.7, so group 1 wins and experts 2, 3 are chosen although expert 0 is best.
  const TopK t = group_limited_topk(mat(1, 4, {0.9, 0.0, 0.8, 0.7}), 2, 2, 1, DType::F64, Rounding{});
  EXPECT_EQ(t.indices(0, 0), 2);
  EXPECT_EQ(t.indices(0, 1), 3);
}

TEST(MoEUtils, SoftmaxBeforeOrAfterTopk) {
  const Mat logits = mat(1, 3, {1.0, 2.0, 3.0});
  RoutingOptions opt;
  opt.topk = 2;
  const Rounding exact{true};
  const double z = std::exp(1.0) + std::exp(2.0) + std::exp(3.0);
  opt.use_pre_softmax = true;  // softmax over all experts, then top-2
  Routing r = topk_routing_with_score_function(logits, opt, nullptr, DType::F64, exact);
  EXPECT_NEAR(r.probs(0, 2), std::exp(3.0) / z, 1e-15);
  EXPECT_NEAR(r.probs(0, 1), std::exp(2.0) / z, 1e-15);
  EXPECT_EQ(r.probs(0, 0), 0.0);
  EXPECT_FALSE(r.routing_map(0, 0));
  opt.use_pre_softmax = false;  // top-2 logits, softmax over those two
  r = topk_routing_with_score_function(logits, opt, nullptr, DType::F64, exact);
  EXPECT_NEAR(r.probs(0, 2), 1.0 / (1.0 + std::exp(-1.0)), 1e-15);
  opt.scaling_factor = 2.5;
  r = topk_routing_with_score_function(logits, opt, nullptr, DType::F64, exact);
  EXPECT_NEAR(r.probs(0, 2), 2.5 / (1.0 + std::exp(-1.0)), 1e-14);
}

TEST(MoEUtils, SigmoidExpertBiasChoosesButDoesNotWeigh) {
  RoutingOptions opt;
  opt.topk = 1;
  opt.score_function = "sigmoid";
  const std::vector<double> expert_bias = {0.0, 5.0, 0.0};
  const Routing r =
      topk_routing_with_score_function(mat(1, 3, {2.0, 1.0, 0.0}), opt, &expert_bias, DType::F64, Rounding{true});
  EXPECT_TRUE(r.routing_map(0, 1));
  EXPECT_NEAR(r.probs(0, 1), 1.0 / (1.0 + std::exp(-1.0)), 1e-15);  // top-1: not renormalised
  opt.topk = 2;                                                     // top-2: renormalised over the two chosen
  const Routing r2 =
      topk_routing_with_score_function(mat(1, 3, {2.0, 1.0, 0.0}), opt, &expert_bias, DType::F64, Rounding{true});
  const double s0 = 1.0 / (1.0 + std::exp(-2.0)), s1 = 1.0 / (1.0 + std::exp(-1.0));
  EXPECT_NEAR(r2.probs(0, 0), s0 / (s0 + s1 + 1e-20), 1e-15);
  EXPECT_NEAR(r2.probs(0, 1), s1 / (s0 + s1 + 1e-20), 1e-15);
}

TEST(MoEUtils, TokenDroppingPolicies) {
  // 4 tokens, 2 experts, top-1 -> capacity ceil(4 / 2 * 0.5) = 1. Tokens 0, 1, 3 chose expert 0.
  Routing in;
  in.routing_map = BoolMat::Constant(4, 2, false);
  in.probs = Mat::Zero(4, 2);
  const double p[4] = {0.6, 0.9, 0.7, 0.8};
  const int e[4] = {0, 0, 1, 0};
  for (int t = 0; t < 4; ++t) {
    in.routing_map(t, e[t]) = true;
    in.probs(t, e[t]) = p[t];
  }
  const Routing by_probs = apply_router_token_dropping(in, 1, 0.5, "probs", false);
  EXPECT_TRUE(by_probs.routing_map(1, 0));  // highest probability kept
  EXPECT_EQ(by_probs.routing_map.col(0).count(), 1);
  const Routing by_position = apply_router_token_dropping(in, 1, 0.5, "position", false);
  EXPECT_TRUE(by_position.routing_map(0, 0));  // earliest routed token kept (the documented tie rule)
  EXPECT_EQ(by_position.routing_map.col(0).count(), 1);
  EXPECT_TRUE(by_position.routing_map(2, 1));
  EXPECT_EQ(by_position.probs(1, 0), 0.0);  // dropped: its probability is zeroed
  const Routing padded = apply_router_token_dropping(in, 1, 1.0, "position", true);  // capacity 2
  EXPECT_EQ(padded.routing_map.col(0).count(), 2);
  EXPECT_EQ(padded.routing_map.col(1).count(), 2);  // token 2 plus the earliest other (token 0)
  EXPECT_TRUE(padded.routing_map(0, 1));
  EXPECT_EQ(padded.probs(0, 1), 0.0);  // a padding row carries probability 0
  EXPECT_THROW(apply_router_token_dropping(in, 1, 0.5, "random", false), MoEError);
}

TEST(MoEUtils, PermuteIsExpertMajorInTokenOrder) {
  const Mat tokens = mat(3, 1, {10, 11, 12});
  BoolMat map(3, 2);
  map << true, true, false, true, true, false;  // token 0 -> {0, 1}, 1 -> {1}, 2 -> {0}
  const Permuted p = permute(tokens, map, nullptr, std::nullopt, false);
  EXPECT_EQ(p.sorted_indices, (std::vector<Index>{0, 2, 0, 1}));
  EXPECT_EQ(p.tokens(1, 0), 12);
  const Mat back = unpermute(p.tokens, p.sorted_indices, 3, DType::F64, Rounding{});
  EXPECT_EQ(back(0, 0), 20);  // token 0 came back from both experts
  EXPECT_EQ(back(1, 0), 11);
}

}  // namespace
}  // namespace twin::reference::moe
