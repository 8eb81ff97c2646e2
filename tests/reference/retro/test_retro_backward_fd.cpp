// The reference's Retro backward against central finite differences of its own forward, both in
// fp64 exact mode: the model and the tolerance are tests/reference/test_layer_backward_fd.cpp's.
//
// Each case is a small random Retro config, parameters and inputs drawn from one seed, its case
// id (a failure names it; TWIN_FD_CASE=<id> reruns just that case, TWIN_FD_CASES=<n> runs ids
// 0 .. n-1, 100 by default, which CI runs). By id % 3 the module is
//   0: a later Retro decoder layer (context = the encoder output [r*k, bs*l, h]),
//   1: the first Retro decoder layer with its encoder (context = the neighbour embeddings
//      [r, k*bs*l, h], optionally a context_mask for the encoder's self-attention),
//   2: a Retro decoder block of 6 or 9 layers (layer 6 the first Retro layer; with 9, layer 9 a
//      later one reading layer 6's encoder output through the block).
// Configs vary hidden size, heads, head size, chunk length (sequences that divide it or not),
// neighbours, retrieved chunks, encoder layers, batch, biases, LayerNorm / RMSNorm (TE spec),
// GLU, smooth activations, and training with dropout everywhere (the masks fixed by the seed).
// The loss is L = sum(output * G), for a layer plus sum(context * G_c) on the context it returns
// when the case draws one (grad_context); its gradient is backward(G, G_c). Probes: every
// gradient exists with the parameter's shape, and per case the inputs hidden_states and context
// and six random parameters, each at its largest analytic coordinate and one random one.
//
// Tolerance (derived, as in the dense test): |analytic - D(d/2)| <= |D(d) - D(d/2)| (three times
// Richardson's estimate of D(d/2)'s truncation error) + k u64 (M / d + |analytic|), where M =
// sum |terms of L| and k the operations deep of one forward: the dense test's 10^3 per layer,
// times the layers (decoder and encoder) the value passes through. Retro's ops are smooth (no
// relu, no clamps drawn), so no probe is excluded.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <map>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "tests/reference/fd_check.h"
#include "reference/retro/decoder_layer_spec.h"
#include "reference/retro/decoder_spec.h"
#include "reference/retro/encoder_spec.h"
#include "reference/transformer_block.h"
#include "reference/transformer_config.h"
#include "reference/transformer_layer.h"

using namespace twin;
using namespace twin::reference;
using namespace twin::reference::retro;

namespace {

enum class Kind { Later, First, Block };

struct Case {
  std::uint64_t id = 0;
  Kind kind = Kind::Later;
  TransformerConfig config;
  bool te = false;  // the TE spec family (TENorm: RMSNorm allowed)
  int ns = 0, bs = 0, layer_number = 9, layers = 1;
  std::map<std::string, Tensor> params;
  Tensor hidden_states, context, grad_output;
  std::optional<Tensor> grad_context, context_mask;
  bool training = false;
  DropoutRng rng;
  std::string describe;
};

Precision exact() { return Precision{ComputeMode::Exact, DType::F32}; }

using twin::test::f64_tensor;
using twin::test::with_element;

Case make_case(std::uint64_t id) {
  std::mt19937_64 g(id * 0x9E3779B97F4A7C15ull + 11);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(g); };
  auto coin = [&](double p = 0.5) { return std::bernoulli_distribution(p)(g); };
  Case k;
  k.id = id;
  k.kind = static_cast<Kind>(id % 3);
  TransformerConfig& c = k.config;
  const int np = pick(1, 2), hn = 2 * pick(1, 2), h = 4 * pick(1, 2);
  c.hidden_size = h;
  c.num_attention_heads = np;
  c.num_query_groups = np;  // cross attention has no GQA
  c.kv_channels = hn;
  const int ffn = 2 * pick(2, 4);
  c.ffn_hidden_size = ffn;
  c.num_layers = k.kind == Kind::Block ? (coin() ? 9 : 6) : 12;
  k.te = coin();
  c.normalization = k.te && coin() ? "RMSNorm" : "LayerNorm";
  static const char* acts[] = {"gelu", "silu", "quick_gelu"};
  c.activation_func = acts[pick(0, 2)];
  c.gated_linear_unit = coin(0.3);
  c.add_bias_linear = coin();
  c.add_qkv_bias = c.add_bias_linear;
  c.attention_softmax_in_fp32 = true;
  const int m = pick(1, 3), nbr = pick(1, 2), chunks = pick(1, 2);
  c.retro_chunk_length = m;
  c.retro_num_neighbors = nbr;
  c.retro_num_retrieved_chunks = chunks;
  c.retro_retrieved_length = m * chunks;
  c.retro_encoder_num_layers = pick(1, 2);
  c.retro_split_preprocessing = "98,2,0";
  c.hidden_dropout = c.attention_dropout = 0.0;
  c.retro_encoder_hidden_dropout = c.retro_encoder_attention_dropout = 0.0;
  k.training = coin();
  if (k.training && coin()) {
    c.hidden_dropout = c.attention_dropout = 0.25;
    c.retro_encoder_hidden_dropout = c.retro_encoder_attention_dropout = 0.25;
    k.rng = DropoutRng{static_cast<std::uint64_t>(pick(0, 1 << 20)), static_cast<std::uint64_t>(pick(0, 8))};
  }
  k.ns = pick(1, 2 * m + 1);
  k.bs = pick(1, 2);
  const int r = m * chunks, l = (k.ns + m - 1) / m;
  const bool ln = c.normalization == "LayerNorm", bias = c.add_bias_linear;
  const int fc1 = c.gated_linear_unit ? 2 * ffn : ffn;

