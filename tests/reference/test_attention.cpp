// SelfAttention / CrossAttention / DotProductAttention / RoPE (reference/attention.h,
// dot_product_attention.h, rotary_pos_embedding.h) against a naive per-head oracle.
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include "counted_bound.h"
#include "dense_test_util.h"
#include "reference/attention.h"
#include "reference/rotary_pos_embedding.h"
#include "tests/case_id.h"

using namespace twin;
using namespace twin::reference;
using namespace twin::reference::testing;

namespace {

struct Sizes {
  int np, ng, hn, s, b, h;
};

// One self-attention case: the sizes, a position t (the prefix property's), the stored dtype and
// the seed of the weights and inputs.
struct AttentionCase : proptest::PropertyCase {
  static constexpr const char* kKind = "attention";
  int np = 1, ng = 1, hn = 2, s = 1, b = 1, h = 2, t = 0;
  DType dtype = DType::F32;
  std::uint64_t seed = 0;
  Sizes sizes() const { return {np, ng, hn, s, b, h}; }
  template <class V>
  void fields(V& v) {
    v("np", np);
    v("ng", ng);
    v("hn", hn);
    v("s", s);
    v("b", b);
    v("h", h);
    v("t", t);
    v("dtype", dtype);
    v("seed", seed);
  }
};

// dtypes false: fp32 only, for properties run in Exact mode (which rounds nowhere).
rc::Gen<AttentionCase> gen_attention_case(bool dtypes) {
  return proptest::rerunnable<AttentionCase>(rc::gen::exec([dtypes] {
    AttentionCase c;
    c.ng = *rc::gen::inRange(1, 4);
    c.np = c.ng * *rc::gen::inRange(1, 4);
    c.hn = 2 * *rc::gen::inRange(1, 5);
    c.s = *rc::gen::inRange(1, 7);
    c.b = *rc::gen::inRange(1, 3);
    c.h = *rc::gen::inRange(2, 17);
    c.t = *rc::gen::inRange(0, c.s);
    if (dtypes) c.dtype = *proptest::gen_case_dtype();
    c.seed = *rc::gen::arbitrary<std::uint32_t>();
    return c;
  }));
}

TransformerConfig config_for(const Sizes& z, DType dt = DType::F32) {
  TransformerConfig c = small_config(z.h, z.np, z.ng, 2 * z.h);
  c.kv_channels = z.hn;
  // Megatron's Float16Module: bf16 / fp16 flags (the attention reads them for its softmax storage).
  c.bf16 = dt == DType::BF16;
  c.fp16 = dt == DType::F16;
  c.params_dtype = dt == DType::BF16 ? "bfloat16" : dt == DType::F16 ? "float16" : "float32";
  return c;
}

// Separate projections: Wq [np*hn, h], Wk / Wv [ng*hn, h], Wo [h, np*hn].
struct SeparateWeights {
  Mat wq, wk, wv, wo;
};

SeparateWeights random_weights(std::mt19937_64& g, const Sizes& z) {
  return {random_mat(g, z.np * z.hn, z.h, 0.5), random_mat(g, z.ng * z.hn, z.h, 0.5),
          random_mat(g, z.ng * z.hn, z.h, 0.5), random_mat(g, z.h, z.np * z.hn, 0.5)};
}

// The fused linear_qkv weight through the documented group layout (qkv_row_offset).
Mat fuse_qkv(const SeparateWeights& w, const Sizes& z) {
  const int r = z.np / z.ng;
  Mat fused(z.np * z.hn + 2 * z.ng * z.hn, z.h);
  for (int g = 0; g < z.ng; ++g) {
    for (int i = 0; i < r; ++i)
      fused.middleRows(qkv_row_offset(z.np, z.ng, z.hn, g, i), z.hn) = w.wq.middleRows((g * r + i) * z.hn, z.hn);
    fused.middleRows(qkv_row_offset(z.np, z.ng, z.hn, g, r), z.hn) = w.wk.middleRows(g * z.hn, z.hn);
    fused.middleRows(qkv_row_offset(z.np, z.ng, z.hn, g, r + 1), z.hn) = w.wv.middleRows(g * z.hn, z.hn);
  }
  return fused;
}

// Naive causal attention computing Q, K, V separately, per batch and head. x [s*b, h] rows.
Mat naive_attention(const Mat& x, const SeparateWeights& w, const Sizes& z, bool causal) {
  const int r = z.np / z.ng;
  Mat ctx(z.s * z.b, z.np * z.hn);
  for (int b = 0; b < z.b; ++b) {
    Mat xb(z.s, z.h);
    for (int i = 0; i < z.s; ++i) xb.row(i) = x.row(i * z.b + b);
    for (int h = 0; h < z.np; ++h) {
      const int g = h / r;
      const Mat q = xb * w.wq.middleRows(h * z.hn, z.hn).transpose();
      const Mat k = xb * w.wk.middleRows(g * z.hn, z.hn).transpose();
      const Mat v = xb * w.wv.middleRows(g * z.hn, z.hn).transpose();
      Mat sc = q * k.transpose() / std::sqrt(double(z.hn));
      for (int i = 0; i < z.s; ++i) {
        for (int j = 0; j < z.s; ++j)
          if (causal && j > i) sc(i, j) = -10000.0;
        const double mx = sc.row(i).maxCoeff();
        sc.row(i) = (sc.row(i).array() - mx).exp().matrix();
        sc.row(i) /= sc.row(i).sum();
      }
      const Mat o = sc * v;
      for (int i = 0; i < z.s; ++i) ctx.row(i * z.b + b).segment(h * z.hn, z.hn) = o.row(i);
    }
  }
  return ctx * w.wo.transpose();
}

std::unique_ptr<SelfAttention> make_self_attention(const TransformerConfig& c, const Mat& qkv, const Mat& wo,
                                                   Precision p = exact()) {
  auto a = std::make_unique<SelfAttention>(c, SelfAttentionSubmodules{}, 1, AttnMaskType::causal, p);
  a->linear_qkv.set_weight(qkv);
  a->linear_qkv.bias.setZero();
  a->linear_proj.set_weight(wo);
  a->linear_proj.bias.setZero();
  return a;
}

AttentionArgs args_for(const Sizes& z) {
  AttentionArgs a;
  a.s = z.s;
  a.b = z.b;
  return a;
}

}  // namespace

