// TransformerLayer, its spec and state_dict loading (reference/transformer_layer.h).
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <cmath>
#include <stdexcept>

#include "dense_test_util.h"
#include "reference/philox.h"
#include "reference/transformer_block.h"
#include "reference/transformer_layer.h"
#include "tests/case_id.h"

using namespace twin;
using namespace twin::reference;
using namespace twin::reference::testing;

namespace {

// Megatron's state_dict of a local-spec layer for config c, random values.
std::map<std::string, Tensor> random_params(std::mt19937_64& g, const TransformerConfig& c) {
  const int h = c.hidden_size, np = c.num_attention_heads, ng = c.query_groups(), hn = c.head_dim();
  const int ffn = c.ffn(), fc1 = c.gated_linear_unit ? 2 * ffn : ffn;
  std::map<std::string, Tensor> p;
  auto add = [&](const std::string& k, Shape s, double scale) { p[k] = random_tensor(g, std::move(s), scale); };
  add("input_layernorm.weight", {h}, 1.0);
  if (c.normalization == "LayerNorm") add("input_layernorm.bias", {h}, 0.1);
  add("self_attention.linear_qkv.weight", {np * hn + 2 * ng * hn, h}, 0.3);
  if (c.add_bias_linear || c.add_qkv_bias) add("self_attention.linear_qkv.bias", {np * hn + 2 * ng * hn}, 0.1);
  add("self_attention.linear_proj.weight", {h, np * hn}, 0.3);
  if (c.add_bias_linear) add("self_attention.linear_proj.bias", {h}, 0.1);
  if (c.qk_layernorm) {
    add("self_attention.q_layernorm.weight", {hn}, 1.0);
    add("self_attention.k_layernorm.weight", {hn}, 1.0);
    if (c.normalization == "LayerNorm") {
      add("self_attention.q_layernorm.bias", {hn}, 0.1);
      add("self_attention.k_layernorm.bias", {hn}, 0.1);
    }
  }
  add("pre_mlp_layernorm.weight", {h}, 1.0);
  if (c.normalization == "LayerNorm") add("pre_mlp_layernorm.bias", {h}, 0.1);
  add("mlp.linear_fc1.weight", {fc1, h}, 0.3);
  if (c.add_bias_linear) add("mlp.linear_fc1.bias", {fc1}, 0.1);
  add("mlp.linear_fc2.weight", {h, ffn}, 0.3);
  if (c.add_bias_linear) add("mlp.linear_fc2.bias", {h}, 0.1);
  return p;
}

// One dense-layer case of these properties: the layer's sizes and options (the activations include
// squared_relu and quick_gelu, which `dense(...)` ids do not), s x b tokens, the prefix position t,
// the stored dtype and the seed of parameters and inputs.
struct LayerCase : proptest::PropertyCase {
  static constexpr const char* kKind = "layer";
  int h = 8, np = 1, ng = 1, hn = 2, ffn = 4;
  std::string norm = "LayerNorm";
  std::string act = "gelu";
  bool glu = false, bias = false, qkln = false;
  int s = 2, b = 1, t = 0;
  DType dtype = DType::F32;
  std::uint64_t seed = 0;
  template <class V>
  void fields(V& v) {
    v("h", h);
    v("np", np);
    v("ng", ng);
    v("hn", hn);
    v("ffn", ffn);
    v("norm", norm);
    v("act", act);
    v("glu", glu);
    v("bias", bias);
    v("qkln", qkln);
    v("s", s);
    v("b", b);
    v("t", t);
    v("dtype", dtype);
    v("seed", seed);
  }
};

// dtypes false: fp32 only.
rc::Gen<LayerCase> gen_layer_case(bool dtypes) {
  return proptest::rerunnable<LayerCase>(rc::gen::exec([dtypes] {
    LayerCase c;
    c.ng = *rc::gen::inRange(1, 3);
    c.np = c.ng * *rc::gen::inRange(1, 3);
    c.hn = 2 * *rc::gen::inRange(1, 4);
    c.h = *rc::gen::inRange(2, 5) * 4;
    c.ffn = *rc::gen::inRange(4, 20);
    c.norm = *rc::gen::element<std::string>("LayerNorm", "RMSNorm");
    c.act = *rc::gen::element<std::string>("gelu", "silu", "squared_relu", "quick_gelu");
    c.glu = *rc::gen::arbitrary<bool>();
    c.bias = *rc::gen::arbitrary<bool>();
    c.qkln = *rc::gen::arbitrary<bool>();
    c.s = *rc::gen::inRange(2, 7);
    c.b = *rc::gen::inRange(1, 3);
    c.t = *rc::gen::inRange(0, c.s);
    if (dtypes) c.dtype = *proptest::gen_case_dtype();
    c.seed = *rc::gen::arbitrary<std::uint32_t>();
    return c;
  }));
}

TransformerConfig to_config(const LayerCase& lc) {
  TransformerConfig c = small_config(lc.h, lc.np, lc.ng, lc.ffn);
  c.kv_channels = lc.hn;
  c.normalization = lc.norm;
  c.activation_func = lc.act;
  c.gated_linear_unit = lc.glu;
  c.add_bias_linear = lc.bias;
  c.qk_layernorm = lc.qkln;
  c.bf16 = lc.dtype == DType::BF16;  // Megatron's Float16Module flags
  c.fp16 = lc.dtype == DType::F16;
  c.params_dtype = lc.dtype == DType::BF16 ? "bfloat16" : lc.dtype == DType::F16 ? "float16" : "float32";
  return c;
}

// One dropout case: the probability p, Megatron's dropout stream (rng_seed, offset), the attention
// sizes (ng, np, s, b; unused by the hidden-dropout property) and the seed of the data. Exact mode:
// the masks and the 1 / (1 - p) scale are what these properties read, in no stored dtype.
struct DropoutCase : proptest::PropertyCase {
  static constexpr const char* kKind = "dropout";
  double p = 0.5;
  std::uint64_t rng_seed = 0, offset = 0;
  int ng = 1, np = 1, s = 6, b = 1;
  std::uint64_t seed = 0;
  template <class V>
  void fields(V& v) {
    v("p", p);
    v("rng_seed", rng_seed);
    v("offset", offset);
    v("ng", ng);
    v("np", np);
    v("s", s);
    v("b", b);
    v("seed", seed);
  }
};

// p in {min_p, ..., 9} / 10; with max_ng > 1 the attention sizes are drawn (s from min_s to min_s + 3).
rc::Gen<DropoutCase> gen_dropout_case(int min_p, int max_ng, int min_s, int max_b) {
  return proptest::rerunnable<DropoutCase>(rc::gen::exec([=] {
    DropoutCase c;
    c.p = *rc::gen::inRange(min_p, 10) / 10.0;
    c.ng = *rc::gen::inRange(1, max_ng + 1);
    c.np = c.ng * *rc::gen::inRange(1, max_ng + 1);
    c.s = *rc::gen::inRange(min_s, min_s + 4);
    c.b = *rc::gen::inRange(1, max_b + 2);
    c.rng_seed = *rc::gen::arbitrary<std::uint64_t>();
    c.offset = *rc::gen::inRange<std::uint64_t>(0, 1u << 20);
    c.seed = *rc::gen::arbitrary<std::uint32_t>();
    return c;
  }));
}

std::unique_ptr<TransformerLayer> local_layer(const TransformerConfig& c, Precision p = Precision{}) {
  const ModuleSpec spec = get_gpt_layer_local_spec(std::nullopt, c.qk_layernorm, c.normalization);
  return std::make_unique<TransformerLayer>(c, spec.submodules, 1, std::nullopt, p);
}

}  // namespace

