// Attention features of the config that only these tests reach, each checked against something
// independent of the reference's code:
// - qk_l2_norm: the q/k L2Norm (megatron/core/transformer/torch_norm.py L2Norm) built by the local
//   spec, against its definition x / sqrt(mean(x^2) + eps) in double on the linear_qkv tap.
// - apply_query_key_layer_scaling in bf16 and fp32: against Megatron-Core's own
//   DotProductAttention (mcore_qk_layer_scaling.json, written by mcore_qk_layer_scaling.py beside
//   this file on the pinned Megatron-Core).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "counted_bound.h"
#include "dense_test_util.h"
#include "reference/attention.h"
#include "reference/dot_product_attention.h"
#include "reference/transformer_layer.h"

using namespace twin;
using namespace twin::reference;
using namespace twin::reference::testing;
using nlohmann::json;

namespace {

// Values exactly representable in `dt` (so every mode reads the same numbers).
Mat rounded(Mat m, DType dt) {
  for (Eigen::Index i = 0; i < m.size(); ++i) m.data()[i] = round_to(dt, m.data()[i]);
  return m;
}

struct L2Case {
  ComputeMode mode;
  DType dt;
  const char* name;
};

}  // namespace

// qk_l2_norm through get_gpt_layer_local_spec (with qk_layernorm also on: L2Norm wins, as in
// Megatron's spec): q_layernorm / k_layernorm taps against x / sqrt(mean(x^2) + eps) computed here
// in double from the query and key parts of linear_qkv's output, eps = layernorm_epsilon.
TEST(QkL2Norm, QueryAndKeyAreL2NormalizedWithLayernormEpsilon) {
  const int h = 16, np = 4, ng = 2, hn = 4, s = 3, b = 2, r = np / ng;
  for (const L2Case& k : {L2Case{ComputeMode::Exact, DType::F32, "fp64"}, L2Case{ComputeMode::FP32, DType::F32, "fp32"},
                          L2Case{ComputeMode::FP32, DType::BF16, "bf16"}}) {
    SCOPED_TRACE(k.name);
    TransformerConfig c = small_config(h, np, ng, 32);
    c.kv_channels = hn;
    c.qk_l2_norm = true;
    c.qk_layernorm = true;
    // Large enough to move every row: the q/k rows have mean squares of about 0.1 to 1.
    c.layernorm_epsilon = 0.25;
    if (k.dt == DType::BF16) {
      c.bf16 = true;
      c.params_dtype = "bfloat16";
    }
    const Precision p{k.mode, k.dt};
    const ModuleSpec spec = get_gpt_layer_local_spec(std::nullopt, c.qk_layernorm, c.normalization, c.qk_l2_norm);
    std::unique_ptr<AttentionModule> module = spec.submodules.self_attention(c, 1, p);
    auto& attn = dynamic_cast<SelfAttention&>(*module);
    std::mt19937_64 g(11);
    attn.linear_qkv.set_weight(rounded(random_mat(g, (np + 2 * ng) * hn, h, 0.3), k.dt));
    attn.linear_qkv.bias = rounded(random_mat(g, 1, (np + 2 * ng) * hn, 0.1), k.dt).row(0);
    attn.linear_proj.set_weight(rounded(random_mat(g, h, np * hn, 0.3), k.dt));
    attn.linear_proj.bias = rounded(random_mat(g, 1, h, 0.1), k.dt).row(0);
    const Mat x = rounded(random_mat(g, s * b, h), k.dt);  // [s, b, h]
    TapRecord rec;
    AttentionArgs a;
    a.s = s;
    a.b = b;
    attn.forward(x, a, Taps(&rec));
    const Tensor* mixed = rec.find("linear_qkv.0");  // [s, b, ng * (r + 2) * hn]
    const Tensor* q = rec.find("q_layernorm");       // [s, b, np, hn]
    const Tensor* kk = rec.find("k_layernorm");      // [s, b, ng, hn]
    ASSERT_TRUE(mixed && q && kk);
    ASSERT_EQ(q->shape(), (Shape{s, b, np, hn}));
    ASSERT_EQ(kk->shape(), (Shape{s, b, ng, hn}));
    const std::vector<double> m = mixed->to_f64(), qv = q->to_f64(), kv = kk->to_f64();
    // Megatron's L2Norm: x.float(), pow(2) (one fp32 rounding each), a mean over hn (fp32
    // accumulation, gamma_hn), + eps, rsqrt, the product (fp32 roundings each), .type_as(x) (one
    // rounding to the activation dtype): |got - y| <= (u_act + (hn + 4) u32) |y| to first order,
    // a rounding of the rsqrt's input costing half its relative error. fp64 mode rounds nowhere.
    const double u32 = std::ldexp(1.0, -24), u_act = k.dt == DType::BF16 ? std::ldexp(1.0, -8) : u32;
    const double rel = k.mode == ComputeMode::Exact ? 1e-14 : u_act + (hn + 4) * u32;
    double worst_eps_effect = 0.0;  // how far the eps moves a row: the check must see a missing eps
    auto check_row = [&](const double* in, const double* got, const std::string& what) {
      double ms = 0.0;
      for (int i = 0; i < hn; ++i) ms += in[i] * in[i];
      ms /= hn;
      const double scale = 1.0 / std::sqrt(ms + c.layernorm_epsilon);
      worst_eps_effect = std::max(worst_eps_effect, std::abs(scale * std::sqrt(ms) - 1.0));
      for (int i = 0; i < hn; ++i) {
        const double y = in[i] * scale;
        EXPECT_LE(std::abs(got[i] - y), rel * std::abs(y)) << what << " element " << i << ": " << got[i] << " vs " << y;
      }
    };
    const int per_group = (r + 2) * hn;
    for (int t = 0; t < s * b; ++t)
      for (int gi = 0; gi < ng; ++gi) {
        const double* row = m.data() + static_cast<std::size_t>(t) * ng * per_group + gi * per_group;
        for (int i = 0; i < r; ++i)
          check_row(row + i * hn, qv.data() + (static_cast<std::size_t>(t) * np + gi * r + i) * hn,
                    "query token " + std::to_string(t) + " head " + std::to_string(gi * r + i));
        check_row(row + r * hn, kv.data() + (static_cast<std::size_t>(t) * ng + gi) * hn,
                  "key token " + std::to_string(t) + " group " + std::to_string(gi));
      }
    // A missing eps would move some element by this relative amount: more than the bound allows.
    EXPECT_GT(worst_eps_effect, 2 * rel) << "eps too small to be seen by this check";
  }
}