// Acceptance: a QKV weight built from separate Q, K, V through the documented group layout gives
// the same attention as computing Q, K, V separately (GQA included).
// Exact mode: the naive oracle computes in double.
RC_GTEST_PROP(SelfAttention, FusedQkvLayoutEqualsSeparateProjections, ()) {
  const AttentionCase ac = *gen_attention_case(false);
  const Sizes z = ac.sizes();
  std::mt19937_64 g(ac.seed);
  const SeparateWeights w = random_weights(g, z);
  const Mat x = random_mat(g, z.s * z.b, z.h);
  auto attn = make_self_attention(config_for(z), fuse_qkv(w, z), w.wo);
  const AttentionOutput out = attn->forward(x, args_for(z), Taps());
  RC_ASSERT(max_abs_diff(out.output, naive_attention(x, w, z, true)) < 1e-9);
}

// Acceptance: GQA with groups == heads equals MHA; and GQA equals MHA with each group's K/V head
// replicated for its query heads (repeat_interleave).
RC_GTEST_PROP(SelfAttention, GqaEqualsMhaWithReplicatedKeyValueHeads, ()) {
  const AttentionCase ac = *gen_attention_case(false);
  const Sizes z = ac.sizes();
  std::mt19937_64 g(ac.seed);
  const SeparateWeights w = random_weights(g, z);
  const Mat x = random_mat(g, z.s * z.b, z.h);
  const int r = z.np / z.ng;
  SeparateWeights mha = w;
  mha.wk.resize(z.np * z.hn, z.h);
  mha.wv.resize(z.np * z.hn, z.h);
  for (int h = 0; h < z.np; ++h) {
    mha.wk.middleRows(h * z.hn, z.hn) = w.wk.middleRows((h / r) * z.hn, z.hn);
    mha.wv.middleRows(h * z.hn, z.hn) = w.wv.middleRows((h / r) * z.hn, z.hn);
  }
  Sizes zm = z;
  zm.ng = z.np;
  auto gqa = make_self_attention(config_for(z), fuse_qkv(w, z), w.wo);
  TransformerConfig cm = config_for(zm);
  cm.num_query_groups.reset();  // None -> num_attention_heads: plain MHA
  auto mhaa = make_self_attention(cm, fuse_qkv(mha, zm), w.wo);
  const Mat a = gqa->forward(x, args_for(z), Taps()).output, b = mhaa->forward(x, args_for(zm), Taps()).output;
  RC_ASSERT(max_abs_diff(a, b) < 1e-10);
  TransformerConfig cg = cm;
  cg.num_query_groups = z.np;  // groups == heads
  auto explicit_groups = make_self_attention(cg, fuse_qkv(mha, zm), w.wo);
  RC_ASSERT(max_abs_diff(explicit_groups->forward(x, args_for(zm), Taps()).output, b) == 0.0);
}