TEST(TransformerLayer, DefaultSubmodulesAreIdentity) {
  TransformerConfig c = small_config();
  TransformerLayer layer(c, TransformerLayerSubmodules{});
  std::mt19937_64 g(1);
  const Tensor x = random_tensor(g, {4, 2, 16});
  auto [out, ctx] = layer.forward(x);
  EXPECT_EQ(max_abs_diff(out, x), 0.0);
  EXPECT_FALSE(ctx.has_value());
  layer.load_state_dict(std::map<std::string, Tensor>{});  // owns nothing
  EXPECT_FALSE(layer.get_layer_norm_weights().has_value());
  EXPECT_THROW(layer.get_qkv_layer_norm_weights(), std::logic_error);
}

TEST(TransformerLayer, LocalSpecOwnsMegatronsStateDictKeys) {
  TransformerConfig c = small_config();
  c.qk_layernorm = true;
  std::mt19937_64 g(2);
  auto params = random_params(g, c);
  auto layer = local_layer(c);
  layer->load_state_dict(params);  // every key used, none missing
  EXPECT_EQ(layer->get_qkv_layer_norm_weights(), to_rowvec(params["input_layernorm.weight"], "w"));
  EXPECT_EQ(layer->get_mlp_layer_norm_weights(), to_rowvec(params["pre_mlp_layernorm.weight"], "w"));

  auto extra = params;
  extra["mlp.router.weight"] = Tensor::zeros(DType::F32, {2, 16});
  EXPECT_TRUE(
      throws_with<ShapeError>([&] { local_layer(c)->load_state_dict(extra); }, {"unexpected", "mlp.router.weight"}));
  auto missing = params;
  missing.erase("self_attention.linear_proj.weight");
  EXPECT_TRUE(throws_with<ShapeError>([&] { local_layer(c)->load_state_dict(missing); },
                                      {"self_attention.linear_proj.weight", "missing", "[16, 16]"}));
  auto wrong = params;
  wrong["self_attention.linear_qkv.weight"] = Tensor::zeros(DType::F32, {48, 15});
  EXPECT_TRUE(throws_with<ShapeError>([&] { local_layer(c)->load_state_dict(wrong); },
                                      {"self_attention.linear_qkv.weight", "expected shape [48, 16]", "got [48, 15]"}));
}

