// TopKRouter: the loss variants against their definitions (seq_aux_loss = mean of each
// sequence's aux loss; global_aux_loss = the Switch loss, written out here, with tokens per expert
// averaged over the forwards), the tapped logits / probs / routing map against their definitions,
// z-loss logging, the expert-bias token counter, sinkhorn, gating dtype.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "core/record.h"
#include "core/rounding.h"
#include "reference/moe/router.h"
#include "tests/reference/moe/moe_test_util.h"

namespace twin::reference::moe {
namespace {

using testing::f64_tensor;
using testing::random_mat;
using testing::small_moe_config;

const Precision kExact{ComputeMode::Exact, DType::F32};

// The router's math written out in double from Megatron's definitions, independent of the code
// under test: logits = x W^T, softmax over the experts, the top-k experts by value (random inputs
// have no ties).
Mat logits_def(const Mat& x, const Mat& w) { return x * w.transpose(); }  // [T, h] x [h, E] -> [T, E]

std::vector<double> softmax_def(const std::vector<double>& v) {
  const double mx = *std::max_element(v.begin(), v.end());
  std::vector<double> e(v.size());
  double sum = 0.0;
  for (std::size_t i = 0; i < v.size(); ++i) sum += e[i] = std::exp(v[i] - mx);
  for (double& x : e) x /= sum;
  return e;
}

std::vector<int> topk_def(const std::vector<double>& v, int k) {
  std::vector<int> idx(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) idx[i] = static_cast<int>(i);
  std::sort(idx.begin(), idx.end(), [&](int a, int b) { return v[a] > v[b]; });
  idx.resize(k);
  return idx;
}

// Switch Transformer's load-balancing loss (Fedus et al. 2021, eq. 4; Megatron's
// switch_load_balancing_loss_func docstring), logged divided by its coefficient:
//   E * sum_i f_i P_i,  f_i = tokens_per_expert_i / (T topk),  P_i = (1 / T) sum_t softmax(logits_t)_i.
double switch_loss_def(const Mat& logits, const std::vector<double>& tokens_per_expert, int topk) {
  const Index T = logits.rows(), E = logits.cols();
  double loss = 0.0;
  for (Index i = 0; i < E; ++i) {
    double P = 0.0;
    for (Index t = 0; t < T; ++t) {
      std::vector<double> row(E);
      for (Index e = 0; e < E; ++e) row[e] = logits(t, e);
      P += softmax_def(row)[i] / T;
    }
    loss += tokens_per_expert[i] / (static_cast<double>(T) * topk) * P;
  }
  return E * loss;
}

// Tokens per expert under top-k routing of the softmax scores.
std::vector<double> tokens_per_expert_def(const Mat& logits, int topk) {
  std::vector<double> count(logits.cols(), 0.0);
  for (Index t = 0; t < logits.rows(); ++t) {
    std::vector<double> row(logits.cols());
    for (Index e = 0; e < logits.cols(); ++e) row[e] = logits(t, e);
    for (int e : topk_def(row, topk)) count[e] += 1.0;
  }
  return count;
}

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

  // One forward: the Switch loss of x1 with its own tokens per expert.
  const Mat l1 = logits_def(x1, w), l2 = logits_def(x2, w);
  const std::vector<double> tpe1 = tokens_per_expert_def(l1, 2), tpe2 = tokens_per_expert_def(l2, 2);
  EXPECT_NEAR(first.at("global_load_balancing_loss"), switch_loss_def(l1, tpe1, 2), 1e-12);
  // Second forward: scores of x2, tokens per expert averaged over both forwards, (tpe1 + tpe2) / 2.
  std::vector<double> avg(4);
  for (int e = 0; e < 4; ++e) avg[e] = (tpe1[e] + tpe2[e]) / 2.0;
  ASSERT_NE(tpe1, tpe2) << "the two batches route alike: the average would not be tested";
  EXPECT_NEAR(second.at("global_load_balancing_loss"), switch_loss_def(l2, avg, 2), 1e-12);
  EXPECT_GT(std::abs(switch_loss_def(l2, avg, 2) - switch_loss_def(l2, tpe2, 2)), 1e-6);  // the average matters
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

// The taps' values, not only their shapes: logits = x W^T laid out [s, b, E]; probs = softmax over
// each token's top-k logits (moe_router_pre_softmax off), zero elsewhere; the routing map true at
// exactly the top-k experts.
TEST(TopKRouter, LogitsProbsAndMapAreTapped) {
  const TransformerConfig c = small_moe_config(4, 2);
  ASSERT_FALSE(c.moe_router_pre_softmax);
  std::mt19937_64 rng(1);
  const Mat w = random_mat(rng, 4, c.hidden_size),
            x = random_mat(rng, 6, c.hidden_size);  // token t = s_idx * b + b_idx
  TopKRouter r = make_router(c, w);
  TapRecord rec;
  r.forward(x, 3, 2, nullptr, Taps(&rec, "mlp.router."), nullptr);
  const Tensor* logits = rec.find("mlp.router.logits");
  const Tensor* probs = rec.find("mlp.router.0");
  const Tensor* map = rec.find("mlp.router.1");
  ASSERT_NE(logits, nullptr);
  ASSERT_NE(probs, nullptr);
  ASSERT_NE(map, nullptr);
  EXPECT_EQ(logits->shape(), (Shape{3, 2, 4}));
  EXPECT_EQ(probs->shape(), (Shape{6, 4}));
  EXPECT_EQ(map->dtype(), DType::BOOL);
  EXPECT_EQ(map->shape(), (Shape{6, 4}));
  const Mat l = logits_def(x, w);
  for (Index t = 0; t < 6; ++t) {
    std::vector<double> row(4);
    for (Index e = 0; e < 4; ++e) row[e] = l(t, e);
    const std::vector<int> top = topk_def(row, 2);
    const std::vector<double> top_probs = softmax_def({row[top[0]], row[top[1]]});
    for (Index e = 0; e < 4; ++e) {
      const Index i = t * 4 + e;
      EXPECT_NEAR(logits->at_f64(i), l(t, e), 1e-12) << "token " << t << " expert " << e;
      const int rank = e == top[0] ? 0 : e == top[1] ? 1 : -1;
      EXPECT_EQ(map->at_f64(i) != 0.0, rank >= 0) << "token " << t << " expert " << e;
      EXPECT_NEAR(probs->at_f64(i), rank >= 0 ? top_probs[rank] : 0.0, 1e-12) << "token " << t << " expert " << e;
    }
  }
}

}  // namespace
}  // namespace twin::reference::moe