// Stored in fp32, bf16 or fp16, GQA and MHA with each group's K/V head replicated compute every
// head from the same values through the same rounding points: bitwise equal.
RC_GTEST_PROP(SelfAttention, GqaEqualsReplicatedMhaBitwiseInEachDtype, ()) {
  const AttentionCase ac = *gen_attention_case(true);
  const Sizes z = ac.sizes();
  std::mt19937_64 g(ac.seed);
  SeparateWeights w = random_weights(g, z);
  for (Mat* m : {&w.wq, &w.wk, &w.wv, &w.wo}) *m = round_mat(*m, ac.dtype);
  const Mat x = round_mat(random_mat(g, z.s * z.b, z.h), ac.dtype);
  const int r = z.np / z.ng;
  SeparateWeights mha = w;
  mha.wk.resize(z.np * z.hn, z.h);
  mha.wv.resize(z.np * z.hn, z.h);
  for (int h = 0; h < z.np; ++h) {
    mha.wk.middleRows(h * z.hn, z.hn) = w.wk.middleRows((h / r) * z.hn, z.hn);
    mha.wv.middleRows(h * z.hn, z.hn) = w.wv.middleRows((h / r) * z.hn, z.hn);
  }
  Sizes zm = z;
  zm.ng = z.np;
  const Precision p{ComputeMode::FP32, ac.dtype};
  auto gqa = make_self_attention(config_for(z, ac.dtype), fuse_qkv(w, z), w.wo, p);
  auto mhaa = make_self_attention(config_for(zm, ac.dtype), fuse_qkv(mha, zm), w.wo, p);
  const Mat a = gqa->forward(x, args_for(z), Taps()).output, b = mhaa->forward(x, args_for(zm), Taps()).output;
  RC_ASSERT(all_in_dtype(a, ac.dtype));
  RC_ASSERT(a == b);
}

// With a causal mask, changing tokens after position t leaves outputs up to t unchanged, in each
// stored dtype.
RC_GTEST_PROP(SelfAttention, CausalMaskPrefixProperty, ()) {
  const AttentionCase ac = *gen_attention_case(true);
  const Sizes z = ac.sizes();
  std::mt19937_64 g(ac.seed);
  SeparateWeights w = random_weights(g, z);
  for (Mat* m : {&w.wq, &w.wk, &w.wv, &w.wo}) *m = round_mat(*m, ac.dtype);
  const Mat x = round_mat(random_mat(g, z.s * z.b, z.h), ac.dtype);
  const int t = ac.t;
  Mat y = x;
  for (int i = t + 1; i < z.s; ++i)
    for (int b = 0; b < z.b; ++b) y.row(i * z.b + b) = round_mat(random_mat(g, 1, z.h, 3.0), ac.dtype);
  auto attn =
      make_self_attention(config_for(z, ac.dtype), fuse_qkv(w, z), w.wo, Precision{ComputeMode::FP32, ac.dtype});
  const Mat a = attn->forward(x, args_for(z), Taps()).output, b = attn->forward(y, args_for(z), Taps()).output;
  RC_ASSERT(a.topRows((t + 1) * z.b) == b.topRows((t + 1) * z.b));  // bitwise: masked terms are exactly 0
}