TEST(TransformerLayer, HiddenStatesOfWrongRankOrSizeAreErrors) {
  TransformerConfig c = small_config();
  std::mt19937_64 g(3);
  auto layer = local_layer(c);
  layer->load_state_dict(random_params(g, c));
  EXPECT_TRUE(throws_with<ShapeError>(
      [&] {
        layer->forward(random_tensor(g, {4, 16}));
      },
      {"hidden_states", "[s, b, 16]", "[4, 16]"}));
  EXPECT_TRUE(throws_with<ShapeError>(
      [&] {
        layer->forward(random_tensor(g, {4, 2, 12}));
      },
      {"hidden_states", "[s, b, 16]", "[4, 2, 12]"}));
  const Tensor x = random_tensor(g, {4, 2, 16});
  const Tensor mask = Tensor::from_vector<bool>({2, 1, 4, 3}, std::vector<bool>(24));
  LayerInputs in;
  in.attention_mask = &mask;
  EXPECT_TRUE(
      throws_with<ShapeError>([&] { layer->forward(x, in); }, {"attention_mask", "[2, 1, 4, 4]", "[2, 1, 4, 3]"}));
}

// Acceptance: with a causal mask, changing tokens after t leaves the layer's outputs up to t
// unchanged (bitwise: masked scores contribute exactly 0).
RC_GTEST_PROP(TransformerLayer, CausalPrefixProperty, ()) {
  const LayerCase lc = *gen_layer_case(true);  // in each stored dtype: parameters and input held in it
  const TransformerConfig c = to_config(lc);
  std::mt19937_64 g(lc.seed);
  auto layer = local_layer(c, Precision::from_config(c));
  std::map<std::string, Tensor> params;
  for (auto& [k, t] : random_params(g, c)) params[k] = t.to(lc.dtype);
  layer->load_state_dict(params);
  const int s = lc.s, b = lc.b, t = lc.t;
  const Mat x = random_mat(g, s * b, c.hidden_size);
  Mat y = x;
  y.bottomRows((s - t - 1) * b) = random_mat(g, (s - t - 1) * b, c.hidden_size, 2.0);
  const Tensor a = layer->forward(mat_tensor(x, {s, b, c.hidden_size}).to(lc.dtype)).first;
  const Tensor bb = layer->forward(mat_tensor(y, {s, b, c.hidden_size}).to(lc.dtype)).first;
  RC_ASSERT(a.dtype() == lc.dtype);
  const auto va = a.to_f64(), vb = bb.to_f64();
  for (int i = 0; i < (t + 1) * b * c.hidden_size; ++i) RC_ASSERT(va[i] == vb[i]);
}