// apply_query_key_layer_scaling outside the fp64 mode, against Megatron-Core. With the scaling the
// baddbmm stores the scores as s / layer_number in the input dtype and the softmax multiplies them
// back in fp32, which rounds differently from the unscaled scores; and TransformerConfig's
// __post_init__ turns attention_softmax_in_fp32 on (the table's configs give it false). The value
// tensor is the identity, so the context rows are the attention probabilities themselves.
TEST(QueryKeyLayerScaling, Bf16AndFp32MatchMegatronCore) {
  std::ifstream f(std::string(TWIN_TEST_DATA_DIR) + "/mcore_qk_layer_scaling.json");
  ASSERT_TRUE(f) << "missing " << TWIN_TEST_DATA_DIR << "/mcore_qk_layer_scaling.json";
  const json table = json::parse(f);
  ASSERT_EQ(table["cases"].size(), 4u);
  std::map<std::string, std::vector<double>> megatron;  // context by (dtype, scaling)
  for (const json& k : table["cases"]) {
    const std::string dtype = k["dtype"];
    const bool scaling = k["apply_query_key_layer_scaling"];
    SCOPED_TRACE(dtype + (scaling ? " scaled" : " unscaled"));
    const int sq = k["sq"], b = k["b"], np = k["np"], ng = k["ng"], hn = k["hn"], layer = k["layer_number"];
    TransformerConfig c = small_config(np * hn, np, ng, 4 * np * hn);
    c.kv_channels = hn;
    c.apply_query_key_layer_scaling = scaling;
    c.attention_softmax_in_fp32 = k["attention_softmax_in_fp32_given"];
    const DType dt = dtype == "bf16" ? DType::BF16 : DType::F32;
    c.bf16 = dt == DType::BF16;
    DotProductAttention attn(c, layer, AttnMaskType::causal, Precision{ComputeMode::FP32, dt});
    EXPECT_DOUBLE_EQ(attn.softmax_scale, k["softmax_scale"].get<double>());
    const std::vector<double> qv = k["query"], kv = k["key"], want = k["context"];
    Mat q(sq * b * np, hn), key(sq * b * ng, hn), v(sq * b * ng, hn);
    for (Eigen::Index i = 0; i < q.size(); ++i) q(i / hn, i % hn) = qv[i];  // [sq, b, np, hn]
    for (Eigen::Index i = 0; i < key.size(); ++i) key(i / hn, i % hn) = kv[i];
    for (Eigen::Index row = 0; row < v.rows(); ++row)  // value[j, b, g, c] = (c == j)
      for (int col = 0; col < hn; ++col) v(row, col) = col == row / (b * ng) ? 1.0 : 0.0;
    const Mat got = attn.forward(q, key, v, sq, sq, b, nullptr, false, DropoutRng{});  // [sq * b, np * hn]
    ASSERT_EQ(static_cast<std::size_t>(got.size()), want.size());
    if (dt == DType::BF16) {
      // bf16: the probabilities are bitwise Megatron's. The scores are stored in bf16 and the
      // softmax's fp32 work rounds away in the final bf16 store.
      int differ = 0;
      for (Eigen::Index i = 0; i < got.size(); ++i) {
        const double gv = got(i / (np * hn), i % (np * hn));
        differ += gv != want[i];
        EXPECT_EQ(gv, want[i]) << "context element " << i;
      }
      EXPECT_EQ(differ, 0);
    } else {
      // fp32: torch's fp32 exp and accumulation orders differ from the reference's, so within a
      // bound. A score s = alpha q.k (times coeff) carries up to (hn + 3) u32 sum|alpha q_i k_i|
      // (the fp32 dot product, its store, the store of s / coeff and the product with coeff); a
      // probability p_j = exp(s_j - max) / sum moves by up to 2 max|ds| relatively, plus its own
      // roundings: exp, the sum over sk (gamma_sk), the division and the store, (sk + 3) u32.
      const double u32 = std::ldexp(1.0, -24);
      const double alpha = attn.softmax_scale * attn.coeff.value_or(1.0);
      for (int i = 0; i < sq; ++i)
        for (int h = 0; h < np; ++h) {
          const int gi = h / (np / ng);
          double ds = 0.0;  // max over the row's keys of the score's error bound
          for (int j = 0; j <= i; ++j) {
            double sum = 0.0;
            for (int e = 0; e < hn; ++e) sum += std::abs(alpha * q((i * b) * np + h, e) * key((j * b) * ng + gi, e));
            ds = std::max(ds, (hn + 3) * u32 * sum);
          }
          const double rel = 2 * ds + (sq + 3) * u32;
          for (int j = 0; j < hn; ++j) {
            const std::size_t at = (static_cast<std::size_t>(i) * b * np + h) * hn + j;  // [sq, b=1, np, hn]
            EXPECT_LE(std::abs(got(i * b, h * hn + j) - want[at]), rel * std::abs(want[at]))
                << "query " << i << " head " << h << " key " << j;
          }
        }
    }
    megatron[dtype + (scaling ? "1" : "0")] = want;
  }
  // The bitwise bf16 check can see the scaling: Megatron's bf16 probabilities with and without it
  // differ (s / 3 stored in bf16 then times 3 in fp32, and the fp32 instead of the bf16 softmax).
  const auto &with = megatron.at("bf161"), &without = megatron.at("bf160");
  int differ = 0;
  for (std::size_t i = 0; i < with.size(); ++i) differ += with[i] != without[i];
  EXPECT_GT(differ, 0);
}