TEST(SelfAttention, ExplicitMaskReplacesTheCausalMask) {
  const Sizes z{2, 2, 4, 5, 2, 8};
  std::mt19937_64 g(1);
  const SeparateWeights w = random_weights(g, z);
  const Mat x = random_mat(g, z.s * z.b, z.h);
  auto attn = make_self_attention(config_for(z), fuse_qkv(w, z), w.wo);
  std::vector<bool> none(z.b * z.s * z.s, false), causal(z.b * z.s * z.s);
  for (int b = 0; b < z.b; ++b)
    for (int i = 0; i < z.s; ++i)
      for (int j = 0; j < z.s; ++j) causal[(b * z.s + i) * z.s + j] = j > i;
  const Tensor mask_none = Tensor::from_vector<bool>({z.b, 1, z.s, z.s}, none);
  const Tensor mask_causal = Tensor::from_vector<bool>({z.b, 1, z.s, z.s}, causal);
  AttentionArgs a = args_for(z);
  const Mat implicit = attn->forward(x, a, Taps()).output;
  a.attention_mask = &mask_causal;
  EXPECT_LT(max_abs_diff(attn->forward(x, a, Taps()).output, implicit), 1e-12);
  a.attention_mask = &mask_none;
  EXPECT_LT(max_abs_diff(attn->forward(x, a, Taps()).output, naive_attention(x, w, z, false)), 1e-9);
}

TEST(SelfAttention, QueryKeyLayerScalingAndSoftmaxScale) {
  const Sizes z{2, 1, 4, 4, 1, 8};
  std::mt19937_64 g(2);
  const SeparateWeights w = random_weights(g, z);
  const Mat x = random_mat(g, z.s * z.b, z.h);
  TransformerConfig c = config_for(z);
  const Mat base = make_self_attention(c, fuse_qkv(w, z), w.wo)->forward(x, args_for(z), Taps()).output;
  c.apply_query_key_layer_scaling = true;  // divided by layer_number, multiplied back: same math
  auto scaled = std::make_unique<SelfAttention>(c, SelfAttentionSubmodules{}, 3, AttnMaskType::causal, exact());
  EXPECT_DOUBLE_EQ(scaled->core_attention.softmax_scale, 0.5 / 3.0);
  scaled->linear_qkv.set_weight(fuse_qkv(w, z));
  scaled->linear_proj.set_weight(w.wo);
  EXPECT_LT(max_abs_diff(scaled->forward(x, args_for(z), Taps()).output, base), 1e-10);
  // softmax_scale = s' equals the default scale with the query weight multiplied by s' sqrt(hn)
  c.apply_query_key_layer_scaling = false;
  c.softmax_scale = 0.3;
  SeparateWeights w2 = w;
  w2.wq *= 0.3 * 2.0;
  const Mat a = make_self_attention(c, fuse_qkv(w, z), w.wo)->forward(x, args_for(z), Taps()).output;
  EXPECT_LT(max_abs_diff(a, naive_attention(x, w2, z, true)), 1e-9);
}

