// The router's differences between the Megatron-Core commits the twins know (core/config.h
// MegatronSwitches), one test each: the reference's step function under each commit's switch gives
// that commit's numbers, written out here step by step with explicit roundings, and the two
// commits' numbers differ on the inputs used, so the test fails under the other commit's switch.
#include <gtest/gtest.h>

#include <cmath>

#include "core/dtype.h"
#include "reference/moe/moe_layer.h"
#include "reference/moe/moe_utils.h"

namespace twin::reference::moe {
namespace {

const Rounding megatron{false};  // rounds where Megatron stores
double bf16(double x) { return round_to(DType::BF16, round_to(DType::F32, x)); }
double f32(double x) { return round_to(DType::F32, x); }
double sigmoid32(double l) { return f32(1.0 / (1.0 + std::exp(-l))); }

// bf16 logits of a token choosing experts 0 and 1 of 3 (the third logit is the lowest).
Mat token(double l0, double l1) {
  Mat m(1, 3);
  m << bf16(l0), bf16(l1), -8.0;
  return m;
}

// Runs `expect(logits, pin)` against the reference for many bf16 logit pairs under both switches;
// returns how many pairs the two commits' numbers differ on.
template <class Reference, class Expected>
int pairs_differing(Reference reference, Expected expected) {
  int differ = 0;
  for (int i = 0; i < 40; ++i)
    for (int j = 0; j < 40; ++j) {
      const Mat logits = token(-2.0 + 0.1037 * i, -1.5 + 0.0913 * j);
      for (bool fp32 : {false, true}) {
        const double got = reference(logits, fp32), want = expected(logits, fp32);
        EXPECT_EQ(got, want) << "logits " << logits << (fp32 ? ", d98e8a64" : ", 93ddc247");
      }
      differ += expected(logits, false) != expected(logits, true);
    }
  return differ;
}

TEST(RouterCommits, SigmoidTop2ProbsAreRenormalisedInBf16AtThePinAndInFp32Since) {
  auto reference = [](const Mat& logits, bool fp32) {
    RoutingOptions opt;
    opt.topk = 2;
    opt.score_function = "sigmoid";
    opt.scores_fp32 = fp32;
    return topk_routing_with_score_function(logits, opt, nullptr, DType::BF16, megatron).probs(0, 0);
  };
  auto expected = [](const Mat& l, bool fp32) {
    const double s0 = sigmoid32(l(0, 0)), s1 = sigmoid32(l(0, 1));
    if (fp32) return bf16(f32(s0 / f32(f32(s0 + s1) + 1e-20)));  // one cast at the end
    const double b0 = bf16(s0), b1 = bf16(s1);                   // .type_as(logits), then bf16 math
    return bf16(b0 / bf16(bf16(b0 + b1) + 1e-20));
  };
  EXPECT_GT(pairs_differing(reference, expected), 50);
}

TEST(RouterCommits, PreSoftmaxScalingRoundsTwiceAtThePinAndOnceSince) {
  auto reference = [](const Mat& logits, bool fp32) {
    RoutingOptions opt;
    opt.topk = 2;
    opt.use_pre_softmax = true;
    opt.scaling_factor = 2.5;
    opt.scores_fp32 = fp32;
    return topk_routing_with_score_function(logits, opt, nullptr, DType::BF16, megatron).probs(0, 0);
  };
  auto expected = [](const Mat& l, bool fp32) {
    const double z = std::exp(l(0, 0)) + std::exp(l(0, 1)) + std::exp(l(0, 2));
    const double p = f32(std::exp(l(0, 0)) / z);
    return fp32 ? bf16(f32(p * 2.5)) : bf16(bf16(p) * 2.5);
  };
  EXPECT_GT(pairs_differing(reference, expected), 50);
}

TEST(RouterCommits, SigmoidAuxLossScoresAreInBf16AtThePinAndInFp32Since) {
  auto reference = [](const Mat& logits, bool fp32) {
    return compute_routing_scores_for_aux_loss(logits, 2, "sigmoid", fp32, nullptr, DType::BF16, megatron).scores(0, 0);
  };
  auto expected = [](const Mat& l, bool fp32) {
    if (fp32) {
      // A reduction is summed exactly and stored once (the bounds cover torch's order).
      const double s0 = sigmoid32(l(0, 0)), sum = f32(s0 + sigmoid32(l(0, 1)) + sigmoid32(l(0, 2)));
      return f32(s0 / f32(sum + 1e-20));
    }
    const double b0 = bf16(sigmoid32(l(0, 0)));  // torch.sigmoid on bf16: fp32 math, one bf16 store
    const double sum = bf16(b0 + bf16(sigmoid32(l(0, 1))) + bf16(sigmoid32(l(0, 2))));
    return bf16(b0 / bf16(sum + 1e-20));
  };
  EXPECT_GT(pairs_differing(reference, expected), 50);
}

TEST(RouterCommits, SqrtsoftplusScoresAreSqrtOfSoftplusRenormalisedOverTheTopK) {
  const Mat logits = (Mat(1, 4) << 1.5, -0.5, 25.0, 0.25).finished();
  RoutingOptions opt;
  opt.topk = 2;
  opt.score_function = "sqrtsoftplus";
  opt.scores_fp32 = true;
  const Routing r = topk_routing_with_score_function(logits, opt, nullptr, DType::F32, Rounding{true});
  const double s2 = std::sqrt(25.0), s0 = std::sqrt(std::log1p(std::exp(1.5)));  // softplus(x) = x above 20
  EXPECT_TRUE(r.routing_map(0, 2) && r.routing_map(0, 0));
  EXPECT_NEAR(r.probs(0, 2), s2 / (s0 + s2 + 1e-20), 1e-15);
  EXPECT_NEAR(r.probs(0, 0), s0 / (s0 + s2 + 1e-20), 1e-15);
  // The aux-loss scores: over every expert.
  const AuxScores a =
      compute_routing_scores_for_aux_loss(logits, 2, "sqrtsoftplus", true, nullptr, DType::F32, Rounding{true});
  double sum = 0;
  for (double l : {1.5, -0.5, 25.0, 0.25}) sum += std::sqrt(l > 20 ? l : std::log1p(std::exp(l)));
  EXPECT_NEAR(a.scores(0, 1), std::sqrt(std::log1p(std::exp(-0.5))) / sum, 1e-15);
}

TEST(RouterCommits, SqrtsoftplusBackwardIsTheForwardsDerivative) {
  // Central differences of sum(probs * w) in exact arithmetic, with and without the renormalisation.
  const Mat logits = (Mat(2, 4) << 1.5, -0.5, 0.7, 0.25, -1.0, 2.0, 0.1, -3.0).finished();
  const Mat w = (Mat(2, 4) << 0.3, -1.1, 0.8, 0.5, 1.7, -0.4, 0.9, 0.2).finished();
  for (int k : {1, 2}) {
    RoutingOptions opt;
    opt.topk = k;
    opt.score_function = "sqrtsoftplus";
    opt.scores_fp32 = true;
    const Rounding exact{true};
    const Routing r = topk_routing_with_score_function(logits, opt, nullptr, DType::F64, exact);
    const Mat d = topk_routing_backward(logits, w, r.routing_map, opt, DType::F64, exact);
    for (Index i = 0; i < logits.size(); ++i) {
      Mat up = logits, down = logits;
      up.data()[i] += 1e-6;
      down.data()[i] -= 1e-6;
      const double f_up = (topk_routing_with_score_function(up, opt, nullptr, DType::F64, exact).probs.array() *
                           w.array() * r.routing_map.cast<double>().array())
                              .sum();
      const double f_down = (topk_routing_with_score_function(down, opt, nullptr, DType::F64, exact).probs.array() *
                             w.array() * r.routing_map.cast<double>().array())
                                .sum();
      EXPECT_NEAR(d.data()[i], (f_up - f_down) / 2e-6, 1e-7) << "k " << k << ", logit " << i;
    }
    // And the aux scores' backward: d/dlogits of sum(aux scores * w).
    const Mat da = aux_scores_backward(logits, w, "sqrtsoftplus", true, DType::F64, exact);
    for (Index i = 0; i < logits.size(); ++i) {
      Mat up = logits, down = logits;
      up.data()[i] += 1e-6;
      down.data()[i] -= 1e-6;
      auto f = [&](const Mat& l) {
        return (compute_routing_scores_for_aux_loss(l, k, "sqrtsoftplus", true, nullptr, DType::F64, exact)
                    .scores.array() *
                w.array())
            .sum();
      };
      EXPECT_NEAR(da.data()[i], (f(up) - f(down)) / 2e-6, 1e-7) << "aux, logit " << i;
    }
  }
}

TEST(RouterCommits, SqrtsoftplusIsAConfigErrorAtThePin) {
  TransformerConfig c;
  c.hidden_size = 8;
  c.num_attention_heads = 2;
  c.num_moe_experts = 4;
  c.moe_router_score_function = "sqrtsoftplus";
  EXPECT_THROW(validate_moe_layer_config(c), MoEError);
  c.megatron.sqrtsoftplus = true;
  EXPECT_NO_THROW(validate_moe_layer_config(c));
}

}  // namespace
}  // namespace twin::reference::moe