namespace twin::reference::moe {
namespace {

// moe_utils.sinkhorn written out from Megatron's code: cost = exp(cost); d0 = 1 / (T (rowsum(d1 * cost)
// + eps)); d1 = 1 / (E (colsum(d0 cost) + eps)); until mean |d1_old - d1| <= tol; d1 * cost * d0.
Mat sinkhorn_def(const Mat& logits) {
  const Index T = logits.rows(), E = logits.cols();
  const Mat cost = logits.array().exp();
  std::vector<double> d0(T, 1.0), d1(E, 1.0);
  double error = 1e9;
  while (error > 0.0001) {
    for (Index t = 0; t < T; ++t) {
      double s = 0.0;
      for (Index e = 0; e < E; ++e) s += d1[e] * cost(t, e);
      d0[t] = (1.0 / T) * 1.0 / (s + 1e-8);
    }
    error = 0.0;
    for (Index e = 0; e < E; ++e) {
      double s = 0.0;
      for (Index t = 0; t < T; ++t) s += d0[t] * cost(t, e);
      const double d = (1.0 / E) * 1.0 / (s + 1e-8);
      error += std::abs(d1[e] - d) / E;
      d1[e] = d;
    }
  }
  Mat out(T, E);
  for (Index t = 0; t < T; ++t)
    for (Index e = 0; e < E; ++e) out(t, e) = d1[e] * cost(t, e) * d0[t];
  return out;
}

// TopKRouter.sinkhorn_load_balancing at the pin: training ranks the experts by sinkhorn(logits in
// fp32) (no grad), eval by the activation; the probabilities are the activation, torch.sigmoid for
// topk 1, else torch.softmax in fp32 .type_as(logits), times the routing map. Written out here in
// double and rounded where torch stores (sigmoid: one store in the router dtype; softmax: fp32,
// then the router dtype), for topk 1 and 2, training and eval, in fp64 mode and with fp32 and bf16
// router dtypes. The logits favour expert 0, so sinkhorn's balanced ranking differs from the
// activation's for some tokens (checked: training's map is not eval's).
TEST(TopKRouter, SinkhornRoutingFollowsMegatronsFormula) {
  const Index T = 16, E = 4;
  std::mt19937_64 rng(31);
  Mat raw = random_mat(rng, T, E);
  raw.col(0).array() += 1.5;
  struct Mode {
    ComputeMode mode;
    DType dt;
  };
  for (const Mode m : {Mode{ComputeMode::Exact, DType::F32}, Mode{ComputeMode::FP32, DType::F32},
                       Mode{ComputeMode::FP32, DType::BF16}})
    for (int k : {1, 2}) {
      const bool exact = m.mode == ComputeMode::Exact;
      auto rnd = [&](DType dt, double x) { return exact ? x : round_to(dt, round_to(DType::F32, x)); };
      Mat logits = raw;
      for (Index i = 0; i < logits.size(); ++i) logits.data()[i] = rnd(m.dt, logits.data()[i]);
      Mat act(T, E);  // _sinkhorn_activation
      for (Index t = 0; t < T; ++t) {
        std::vector<double> row(E);
        for (Index e = 0; e < E; ++e) row[e] = logits(t, e);
        const std::vector<double> sm = softmax_def(row);
        for (Index e = 0; e < E; ++e)
          act(t, e) = k == 1 ? rnd(m.dt, 1.0 / (1.0 + std::exp(-row[e]))) : rnd(m.dt, rnd(DType::F32, sm[e]));
      }
      Mat f32_logits = logits;
      for (Index i = 0; i < logits.size(); ++i) f32_logits.data()[i] = rnd(DType::F32, logits.data()[i]);
      const Mat norm = sinkhorn_def(f32_logits);
      BoolMat maps[2];
      for (bool training : {true, false}) {
        SCOPED_TRACE(std::string(dtype_name(m.dt)) + (exact ? " exact" : "") + " topk " + std::to_string(k) +
                     (training ? " training" : " eval"));
        TransformerConfig c = small_moe_config(E, k);
        c.moe_router_load_balancing_type = "sinkhorn";
        c.moe_aux_loss_coeff = 0.0;  // Megatron asserts it for sinkhorn
        TopKRouter r(c, Precision{m.mode, m.dt});
        r.training = training;
        const RouterOutput out = r.routing(logits, T, 1, nullptr, nullptr);
        const Mat& rank_by = training ? norm : act;
        Index tied = 0;
        for (Index t = 0; t < T; ++t) {
          std::vector<double> row(E);
          for (Index e = 0; e < E; ++e) row[e] = rank_by(t, e);
          std::vector<double> sorted = row;
          std::sort(sorted.begin(), sorted.end(), std::greater<double>());
          const bool tie = sorted[k - 1] == sorted[k];  // torch.topk's choice among equals: not checked
          tied += tie;
          const std::vector<int> top = topk_def(row, k);
          for (Index e = 0; e < E; ++e) {
            const bool chosen = std::find(top.begin(), top.end(), e) != top.end();
            if (!tie) {
              EXPECT_EQ(out.routing_map(t, e), chosen) << "token " << t << " expert " << e;
            }
            const double want = out.routing_map(t, e) ? act(t, e) : 0.0;  // scores = logits * map
            // fp64 mode: the same formula to double rounding; else the same stores of the same
            // double values (to ~1e-16, far from any rounding midpoint of these fixed inputs): equal.
            EXPECT_NEAR(out.probs(t, e), want, exact ? 1e-12 : 0.0) << "token " << t << " expert " << e;
          }
        }
        EXPECT_LE(tied, T / 4);
        maps[training ? 0 : 1] = out.routing_map;
      }
      EXPECT_FALSE(maps[0] == maps[1]) << "sinkhorn's training map equals eval's: the test cannot tell them apart";
    }
}

}  // namespace
}  // namespace twin::reference::moe