// fp32 mode stays within fp32 rounding of the exact (fp64) mode; outputs are fp32 values.
RC_GTEST_PROP(TransformerLayer, Fp32ModeIsCloseToExactMode, ()) {
  const LayerCase lc = *gen_layer_case(false);
  const TransformerConfig c = to_config(lc);
  std::mt19937_64 g(lc.seed);
  const auto params = random_params(g, c);
  auto f = local_layer(c, Precision{}), e = local_layer(c, exact());
  f->load_state_dict(params);
  e->load_state_dict(params);
  const Tensor x = random_tensor(g, {3, 2, c.hidden_size});
  const Tensor yf = f->forward(x).first, ye = e->forward(x).first;
  RC_ASSERT(yf.dtype() == DType::F32);
  RC_ASSERT(ye.dtype() == DType::F64);
  const auto a = yf.to_f64(), b = ye.to_f64();
  for (std::size_t i = 0; i < a.size(); ++i) RC_ASSERT(std::abs(a[i] - b[i]) <= 1e-5 + 1e-4 * std::abs(b[i]));
}

TEST(TransformerLayer, Bf16ParamsStoreBf16Activations) {
  TransformerConfig c = small_config();
  c.bf16 = true;
  c.params_dtype = "bfloat16";
  std::mt19937_64 g(4);
  std::map<std::string, Tensor> params;
  for (auto& [k, t] : random_params(g, c)) params[k] = t.to(DType::BF16);
  auto layer = local_layer(c, Precision::from_config(c));
  layer->load_state_dict(params);
  TapRecord rec;
  const Tensor y = layer->forward(random_tensor(g, {3, 2, 16}).to(DType::BF16), {}, Taps(&rec)).first;
  EXPECT_EQ(y.dtype(), DType::BF16);
  for (const auto& e : rec.entries) EXPECT_EQ(e.value.dtype(), DType::BF16) << e.name;
  // within bf16 rounding of the exact layer on the same (bf16) values: 21 rounding points, u = 2^-8
  auto e = local_layer(c, exact());
  e->load_state_dict(params);
  std::mt19937_64 g2(4);
  random_params(g2, c);
  const Tensor ye = e->forward(random_tensor(g2, {3, 2, 16}).to(DType::BF16)).first;
  const auto a = y.to_f64(), b = ye.to_f64();
  double scale = 0;
  for (double v : b) scale = std::max(scale, std::abs(v));
  for (std::size_t i = 0; i < a.size(); ++i) EXPECT_LE(std::abs(a[i] - b[i]), 21 * std::ldexp(1.0, -8) * scale);
}

// apply_residual_connection_post_layernorm is not read by Megatron-Core's TransformerLayer at
// the pinned commit; the reference mirrors that.
TEST(TransformerLayer, ResidualPostLayernormFlagIsNotReadAsInMegatron) {
  TransformerConfig c = small_config();
  std::mt19937_64 g(5);
  const auto params = random_params(g, c);
  const Tensor x = random_tensor(g, {3, 2, 16});
  auto a = local_layer(c);
  a->load_state_dict(params);
  c.apply_residual_connection_post_layernorm = true;
  auto b = local_layer(c);
  b->load_state_dict(params);
  EXPECT_EQ(max_abs_diff(a->forward(x).first, b->forward(x).first), 0.0);
}

TEST(TransformerLayer, HiddenDropoutTrainingReproducibleBySeed) {
  TransformerConfig c = small_config();
  c.hidden_dropout = 0.0;
  std::mt19937_64 g(6);
  const auto params = random_params(g, c);
  const Tensor x = random_tensor(g, {3, 2, 16});
  auto eval = local_layer(c);
  eval->load_state_dict(params);
  auto train = local_layer(c);
  train->load_state_dict(params);
  train->training = true;
  EXPECT_EQ(max_abs_diff(eval->forward(x).first, train->forward(x).first), 0.0);  // p = 0: identity
  c.hidden_dropout = 0.3;
  c.attention_dropout = 0.2;
  auto d = local_layer(c);
  d->load_state_dict(params);
  d->training = true;
  d->rng = DropoutRng{7, 0};
  const Tensor y1 = d->forward(x).first, y2 = d->forward(x).first;
  EXPECT_EQ(max_abs_diff(y1, y2), 0.0);
  d->rng = DropoutRng{8, 0};
  EXPECT_GT(max_abs_diff(d->forward(x).first, y1), 0.0);
  d->training = false;  // eval: no dropout at all
  EXPECT_EQ(max_abs_diff(d->forward(x).first, eval->forward(x).first), 0.0);
}