  auto add = [&](const std::string& key, Shape shape, double scale) { k.params[key] = f64_tensor(g, shape, scale); };
  auto norm = [&](const std::string& p) {
    add(p + "weight", {h}, 1.0);
    if (ln) add(p + "bias", {h}, 0.1);
  };
  auto linear = [&](const std::string& p, int out, int in) {
    add(p + "weight", {out, in}, 0.5);
    if (bias) add(p + "bias", {out}, 0.1);
  };
  // A GPT layer's keys; encoder: the Retro encoder layer's (RetroEncoderLayerNorm's "norm.").
  auto gpt_layer = [&](const std::string& p, bool encoder) {
    norm(p + "input_layernorm.");
    linear(p + "self_attention.linear_qkv.", 3 * np * hn, h);
    linear(p + "self_attention.linear_proj.", h, np * hn);
    norm(p + (encoder ? "pre_mlp_layernorm.norm." : "pre_mlp_layernorm."));
    linear(p + "mlp.linear_fc1.", fc1, h);
    linear(p + "mlp.linear_fc2.", h, ffn);
  };
  auto cross = [&](const std::string& p) {
    norm(p + "pre_cross_attn_layernorm.");
    linear(p + "cross_attention.attn.linear_q.", np * hn, h);
    linear(p + "cross_attention.attn.linear_kv.", 2 * np * hn, h);
    linear(p + "cross_attention.attn.linear_proj.", h, np * hn);
  };
  auto retro_layer = [&](const std::string& p, bool with_encoder) {
    gpt_layer(p, false);
    cross(p);
    if (!with_encoder) return;
    for (int i = 0; i < *c.retro_encoder_num_layers; ++i) {
      const std::string e = p + "cross_attention.encoder.layers." + std::to_string(i) + ".";
      gpt_layer(e, i == 0);
      if (i == 0) cross(e);
    }
  };
  switch (k.kind) {
    case Kind::Later:
      retro_layer("", false);
      break;
    case Kind::First:
      retro_layer("", true);
      break;
    case Kind::Block: {
      const auto layout = get_retro_decoder_block_layout(c.num_layers);
      k.layers = c.num_layers;
      for (std::size_t i = 0; i < layout.size(); ++i) {
        const std::string p = "layers." + std::to_string(i) + ".";
        if (layout[i] == RetroLayerKind::Gpt)
          gpt_layer(p, false);
        else
          retro_layer(p, layout[i] == RetroLayerKind::RetroWithEncoder);
      }
      break;
    }
  }
  if (k.kind != Kind::Later) k.layers += *c.retro_encoder_num_layers;
  k.hidden_states = f64_tensor(g, {k.ns, k.bs, h}, 1.0);
  k.grad_output = f64_tensor(g, {k.ns, k.bs, h}, 1.0);
  const Shape encoder_output{r * nbr, k.bs * l, h};
  if (k.kind == Kind::Later) {
    k.context = f64_tensor(g, encoder_output, 1.0);
  } else {
    k.context = f64_tensor(g, {r, nbr * k.bs * l, h}, 1.0);  // the neighbour embeddings
    if (coin()) {
      std::vector<bool> mask(static_cast<std::size_t>(nbr) * k.bs * l * r * r);
      for (std::size_t i = 0; i < mask.size(); ++i) mask[i] = coin(0.3);
      k.context_mask = Tensor::from_vector<bool>({nbr * k.bs * l, 1, r, r}, mask);
    }
  }
  if (k.kind != Kind::Block && coin()) k.grad_context = f64_tensor(g, encoder_output, 1.0);
  std::ostringstream d;
  d << (k.kind == Kind::Later   ? "later layer"
        : k.kind == Kind::First ? "first layer"
                                : "block")
    << (k.kind == Kind::Block ? " of " + std::to_string(c.num_layers) : "") << (k.te ? " te" : " local") << " h " << h
    << " np " << np << " hn " << hn << " ffn " << ffn << " m " << m << " k " << nbr << " chunks " << chunks
    << " encoder layers " << *c.retro_encoder_num_layers << " ns " << k.ns << " bs " << k.bs << " " << c.normalization
    << " " << c.activation_func << (c.gated_linear_unit ? " glu" : "") << (bias ? " bias" : "")
    << (k.context_mask ? " context_mask" : "") << (k.grad_context ? " grad_context" : "")
    << (k.training ? " training" : "") << (c.hidden_dropout > 0 ? " dropout" : "");
  k.describe = d.str();
  return k;
}