namespace {

// Megatron's attention with SoftmaxOne (fused_softmax.py) written out in double, no rounding:
// scores = q . k / sqrt(hn), the causal mask's fill -10000, softmax over the row with the head's
// sink logit appended as a last column, the sink column dropped, context = probs @ v. GQA: head h
// reads group h / (np / ng). q [sq, b, np, hn], k / v [sk, b, ng, hn] as rows; context [sq * b, np * hn].
Mat softmax_one_attention(const Mat& q, const Mat& k, const Mat& v, int s, int b, int np, int ng, int hn,
                          const std::vector<double>& sink) {
  Mat ctx = Mat::Zero(static_cast<Eigen::Index>(s) * b, static_cast<Eigen::Index>(np) * hn);
  for (int bi = 0; bi < b; ++bi)
    for (int h = 0; h < np; ++h) {
      const int g = h / (np / ng);
      for (int i = 0; i < s; ++i) {
        std::vector<double> row;
        for (int j = 0; j < s; ++j)
          row.push_back(j > i ? -10000.0
                              : q.row((i * b + bi) * np + h).dot(k.row((j * b + bi) * ng + g)) / std::sqrt(double(hn)));
        row.push_back(sink[h]);
        const double mx = *std::max_element(row.begin(), row.end());
        double sum = 0.0;
        for (double x : row) sum += std::exp(x - mx);
        for (int j = 0; j < s; ++j)
          ctx.row(i * b + bi).segment(h * hn, hn) += std::exp(row[j] - mx) / sum * v.row((j * b + bi) * ng + g);
      }
    }
  return ctx;
}

}  // namespace