TEST(SelfAttention, BadInputErrors) {
  TransformerConfig c = small_config(16, 6, 4, 32);  // 6 heads, 4 groups
  c.kv_channels = 4;
  EXPECT_TRUE(throws_with<ConfigError>([&] { SelfAttention(c, {}, 1, AttnMaskType::causal, exact()); },
                                       {"num_attention_heads (6)", "num_query_groups (4)"}));
  const Sizes z{2, 2, 4, 3, 2, 8};
  std::mt19937_64 g(3);
  const SeparateWeights w = random_weights(g, z);
  auto attn = make_self_attention(config_for(z), fuse_qkv(w, z), w.wo);
  const Mat x = random_mat(g, z.s * z.b, z.h);
  AttentionArgs a = args_for(z);
  const Tensor bad = Tensor::from_vector<bool>({z.b, 1, z.s, z.s + 1}, std::vector<bool>(z.b * z.s * (z.s + 1)));
  a.attention_mask = &bad;
  EXPECT_TRUE(throws_with<ShapeError>([&] { attn->forward(x, a, Taps()); },
                                      {"attention_mask", "[2, 1, 3, 3]", "[2, 1, 3, 4]"}));
  const Tensor not_bool = Tensor::zeros(DType::F32, {z.b, 1, z.s, z.s});
  a.attention_mask = &not_bool;
  EXPECT_TRUE(throws_with<ShapeError>([&] { attn->forward(x, a, Taps()); }, {"attention_mask", "BOOL"}));
  a.attention_mask = nullptr;
  const Tensor short_rope = RotaryEmbedding(z.hn, 1.0).forward(z.s - 1);
  a.rotary_pos_emb = &short_rope;
  EXPECT_TRUE(throws_with<ShapeError>([&] { attn->forward(x, a, Taps()); },
                                      {"rotary_pos_emb", "shorter than the sequence", "s = 3"}));
  a.rotary_pos_emb = nullptr;
  EXPECT_TRUE(throws_with<ShapeError>([&] { attn->forward(random_mat(g, z.s * z.b, z.h + 1), a, Taps()); },
                                      {"hidden_states", "[3, 2, 8]"}));
}

// The taps in computation order, and the q / k layernorm taps' values: each head of Q and of K
// (from separate projections, as in naive_attention) normalised over hn by LayerNorm's definition
// written out here, with random gamma and beta, on a random input.
TEST(SelfAttention, TapsInComputationOrderAndQkLayernormValues) {
  const Sizes z{2, 1, 4, 3, 2, 8};
  TransformerConfig c = config_for(z);
  c.qk_layernorm = true;
  SelfAttentionSubmodules sub;
  sub.q_layernorm = sub.k_layernorm = [](const TransformerConfig& cc, int h, double eps, Precision p) {
    return wrapped_torch_norm(cc, h, eps, p);
  };
  SelfAttention attn(c, sub, 1, AttnMaskType::causal, exact());
  std::mt19937_64 g(6);
  const SeparateWeights w = random_weights(g, z);
  attn.linear_qkv.set_weight(fuse_qkv(w, z));
  attn.linear_qkv.bias.setZero();
  attn.linear_proj.set_weight(w.wo);
  attn.linear_proj.bias.setZero();
  auto* qn = dynamic_cast<LayerNorm*>(attn.q_layernorm.get());
  auto* kn = dynamic_cast<LayerNorm*>(attn.k_layernorm.get());
  ASSERT_NE(qn, nullptr);
  ASSERT_NE(kn, nullptr);
  qn->weight_ = random_mat(g, 1, z.hn).row(0).array() + 1.0;
  qn->bias_ = random_mat(g, 1, z.hn, 0.5).row(0);
  kn->weight_ = random_mat(g, 1, z.hn).row(0).array() + 1.0;
  kn->bias_ = random_mat(g, 1, z.hn, 0.5).row(0);
  const Mat x = random_mat(g, z.s * z.b, z.h);  // [s * b, h]
  TapRecord rec;
  attn.forward(x, args_for(z), Taps(&rec, "self_attention."));
  std::vector<std::string> names;
  for (const auto& e : rec.entries) names.push_back(e.name);
  EXPECT_EQ(names, (std::vector<std::string>{"self_attention.linear_qkv.0", "self_attention.q_layernorm",
                                             "self_attention.k_layernorm", "self_attention.core_attention",
                                             "self_attention.linear_proj.0", "self_attention.linear_proj.1",
                                             "self_attention.0", "self_attention.1"}));
  const Tensor* q_tap = rec.find("self_attention.q_layernorm");
  const Tensor* k_tap = rec.find("self_attention.k_layernorm");
  ASSERT_EQ(q_tap->shape(), (Shape{z.s, z.b, z.np, z.hn}));
  ASSERT_EQ(k_tap->shape(), (Shape{z.s, z.b, z.ng, z.hn}));
  // LayerNorm over one head: (v - mean) / sqrt(biased var + eps) * gamma + beta.
  auto layer_norm = [&](const Eigen::RowVectorXd& v, const RowVec& gamma, const RowVec& beta) {
    const double mean = v.mean();
    const double var = (v.array() - mean).square().mean();
    return Eigen::RowVectorXd(((v.array() - mean) / std::sqrt(var + c.layernorm_epsilon)) * gamma.array() +
                              beta.array());
  };
  for (int t = 0; t < z.s * z.b; ++t) {  // token t = s_idx * b + b_idx: the tap's [s, b] order
    for (int h = 0; h < z.np; ++h) {
      const Eigen::RowVectorXd q = x.row(t) * w.wq.middleRows(h * z.hn, z.hn).transpose();
      const Eigen::RowVectorXd want = layer_norm(q, qn->weight_, qn->bias_);
      for (int i = 0; i < z.hn; ++i)
        EXPECT_NEAR(q_tap->at_f64((t * z.np + h) * z.hn + i), want[i], kExactTol) << "token " << t << " head " << h;
    }
    for (int gi = 0; gi < z.ng; ++gi) {
      const Eigen::RowVectorXd k = x.row(t) * w.wk.middleRows(gi * z.hn, z.hn).transpose();
      const Eigen::RowVectorXd want = layer_norm(k, kn->weight_, kn->bias_);
      for (int i = 0; i < z.hn; ++i)
        EXPECT_NEAR(k_tap->at_f64((t * z.ng + gi) * z.hn + i), want[i], kExactTol) << "token " << t << " group " << gi;
    }
  }
}