struct Run {
  double loss = 0.0, magnitude = 0.0;  // L and sum |terms of L|
};

struct Grads {
  Tensor hidden_states;
  std::optional<Tensor> context;
  ParamGrads params;
};

void accumulate(Run& r, const Tensor& out, const Tensor& g) {
  const std::vector<double> o = out.to_f64(), gy = g.to_f64();
  for (std::size_t i = 0; i < o.size(); ++i) {
    r.loss += o[i] * gy[i];
    r.magnitude += std::fabs(o[i] * gy[i]);
  }
}

class Harness {
 public:
  explicit Harness(const Case& k) : k_(k) { in_.context_mask = k_.context_mask ? &*k_.context_mask : nullptr; }

  std::unique_ptr<TransformerLayer> layer(const std::map<std::string, Tensor>& params) const {
    std::optional<TransformerBlockSubmodules> encoder;
    if (k_.kind == Kind::First) encoder = get_retro_encoder_block_spec(k_.config, k_.te);
    const RetroLayerSpec spec =
        k_.te ? get_retro_decoder_layer_te_spec(encoder) : get_retro_decoder_layer_local_spec(encoder);
    std::unique_ptr<BaseTransformerLayer> built = spec.spec.build(k_.config, k_.layer_number, exact());
    std::unique_ptr<TransformerLayer> l(dynamic_cast<TransformerLayer*>(built.release()));
    l->load_state_dict(params);
    l->training = k_.training;
    l->rng = k_.rng;
    return l;
  }

  std::unique_ptr<TransformerBlock> block(const std::map<std::string, Tensor>& params) const {
    auto b = std::make_unique<TransformerBlock>(k_.config, get_retro_decoder_block_spec(k_.config, k_.te), exact());
    const StateDict sd(params);
    b->load_state_dict(sd);
    sd.expect_all_used("Retro FD block");
    return b;
  }

  Run run(const std::map<std::string, Tensor>& params, const Tensor& x, const Tensor& context) const {
    LayerInputs in = in_;
    in.context = &context;
    Run r;
    if (k_.kind == Kind::Block) {
      accumulate(r, block(params)->forward(x, in, k_.training, k_.rng, {}), k_.grad_output);
      return r;
    }
    const auto [out, ctx] = layer(params)->forward(x, in, {});
    accumulate(r, out, k_.grad_output);
    if (k_.grad_context) accumulate(r, *ctx, *k_.grad_context);
    return r;
  }

  Grads grads() const {
    LayerInputs in = in_;
    in.context = &k_.context;
    if (k_.kind == Kind::Block) {
      TransformerBlockSaved saved;
      auto b = block(k_.params);
      b->forward(k_.hidden_states, in, k_.training, k_.rng, {}, nullptr, &saved);
      TransformerBlockGrads g = b->backward(k_.grad_output, std::move(saved));
      return {g.hidden_states, g.context, g.params};
    }
    TransformerLayerSaved saved;
    auto l = layer(k_.params);
    l->forward(k_.hidden_states, in, {}, &saved);
    TransformerLayerGrads g =
        l->backward(k_.grad_output, std::move(saved), k_.grad_context ? &*k_.grad_context : nullptr);
    return {g.hidden_states, g.context, g.params};
  }

 private:
  const Case& k_;
  LayerInputs in_;
};