// softmax_type "learnable" with NONZERO offsets (Megatron initialises the parameter with
// init_method, a golden captured at zero init cannot tell a dropped sink from a zero one): the
// offset loaded from the state dict (core_attention.softmax_offset [np]) enters each head's softmax
// as its sink logit. Against softmax_one_attention above: fp64 mode to double rounding, fp32 and
// bf16 in the FP32 and Fast modes within the counted bound of the rounding points they executed.
// The sinks are large enough that the same attention without them lies outside that bound.
TEST(LearnableSoftmaxOffset, NonzeroOffsetsAreEachHeadsSinkLogit) {
  const int np = 4, ng = 2, hn = 8, s = 5, b = 2;
  const std::vector<double> sink = {1.5, -0.75, 2.25, 0.5};  // exact in bf16
  struct Mode {
    ComputeMode mode;
    DType dt;
  };
  for (const Mode& m :
       {Mode{ComputeMode::Exact, DType::F32}, Mode{ComputeMode::FP32, DType::F32}, Mode{ComputeMode::Fast, DType::F32},
        Mode{ComputeMode::FP32, DType::BF16}, Mode{ComputeMode::Fast, DType::BF16}}) {
    SCOPED_TRACE(std::string(dtype_name(m.dt)) + (m.mode == ComputeMode::Exact  ? " exact"
                                                  : m.mode == ComputeMode::Fast ? " fast"
                                                                                : " fp32"));
    TransformerConfig c = small_config(np * hn, np, ng, 32);
    c.kv_channels = hn;
    c.softmax_type = "learnable";
    c.bf16 = m.dt == DType::BF16;
    DotProductAttention dpa(c, 1, AttnMaskType::causal, Precision{m.mode, m.dt});
    StateDict sd;
    sd.set("core_attention.softmax_offset", mat_tensor(Eigen::Map<const Mat>(sink.data(), 1, np), {np}, m.dt));
    dpa.load_state_dict(sd, "core_attention.");
    std::mt19937_64 g(17);
    const Mat q = rounded(random_mat(g, s * b * np, hn), m.dt), k = rounded(random_mat(g, s * b * ng, hn), m.dt),
              v = rounded(random_mat(g, s * b * ng, hn), m.dt);
    const auto [ctx, count] = run_counted([&] { return dpa.forward(q, k, v, s, s, b, nullptr, false, DropoutRng{}); });
    const Mat want = softmax_one_attention(q, k, v, s, b, np, ng, hn, sink);
    const Mat without_sink = softmax_one_attention(q, k, v, s, b, np, ng, hn, std::vector<double>(np, -1e300));
    if (m.mode == ComputeMode::Exact) {
      EXPECT_LT(max_abs_diff(ctx, want), kExactTol);
      EXPECT_GT(max_abs_diff(ctx, without_sink), 0.1);
      continue;
    }
    EXPECT_EQ(outside_counted_bound(ctx, want, count), "");
    // the check can fail: dropping the sink moves the context outside the same bound
    EXPECT_NE(outside_counted_bound(without_sink, want, count), "");
  }
}