TEST(CrossAttention, EqualsNaiveAttentionOverTheContext) {
  TransformerConfig c = small_config(8, 2, 2, 16);
  c.add_bias_linear = false;
  CrossAttention attn(c, 1, AttnMaskType::padding, exact());
  std::mt19937_64 g(4);
  const int sq = 3, sk = 5, b = 2, hn = 4;
  attn.linear_q.set_weight(random_mat(g, 8, 8));
  attn.linear_kv.set_weight(random_mat(g, 16, 8));
  attn.linear_proj.set_weight(random_mat(g, 8, 8));
  const Mat x = random_mat(g, sq * b, 8), ctx = random_mat(g, sk * b, 8);
  const Tensor context = mat_tensor(ctx, {sk, b, 8});
  AttentionArgs a;
  a.s = sq;
  a.b = b;
  a.key_value_states = &context;
  const Mat out = attn.forward(x, a, Taps()).output;
  Mat expect_ctx(sq * b, 8);
  for (int bi = 0; bi < b; ++bi)
    for (int h = 0; h < 2; ++h) {
      Mat q(sq, hn), k(sk, hn), v(sk, hn);
      for (int i = 0; i < sq; ++i)
        q.row(i) = (x.row(i * b + bi) * attn.linear_q.weight().transpose()).segment(h * hn, hn);
      for (int j = 0; j < sk; ++j) {
        const RowVec kv = ctx.row(j * b + bi) * attn.linear_kv.weight().transpose();  // [np, 2 hn] per token
        k.row(j) = kv.segment(h * 2 * hn, hn);
        v.row(j) = kv.segment(h * 2 * hn + hn, hn);
      }
      Mat sc = q * k.transpose() / 2.0;
      for (int i = 0; i < sq; ++i) {
        sc.row(i) = (sc.row(i).array() - sc.row(i).maxCoeff()).exp().matrix();
        sc.row(i) /= sc.row(i).sum();
      }
      const Mat o = sc * v;
      for (int i = 0; i < sq; ++i) expect_ctx.row(i * b + bi).segment(h * hn, hn) = o.row(i);
    }
  EXPECT_LT(max_abs_diff(out, expect_ctx * attn.linear_proj.weight().transpose()), 1e-10);
  c.num_query_groups = 1;
  EXPECT_TRUE(throws_with<ConfigError>([&] { CrossAttention(c, 1, AttnMaskType::padding, exact()); },
                                       {"Group query attention"}));
}