// ---- Dropout, checked against its definition rather than twin against twin ---------------------

namespace {

// The keep decision of philox.h's mapping, written out from the KAT-checked Philox 4x32-10
// (test_philox_dropout.cpp): key (lo, hi of the seed), counter (lo, hi of element / 4, lo, hi of
// the offset), word element % 4, kept when its top 24 bits as a uniform in [0, 1) are below 1 - p.
bool keep_def(std::uint64_t seed, std::uint64_t offset, std::uint64_t element, double p) {
  const auto lo = [](std::uint64_t v) { return static_cast<std::uint32_t>(v); };
  const auto hi = [](std::uint64_t v) { return static_cast<std::uint32_t>(v >> 32); };
  const auto r = philox4x32_10({lo(element / 4), hi(element / 4), lo(offset), hi(offset)}, {lo(seed), hi(seed)});
  return std::ldexp(static_cast<double>(r[element % 4] >> 8), -24) < 1.0 - p;
}

// A slot that records its input under "in" and returns a fixed [n, h] value with no bias, so the
// bias-dropout-add after it adds dropout(value) to its residual: the next slot's input minus this
// one's is the kept-and-scaled value, exactly zero where the mask drops.
struct Probe {
  Mat value;
  void record(const Mat& x, const Taps& taps, Shape lead) const {
    lead.push_back(x.cols());
    if (taps.enabled()) taps.record("in", Tensor::from_doubles(DType::F64, lead, {x.data(), x.data() + x.size()}));
  }
};
class ProbeAttention : public AttentionModule {
 public:
  explicit ProbeAttention(Probe p) : probe_(std::move(p)) {}
  AttentionOutput forward(const Mat& x, const AttentionArgs& args, const Taps& taps) override {
    probe_.record(x, taps, {args.s, args.b});
    AttentionOutput o;
    o.output = probe_.value;
    return o;
  }
  void load_state_dict(const StateDict&, const std::string&) override {}

 private:
  Probe probe_;
};
class ProbeMlp : public MlpModule {
 public:
  explicit ProbeMlp(Probe p) : probe_(std::move(p)) {}
  OutputWithBias forward(const Mat& x, const MlpArgs& args, const Taps& taps) override {
    probe_.record(x, taps, args.lead);
    return OutputWithBias{probe_.value, std::nullopt};
  }
  void load_state_dict(const StateDict&, const std::string&) override {}

 private:
  Probe probe_;
};

std::vector<double> values_of(const TapRecord& rec, const std::string& name) {
  const Tensor* t = rec.find(name);
  if (!t) throw std::runtime_error("no tap " + name);
  return t->to_f64();
}

// Pearson correlation of two 0/1 masks.
double mask_correlation(const std::vector<bool>& a, const std::vector<bool>& b) {
  const double n = static_cast<double>(a.size());
  double sa = 0, sb = 0, sab = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    sa += a[i];
    sb += b[i];
    sab += a[i] && b[i];
  }
  const double ma = sa / n, mb = sb / n;
  return (sab / n - ma * mb) / std::sqrt(ma * (1 - ma) * mb * (1 - mb));
}

}  // namespace