namespace twin::reference::moe {
namespace {

// The router's rounding points, op by op from router.py / moe_utils.py for bf16 activations, an
// fp32 router (moe_router_dtype) over h = 8, E = 4 experts, top-2 softmax, T = 6 tokens:
//   logits = gating(x): the GEMM of length h in fp32, stored in the router dtype      fp32 1, red h
//   probs = softmax(logits) in fp32, .type_as(logits): sum of E exponentials,
//           the fp32 result, the router-dtype store                                  + fp32 2, red E
//   each loss from the probs: the load-balancing loss sums over the T tokens and the E experts,
//           with 4 stores (sum, x tokens_per_expert, sum, x coeff / coeff) and the
//           fp32 aux-loss tracker; z_loss from the logits' logsumexp (sum of T),
//           5 stores and the tracker. Each loss starts from the probs' count and
//           leaves no trace on later tensors.
// So neither twin can loosen the router's bounds by miscounting: a changed count fails here.
TEST(RoundingCounts, TopKRouterCountsTheGatingGemmTheScoreFunctionAndEachLoss) {
  TransformerConfig c = small_moe_config(4, 2);
  c.bf16 = true;
  c.moe_router_dtype = "fp32";
  c.moe_z_loss_coeff = 0.001;
  const Precision bf16{ComputeMode::FP32, DType::BF16};
  std::mt19937_64 g(11);
  TopKRouter r(c, bf16);
  StateDict sd;
  sd.set("weight", f64_tensor(random_mat(g, 4, 8), {4, 8}));
  r.load_state_dict(sd, "");
  Record rec;
  AuxLosses aux;
  {
    CountRoundings counting;
    r.forward(random_mat(g, 6, 8), 6, 1, nullptr, Taps(&rec), &aux);
  }
  std::map<std::string, RoundingCount> got;
  for (const RecordEntry& e : rec.entries) got[e.key()] = e.rounding;
  auto expect = [&](const std::string& key, int fp32, std::int64_t reduction) {
    ASSERT_TRUE(got.count(key)) << key;
    EXPECT_EQ(got[key].bf16, 0) << key;
    EXPECT_EQ(got[key].fp32, fp32) << key;
    EXPECT_EQ(got[key].reduction, reduction) << key;
  };
  expect("tap.logits", 1, 8);
  expect("tap.0", 1 + 2, 8 + 4);
  expect("aux.load_balancing_loss", 1 + 2 + 4 + 1, 8 + 4 + 6 + 4);
  expect("aux.z_loss", 1 + 2 + 5 + 1, 8 + 4 + 6);
}

}  // namespace
}  // namespace twin::reference::moe
