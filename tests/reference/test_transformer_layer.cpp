// TransformerLayer, its spec and state_dict loading (reference/transformer_layer.h).
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include "dense_test_util.h"
#include "reference/transformer_layer.h"

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

rc::Gen<TransformerConfig> gen_config() {
  return rc::gen::exec([] {
    const int ng = *rc::gen::inRange(1, 3);
    const int np = ng * *rc::gen::inRange(1, 3);
    const int hn = 2 * *rc::gen::inRange(1, 4);
    TransformerConfig c = small_config(*rc::gen::inRange(2, 5) * 4, np, ng, *rc::gen::inRange(4, 20));
    c.kv_channels = hn;
    c.normalization = *rc::gen::element<std::string>("LayerNorm", "RMSNorm");
    c.activation_func = *rc::gen::element<std::string>("gelu", "silu", "squared_relu", "quick_gelu");
    c.gated_linear_unit = *rc::gen::arbitrary<bool>();
    c.add_bias_linear = *rc::gen::arbitrary<bool>();
    c.qk_layernorm = *rc::gen::arbitrary<bool>();
    return c;
  });
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
  const TransformerConfig c = *gen_config();
  std::mt19937_64 g(*rc::gen::arbitrary<std::uint32_t>());
  auto layer = local_layer(c);
  layer->load_state_dict(random_params(g, c));
  const int s = *rc::gen::inRange(2, 7), b = *rc::gen::inRange(1, 3), t = *rc::gen::inRange(0, s);
  const Mat x = random_mat(g, s * b, c.hidden_size);
  Mat y = x;
  y.bottomRows((s - t - 1) * b) = random_mat(g, (s - t - 1) * b, c.hidden_size, 2.0);
  const Tensor a = layer->forward(mat_tensor(x, {s, b, c.hidden_size})).first;
  const Tensor bb = layer->forward(mat_tensor(y, {s, b, c.hidden_size})).first;
  const auto va = a.to_f64(), vb = bb.to_f64();
  for (int i = 0; i < (t + 1) * b * c.hidden_size; ++i) RC_ASSERT(va[i] == vb[i]);
}

// fp32 mode stays within fp32 rounding of the exact (fp64) mode; outputs are fp32 values.
RC_GTEST_PROP(TransformerLayer, Fp32ModeIsCloseToExactMode, ()) {
  const TransformerConfig c = *gen_config();
  std::mt19937_64 g(*rc::gen::arbitrary<std::uint32_t>());
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