// Every bias-dropout-add site (self_attn_bda, cross_attn_bda, mlp_bda) of both layers of a block,
// read off the layer itself: probes in the attention, cross-attention and MLP slots return a fixed
// value v, the input is zero, and the difference of consecutive probe inputs is dropout(v).
//  - keep rate: each site keeps 1 - p of its n elements within 6 binomial standard deviations,
//    sqrt(p (1 - p) / n) (a false alarm has probability about 2e-9 per check: none expected over
//    every check of every case a run makes);
//  - scale: a kept element is v * (1 / (1 - p)), torch's noise.div_(1 - p) times x, bit for bit at
//    the first site (its residual is zero) and within the one rounding of the residual add after it;
//  - masks: the six sites draw distinct masks, pairwise uncorrelated: independent masks have a
//    sample correlation with standard deviation 1 / sqrt(n), so |r| < 6 / sqrt(n) (the same 6-sigma
//    reason), where one stream shared by two sites would give r = 1.
RC_GTEST_PROP(TransformerLayer, HiddenDropoutKeepsAtItsRateScalesExactlyAndDrawsAMaskPerSiteAndLayer, ()) {
  const DropoutCase dc = *gen_dropout_case(1, 1, 1, 1);  // the sizes are fixed here: n per site
  const double p = dc.p;
  const DropoutRng rng{dc.rng_seed, dc.offset};
  const int s = 16, b = 4, h = 256;  // n = 16384 elements per site
  TransformerConfig c = small_config(h, 2, 2, 32);
  c.hidden_dropout = p;
  std::mt19937_64 g(dc.seed);
  Probe probe{Mat(s * b, h)};
  std::uniform_real_distribution<double> v(1.0, 2.0);  // nonzero, one binade: a kept value never vanishes in a sum
  for (Eigen::Index i = 0; i < probe.value.size(); ++i) probe.value.data()[i] = v(g);
  TransformerLayerSubmodules sub;
  sub.self_attention = [&](const TransformerConfig&, int, Precision) {
    return std::make_unique<ProbeAttention>(probe);
  };
  sub.cross_attention = [&](const TransformerConfig&, int, Precision) {
    return std::make_unique<ProbeAttention>(probe);
  };
  sub.mlp = [&](const TransformerConfig&, int, Precision) { return std::make_unique<ProbeMlp>(probe); };
  sub.self_attn_bda = sub.cross_attn_bda = sub.mlp_bda = get_bias_dropout_add();
  ModuleSpec spec = get_gpt_layer_local_spec();
  spec.submodules = sub;
  TransformerBlockSubmodules block_spec;
  block_spec.layer_specs = {spec, spec};
  TransformerBlock block(c, block_spec, exact());
  TapRecord rec;
  block.forward(Tensor::zeros(DType::F64, {s, b, h}), {}, /*training=*/true, rng, Taps(&rec));

  const double scale = 1.0 / (1.0 - p);
  const std::size_t n = static_cast<std::size_t>(s) * b * h;
  std::vector<std::vector<bool>> masks;
  std::vector<std::string> names;
  for (int l = 0; l < 2; ++l) {
    const std::string L = "layers." + std::to_string(l) + ".";
    const std::vector<std::vector<double>> stages = {values_of(rec, L + "self_attention.in"),
                                                     values_of(rec, L + "cross_attention.in"),
                                                     values_of(rec, L + "mlp.in"), values_of(rec, L + "0")};
    const char* site[] = {"self_attn_bda", "cross_attn_bda", "mlp_bda"};
    for (int k = 0; k < 3; ++k) {
      std::vector<bool> mask(n);
      std::size_t kept = 0;
      for (std::size_t e = 0; e < n; ++e) {
        const double before = stages[k][e], after = stages[k + 1][e], want = probe.value.data()[e] * scale;
        mask[e] = after != before;
        kept += mask[e];
        if (!mask[e]) continue;
        // Residual 0 at the first site: the kept value itself. Later sites: one rounding of the
        // residual add (u = 2^-53 of |after|) and one of the subtraction here.
        if (l == 0 && k == 0)
          RC_ASSERT(after == want);
        else
          RC_ASSERT(std::abs((after - before) - want) <= std::ldexp(std::abs(after) + std::abs(before), -52));
      }
      const double rate = static_cast<double>(kept) / n, sigma = std::sqrt(p * (1 - p) / n);
      RC_ASSERT(std::abs(rate - (1 - p)) <= 6 * sigma);
      masks.push_back(mask);
      names.push_back(L + site[k]);
    }
  }
  for (std::size_t i = 0; i < masks.size(); ++i)
    for (std::size_t j = i + 1; j < masks.size(); ++j) {
      RC_ASSERT(masks[i] != masks[j]);
      const double r = mask_correlation(masks[i], masks[j]);
      RC_LOG() << names[i] << " vs " << names[j] << ": r = " << r << "\n";
      RC_ASSERT(std::abs(r) < 6.0 / std::sqrt(static_cast<double>(n)));
    }
}