TEST(RotaryEmbedding, AnglesAsMegatronComputesThem) {
  const Tensor emb = RotaryEmbedding(8, 1.0).forward(3);
  EXPECT_EQ(emb.shape(), (Shape{3, 1, 1, 8}));
  const auto v = emb.to_f64();
  // position 2, inv_freq[1] = 1 / 10000^(2/8) = 0.1; halves: cat(freqs, freqs)
  EXPECT_NEAR(v[2 * 8 + 1], 0.2, 1e-7);
  EXPECT_EQ(v[2 * 8 + 1], v[2 * 8 + 5]);
  const auto vi = RotaryEmbedding(8, 1.0, true).forward(3).to_f64();  // interleaved: f0 f0 f1 f1
  EXPECT_EQ(vi[2 * 8 + 2], v[2 * 8 + 1]);
  EXPECT_EQ(vi[2 * 8 + 3], v[2 * 8 + 1]);
  EXPECT_EQ(RotaryEmbedding(8, 0.5).dim(), 4);
}

// One RoPE case: head width hn, rot rotated channels, s positions, `rows` rows per position.
struct RopeCase : proptest::PropertyCase {
  static constexpr const char* kKind = "rope";
  int hn = 2, rot = 2, s = 1, rows = 1;
  bool interleaved = false;
  DType dtype = DType::F32;
  std::uint64_t seed = 0;
  template <class V>
  void fields(V& v) {
    v("hn", hn);
    v("rot", rot);
    v("s", s);
    v("rows", rows);
    v("interleaved", interleaved);
    v("dtype", dtype);
    v("seed", seed);
  }
};

// RoPE rotates pairs: norms of each rotated pair are kept (Exact mode), position 0 is the identity
// and channels past rot_dim (rotary_percent < 1) pass through, bitwise in each stored dtype.
RC_GTEST_PROP(RotaryEmbedding, RotatesPairsAndPassesTheTail, ()) {
  const RopeCase rc_ = *proptest::rerunnable<RopeCase>(rc::gen::exec([] {
    RopeCase c;
    c.hn = 2 * *rc::gen::inRange(1, 6);
    c.rot = 2 * *rc::gen::inRange(1, c.hn / 2 + 1);
    c.s = *rc::gen::inRange(1, 6);
    c.rows = *rc::gen::inRange(1, 4);
    c.interleaved = *rc::gen::arbitrary<bool>();
    c.dtype = *proptest::gen_case_dtype();
    c.seed = *rc::gen::arbitrary<std::uint32_t>();
    return c;
  }));
  const int hn = rc_.hn, rot = rc_.rot, s = rc_.s, rows = rc_.rows;
  std::mt19937_64 g(rc_.seed);
  const Mat t = round_mat(random_mat(g, s * rows, hn), rc_.dtype);
  const Tensor emb = RotaryEmbedding(hn, double(rot) / hn, rc_.interleaved).forward(s);
  const Mat freqs = rotary_freqs(emb, s, hn);
  const Mat y = apply_rotary_pos_emb(t, freqs, rows, rc_.interleaved, exact());
  RC_ASSERT(max_abs_diff(y.topRows(rows), t.topRows(rows)) < 1e-15);  // angle 0
  RC_ASSERT(max_abs_diff(y.rightCols(hn - rot), t.rightCols(hn - rot)) == 0.0);
  for (Eigen::Index r = 0; r < y.rows(); ++r)
    for (int i = 0; i < rot / 2; ++i) {
      const int a = rc_.interleaved ? 2 * i : i, b = rc_.interleaved ? 2 * i + 1 : i + rot / 2;
      RC_ASSERT(std::abs(std::hypot(y(r, a), y(r, b)) - std::hypot(t(r, a), t(r, b))) < 1e-12);
    }
  // Stored in the case's dtype: cos 0 = 1 and sin 0 = 0 keep position 0, the tail is copied.
  const Mat yd = apply_rotary_pos_emb(t, freqs, rows, rc_.interleaved, Precision{ComputeMode::FP32, rc_.dtype});
  RC_ASSERT(all_in_dtype(yd, rc_.dtype));
  RC_ASSERT(yd.topRows(rows) == t.topRows(rows));
  RC_ASSERT(yd.rightCols(hn - rot) == t.rightCols(hn - rot));
}