::testing::AssertionResult probe(const Case& k, const Harness& hx, const std::string& name, std::int64_t i,
                                 double analytic, twin::test::FdTally& tally) {
  const bool is_hidden = name == "input.hidden_states", is_context = name == "input.context";
  const Tensor& base = is_hidden ? k.hidden_states : is_context ? k.context : k.params.at(name.substr(6));
  auto run = [&](double v) {
    if (is_hidden) return hx.run(k.params, with_element(base, i, v), k.context);
    if (is_context) return hx.run(k.params, k.hidden_states, with_element(base, i, v));
    auto p = k.params;
    p[name.substr(6)] = with_element(base, i, v);
    return hx.run(p, k.hidden_states, k.context);
  };
  auto smooth = [](const Run&, const Run&, const Run&, const Run&) { return false; };  // no kinks drawn
  const double depth = 1e3 * k.layers;  // operations deep of one forward (see the file comment)
  return twin::test::probe_coordinate(
      base.at_f64(i), analytic, run, smooth, depth,
      "case " + std::to_string(k.id) + " (" + k.describe + "): d L / d " + name + "[" + std::to_string(i) + "]", k.id,
      tally);
}

std::vector<double> values(const Tensor& t) { return t.to_f64(); }
std::vector<double> values(const Mat& m) { return std::vector<double>(m.data(), m.data() + m.size()); }

}  // namespace

TEST(RetroBackward, MatchesCentralDifferencesInExactMode) {
  int cases = 0;
  twin::test::FdTally tally;
  for (const std::uint64_t id : twin::test::fd_case_ids()) {
    const Case k = make_case(id);
    const Harness hx(k);
    const Grads grads = hx.grads();
    std::mt19937_64 g(id + 7);
    // Every parameter has a gradient of its shape, and nothing else does; both inputs have one.
    std::map<std::string, const ParamGrad*> by_key;
    for (const ParamGrad& p : grads.params) by_key[p.name] = &p;
    ASSERT_EQ(by_key.size(), k.params.size()) << "case " << id << " (" << k.describe << ")";
    ASSERT_EQ(grads.hidden_states.shape(), k.hidden_states.shape()) << "case " << id;
    ASSERT_TRUE(grads.context) << "case " << id << ": no gradient for the context";
    ASSERT_EQ(grads.context->shape(), k.context.shape()) << "case " << id;
    std::vector<std::pair<std::string, std::vector<double>>> targets;
    targets.emplace_back("input.hidden_states", values(grads.hidden_states));
    targets.emplace_back("input.context", values(*grads.context));
    std::vector<std::string> keys;
    for (const auto& [key, t] : k.params) {
      ASSERT_TRUE(by_key.count(key)) << "case " << id << ": no gradient for " << key;
      ASSERT_EQ(by_key[key]->shape, t.shape()) << "case " << id << ": " << key;
      keys.push_back(key);
    }
    std::shuffle(keys.begin(), keys.end(), g);
    keys.resize(std::min<std::size_t>(keys.size(), 6));
    for (const std::string& key : keys) targets.emplace_back("param." + key, values(by_key[key]->value));
    for (const auto& [name, analytic] : targets) {
      for (const std::int64_t i : twin::test::probe_coords(analytic, g, 1))
        ASSERT_TRUE(probe(k, hx, name, i, analytic[static_cast<std::size_t>(i)], tally));
    }
    ++cases;
  }
  std::cout << cases << " cases, " << tally.compared << " probes compared\n";
}

// Bad gradients are clear errors: a grad_output or grad_context of another shape than the forward's
// output / returned context, or a `saved` no forward filled.
TEST(RetroBackward, BadGradientsAreErrors) {
  for (const std::uint64_t id : {0, 1}) {  // a later layer, a first layer
    const Case k = make_case(id);
    const Harness hx(k);
    auto layer = hx.layer(k.params);
    LayerInputs in;
    in.context = &k.context;
    in.context_mask = k.context_mask ? &*k.context_mask : nullptr;
    // A forward's activations for each call: backward consumes them, an error part way included.
    std::optional<Tensor> ctx;
    auto forward = [&] {
      TransformerLayerSaved saved;
      ctx = layer->forward(k.hidden_states, in, {}, &saved).second;
      return saved;
    };
    forward();
    ASSERT_TRUE(ctx);
    const Tensor wrong_out = Tensor::zeros(DType::F64, {k.ns + 1, k.bs, k.config.hidden_size});
    EXPECT_THROW(layer->backward(wrong_out, forward()), ShapeError) << k.describe;
    const Tensor wrong_ctx = Tensor::zeros(DType::F64, {ctx->size(0) + 1, ctx->size(1), ctx->size(2)});
    EXPECT_THROW(layer->backward(k.grad_output, forward(), &wrong_ctx), ShapeError) << k.describe;
    EXPECT_NO_THROW(layer->backward(k.grad_output, forward(), &*ctx)) << k.describe;
    EXPECT_THROW(layer->backward(k.grad_output, TransformerLayerSaved{}), std::logic_error) << k.describe;
  }
}