// Attention dropout in each layer of a real two-layer block: the core_attention tap equals
// attention computed here from the layer's own input_layernorm tap and linear_qkv parameters
// (Megatron's [s, b, ng, (np / ng + 2) hn] qkv layout, causal softmax in double) with dropout
// applied by hand: probs over the flat [b, np, sq, sk] elements kept by keep_def from the layer's
// stream (offset + 0 of the layer's, transformer_layer.h; a block's layer i has offset + 8 i) and
// scaled by 1 / (1 - p), dropped ones zero. An attention dropout that ignores its mask (keeps
// all, drops none, or draws another stream) changes the context where the mask drops and fails.
RC_GTEST_PROP(TransformerLayer, AttentionDropoutChangesTheContextExactlyWhereItsMaskSays, ()) {
  const DropoutCase dc = *gen_dropout_case(2, 2, 6, 1);
  const double p = dc.p;
  const int ng = dc.ng, np = dc.np, hn = 4;
  const int s = dc.s, b = dc.b, h = 16;
  const DropoutRng rng{dc.rng_seed, dc.offset};
  TransformerConfig c = small_config(h, np, ng, 32);
  c.kv_channels = hn;
  c.attention_dropout = p;
  c.hidden_dropout = 0.0;
  std::mt19937_64 g(dc.seed);
  TransformerBlockSubmodules block_spec;
  block_spec.layer_specs = {get_gpt_layer_local_spec(), get_gpt_layer_local_spec()};
  TransformerBlock block(c, block_spec, exact());
  std::map<std::string, Tensor> params;
  for (int l = 0; l < 2; ++l)
    for (auto& [k, t] : random_params(g, c)) params["layers." + std::to_string(l) + "." + k] = t;
  block.load_state_dict(StateDict(params));
  TapRecord rec;
  block.forward(random_tensor(g, {s, b, h}), {}, /*training=*/true, rng, Taps(&rec));

  const int r = np / ng, group = (r + 2) * hn;
  std::size_t dropped_unmasked = 0;
  for (int l = 0; l < 2; ++l) {
    const std::string L = "layers." + std::to_string(l) + ".";
    const std::uint64_t offset = rng.offset + 8 * l;
    const std::vector<double> x = values_of(rec, L + "input_layernorm");                       // [s, b, h]
    const std::vector<double> ctx = values_of(rec, L + "self_attention.core_attention");       // [s, b, np * hn]
    const std::vector<double> w = params.at(L + "self_attention.linear_qkv.weight").to_f64();  // [ng * group, h]
    const std::vector<double> bias = params.at(L + "self_attention.linear_qkv.bias").to_f64();
    auto mixed = [&](int si, int bi, int row) {  // linear_qkv output of token (si, bi), row `row`
      double acc = bias[row];
      for (int k = 0; k < h; ++k) acc += x[(si * b + bi) * h + k] * w[row * h + k];
      return acc;
    };
    for (int bi = 0; bi < b; ++bi)
      for (int head = 0; head < np; ++head) {
        const int gi = head / r, q0 = gi * group + (head % r) * hn, k0 = gi * group + r * hn, v0 = k0 + hn;
        for (int i = 0; i < s; ++i) {
          std::vector<double> probs(s, 0.0);
          double mx = -1e300, sum = 0.0;
          for (int j = 0; j <= i; ++j) {  // causal: j > i masked
            double dot = 0.0;
            for (int d = 0; d < hn; ++d) dot += mixed(i, bi, q0 + d) * mixed(j, bi, k0 + d);
            probs[j] = dot / std::sqrt(static_cast<double>(hn));
            mx = std::max(mx, probs[j]);
          }
          for (int j = 0; j <= i; ++j) sum += probs[j] = std::exp(probs[j] - mx);
          for (int j = 0; j <= i; ++j) {
            probs[j] /= sum;
            const std::uint64_t e = ((static_cast<std::uint64_t>(bi) * np + head) * s + i) * s + j;
            if (keep_def(rng.seed, offset, e, p)) {
              probs[j] *= 1.0 / (1.0 - p);
            } else {
              probs[j] = 0.0;
              ++dropped_unmasked;
            }
          }
          for (int d = 0; d < hn; ++d) {
            double want = 0.0;
            for (int j = 0; j <= i; ++j) want += probs[j] * mixed(j, bi, v0 + d);
            const double got = ctx[((i * b + bi) * np + head) * hn + d];
            RC_ASSERT(std::abs(got - want) <= 1e-10 * (1.0 + std::abs(want)));
          }
        }
      }
  }
  // A case where the mask dropped no unmasked probability shows nothing (2 layers x >= 21 of them
  // at p >= 0.2: that happens with probability < 1e-4): discarded, not passed.
  RC_PRE(dropped_unmasked > 0);
}