// window_size (w0, w1) applies the sliding-window causal mask: query i sees keys i - w0 .. i + w1
// (sq == sk), replacing any other mask.
TEST(DotProductAttention, SlidingWindowEqualsTheExplicitBandMask) {
  const Sizes z{2, 2, 4, 6, 2, 8};
  std::mt19937_64 g(8);
  const SeparateWeights w = random_weights(g, z);
  const Mat x = random_mat(g, z.s * z.b, z.h);
  TransformerConfig c = config_for(z);
  std::vector<bool> band(z.b * z.s * z.s);
  for (int b = 0; b < z.b; ++b)
    for (int i = 0; i < z.s; ++i)
      for (int j = 0; j < z.s; ++j) band[(b * z.s + i) * z.s + j] = !(j >= i - 2 && j <= i);
  const Tensor mask = Tensor::from_vector<bool>({z.b, 1, z.s, z.s}, band);
  AttentionArgs a = args_for(z);
  a.attention_mask = &mask;
  const Mat explicit_band = make_self_attention(c, fuse_qkv(w, z), w.wo)->forward(x, a, Taps()).output;
  c.window_size = std::vector<int>{2, 0};
  a.attention_mask = nullptr;
  EXPECT_LT(max_abs_diff(make_self_attention(c, fuse_qkv(w, z), w.wo)->forward(x, a, Taps()).output, explicit_band),
            1e-12);
}

// softmax_type off-by-one: softmax over [scores, 0] without the sink column.
TEST(DotProductAttention, OffByOneSoftmaxAddsAZeroSink) {
  TransformerConfig c = small_config(4, 1, 1, 8);
  c.softmax_type = "off-by-one";
  DotProductAttention dpa(c, 1, AttnMaskType::causal, exact());
  Mat q(1, 4), k(1, 4), v(1, 4);
  q << 1, 2, 0, -1;
  k << 0.5, 1, 1, 0;
  v << 1, -2, 3, 4;
  const double score = q.row(0).dot(k.row(0)) / 2.0;  // 1 / sqrt(4)
  const Mat out = dpa.forward(q, k, v, 1, 1, 1, nullptr, false, DropoutRng{});
  EXPECT_LT(max_abs_diff(out, v * (std::exp(score) / (std::exp(score) + 1.0))), 1e-15);
}

// attention_output_gate: per group [q heads | gate heads | k | v]; context * sigmoid(gate).
TEST(SelfAttention, OutputGateMultipliesTheContextBySigmoidOfTheGate) {
  const Sizes z{2, 1, 4, 3, 2, 8};
  std::mt19937_64 g(9);
  const SeparateWeights w = random_weights(g, z);
  const Mat wgate = random_mat(g, z.np * z.hn, z.h, 0.5);
  const Mat x = random_mat(g, z.s * z.b, z.h);
  TransformerConfig c = config_for(z);
  c.attention_output_gate = true;
  const Mat plain = fuse_qkv(w, z);  // [q q | k | v] for the one group
  Mat gated(plain.rows() + wgate.rows(), z.h);
  gated << plain.topRows(z.np * z.hn), wgate, plain.bottomRows(2 * z.hn);
  auto attn = make_self_attention(c, gated, Mat::Identity(z.h, z.np * z.hn));
  const Mat out = attn->forward(x, args_for(z), Taps()).output;
  const Mat ctx = naive_attention(x, SeparateWeights{w.wq, w.wk, w.wv, Mat::Identity(z.h, z.np * z.hn)}, z, true);
  const Mat gate = x * wgate.transpose();
  const Mat expect = ctx.cwiseProduct(gate.unaryExpr([](double v) { return 1.0 / (1.0 + std::exp(-v)); }));
  EXPECT_LT(max_abs_diff(out, expect), 1e-10);
}