namespace {
// An MLP slot implementation as the MoE layer plugs in: output 2x, bias 1, its own taps.
class DoublingMlp : public MlpModule {
 public:
  OutputWithBias forward(const Mat& x, const MlpArgs& args, const Taps& taps) override {
    OutputWithBias o{2.0 * x, RowVec::Ones(x.cols())};
    if (taps.enabled()) taps.record("router.logits", Tensor::zeros(DType::F32, {args.lead[0], args.lead[1], 1}));
    return o;
  }
  void load_state_dict(const StateDict& sd, const std::string& prefix) { sd.get(prefix + "router.weight", {1}); }
};
// A cross-attention slot as Retro plugs in: returns a context and a payload its bda reads.
class ContextAttention : public AttentionModule {
 public:
  AttentionOutput forward(const Mat& x, const AttentionArgs&, const Taps&) override {
    AttentionOutput o;
    o.output = x;
    o.context = Tensor::zeros(DType::F32, {1, 2, 3});
    o.extra = std::make_shared<double>(5.0);
    return o;
  }
  void load_state_dict(const StateDict&, const std::string&) override {}
};
}  // namespace

TEST(TransformerLayer, MlpCrossAttentionAndBdaSlotsArePluggable) {
  TransformerConfig c = small_config();
  TransformerLayerSubmodules s;
  s.mlp = [](const TransformerConfig&, int, Precision) { return std::make_unique<DoublingMlp>(); };
  s.mlp_bda = get_bias_dropout_add();
  s.cross_attention = [](const TransformerConfig&, int, Precision) { return std::make_unique<ContextAttention>(); };
  s.cross_attn_bda = [](bool, bool, DropoutRng, Precision) -> BdaFunc {
    return [](const AttentionOutput& o, const Mat& residual, double) {
      return Mat(o.output + residual * *std::static_pointer_cast<const double>(o.extra));
    };
  };
  TransformerLayer layer(c, s, 1, std::nullopt, exact());
  std::map<std::string, Tensor> sd{{"mlp.router.weight", Tensor::zeros(DType::F32, {1})}};
  layer.load_state_dict(sd);
  std::mt19937_64 g(7);
  const Tensor x = random_tensor(g, {3, 2, 16});
  TapRecord rec;
  auto [y, ctx] = layer.forward(x, {}, Taps(&rec));
  ASSERT_TRUE(ctx.has_value());
  EXPECT_EQ(ctx->shape(), (Shape{1, 2, 3}));
  // h = x + 5x = 6x; out = h + (2h + 1)
  const auto vx = x.to_f64(), vy = y.to_f64();
  for (std::size_t i = 0; i < vx.size(); ++i) EXPECT_NEAR(vy[i], 18.0 * vx[i] + 1.0, 1e-12);
  ASSERT_EQ(rec.entries.size(), 1u);
  EXPECT_EQ(rec.entries[0].name, "mlp.router.logits");
}

TEST(TransformerLayer, LocalSpecShape) {
  const ModuleSpec plain = get_gpt_layer_local_spec();
  EXPECT_TRUE(plain.submodules.input_layernorm && plain.submodules.self_attention && plain.submodules.self_attn_bda);
  EXPECT_FALSE(plain.submodules.pre_cross_attn_layernorm || plain.submodules.cross_attention ||
               plain.submodules.cross_attn_bda);
  EXPECT_TRUE(plain.submodules.pre_mlp_layernorm && plain.submodules.mlp && plain.submodules.mlp_bda);
  TransformerConfig c = small_config();
  auto built = plain.build(c, 1, exact());
  EXPECT_NE(dynamic_cast<TransformerLayer*>(built.get()), nullptr);  // a BaseTransformerLayer
  EXPECT_THROW(get_gpt_layer_local_spec(4), std::invalid_argument);
}
