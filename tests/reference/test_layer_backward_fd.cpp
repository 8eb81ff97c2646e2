// The reference's dense TransformerLayer backward against central finite differences of its own
// forward, both in fp64 exact mode (ggml test-backend-ops' gradient mode is the model: central
// differences, a precise mode, non-smooth points excluded).
//
// Each case is a config, parameters and inputs drawn from one seed, its case id: a failure names
// it, and TWIN_FD_CASE=<id> reruns just that case (TWIN_FD_CASES=<n> runs ids 0 .. n-1; 100 by
// default, which CI runs). Per case, the loss is L = sum(output * G) for a random G, whose gradient
// is backward(G); probes compare it, coordinate by coordinate, with central differences
//   D(d) = (L(theta + d e_i) - L(theta - d e_i)) / (2 d)
// on the input hidden_states and on every parameter (random coordinates plus the one with the
// largest analytic gradient).
//
// Tolerance (derived, not tuned): for a smooth L, D(d) = L'(theta) + c d^2 + O(d^4), so Richardson's
// estimate of D(d/2)'s truncation error is |D(d) - D(d/2)| / 3; we allow |D(d) - D(d/2)|, three
// times that estimate, for the O(d^4) terms it omits. Rounding: each L is computed in fp64 by a
// forward about k = 10^3 operations deep, so it carries at most ~k u64 sum|output * G| of error,
// which the difference quotient divides by d (the analytic gradient carries k u64 |grad|):
//   |analytic - D(d/2)| <= |D(d) - D(d/2)| + k u64 (M / d + |analytic|),   M = sum |output * G|.
// A wrong gradient (a dropped term, a transposed index, a wrong scale) misses by O(|grad|),
// orders above this.
//
// Non-smooth points: relu / squared_relu at 0 and activation_func_clamp_value's clamps are kinks.
// A probe whose +-d steps move any activation input across a kink (checked on the saved activation
// inputs of the two perturbed forwards) is excluded and counted, never compared.
#include <gtest/gtest.h>

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
#include "dense_test_util.h"
#include "reference/rotary_pos_embedding.h"
#include "reference/transformer_layer.h"

using namespace twin;
using namespace twin::reference;
using namespace twin::reference::testing;

namespace {

struct Case {
  std::uint64_t id = 0;
  TransformerConfig config;
  int s = 0, b = 0, layer_number = 1;
  std::map<std::string, Tensor> params;
  Tensor hidden_states, grad_output;
  std::optional<Tensor> attention_mask, rotary_pos_emb;
  bool training = false;
  DropoutRng rng;
  std::string describe;  // the config in words, printed with failures
};

using twin::test::f64_tensor;
using twin::test::with_element;

// Multi-latent attention's config and parameters in place of the standard attention's: the q
// path with or without q_lora_rank, the kv path, the rotary part and v of their own head dims,
// plain RoPE (with rotary_percent) or YaRN (its ramp inside or outside the rotary dims, mscale
// and mscale_all_dim equal or not, scaling factor 1 or more).
template <class Pick, class Coin, class Add>
std::string draw_mla(TransformerConfig& c, Pick pick, Coin coin, Add add, int np) {
  c.multi_latent_attention = true;
  c.num_query_groups = np;
  c.position_embedding_type = "rope";
  c.q_lora_rank = coin() ? std::optional<int>(pick(3, 8)) : std::nullopt;
  c.kv_lora_rank = pick(3, 8);
  c.qk_head_dim = 2 * pick(1, 3);
  c.qk_pos_emb_head_dim = 4 * pick(1, 2);
  c.v_head_dim = 2 * pick(1, 4);
  c.rope_type = coin() ? "yarn" : "rope";
  c.rotary_base = coin() ? 10000.0 : 100.0;
  if (c.rope_type == "rope") {
    c.rotary_percent = coin() ? 1.0 : 0.5;
  } else {
    static const double factors[] = {1.0, 4.0, 40.0}, mscales[] = {0.0, 0.5, 1.0};
    c.rotary_scaling_factor = factors[pick(0, 2)];
    c.original_max_position_embeddings = pick(2, 64);
    c.mscale = mscales[pick(0, 2)];
    c.mscale_all_dim = coin() ? c.mscale : mscales[pick(0, 2)];
  }
  const int h = c.hidden_size, qhd = c.qk_head_dim + c.qk_pos_emb_head_dim;
  const bool ln = c.normalization == "LayerNorm";
  if (c.q_lora_rank) {
    add("self_attention.linear_q_down_proj.weight", {*c.q_lora_rank, h}, 0.5);
    add("self_attention.linear_q_up_proj.weight", {np * qhd, *c.q_lora_rank}, 0.5);
    if (c.qk_layernorm) add("self_attention.q_layernorm.weight", {*c.q_lora_rank}, 1.0);
    if (c.qk_layernorm && ln) add("self_attention.q_layernorm.bias", {*c.q_lora_rank}, 0.1);
  } else {
    add("self_attention.linear_q_proj.weight", {np * qhd, h}, 0.5);
  }
  add("self_attention.linear_kv_down_proj.weight", {c.kv_lora_rank + c.qk_pos_emb_head_dim, h}, 0.5);
  add("self_attention.linear_kv_up_proj.weight", {np * (c.qk_head_dim + c.v_head_dim), c.kv_lora_rank}, 0.5);
  if (c.qk_layernorm) add("self_attention.kv_layernorm.weight", {c.kv_lora_rank}, 1.0);
  if (c.qk_layernorm && ln) add("self_attention.kv_layernorm.bias", {c.kv_lora_rank}, 0.1);
  add("self_attention.linear_proj.weight", {h, np * c.v_head_dim}, 0.5);
  if (c.add_bias_linear) add("self_attention.linear_proj.bias", {h}, 0.1);
  std::ostringstream d;
  d << " mla q_lora " << (c.q_lora_rank ? std::to_string(*c.q_lora_rank) : "none") << " kv_lora " << c.kv_lora_rank
    << " qk " << c.qk_head_dim << " pe " << c.qk_pos_emb_head_dim << " v " << c.v_head_dim << " " << c.rope_type;
  if (c.rope_type == "yarn")
    d << " factor " << c.rotary_scaling_factor << " original_max " << c.original_max_position_embeddings << " mscale "
      << c.mscale << "/" << c.mscale_all_dim;
  else
    d << " percent " << c.rotary_percent;
  return d.str();
}

// mla: the self attention is multi-latent attention (draw_mla).
Case make_case(std::uint64_t id, bool mla = false) {
  std::mt19937_64 g(id * 0x9E3779B97F4A7C15ull + 1 + (mla ? 0x5A5A : 0));
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(g); };
  auto coin = [&](double p = 0.5) { return std::bernoulli_distribution(p)(g); };
  Case k;
  k.id = id;
  TransformerConfig& c = k.config;
  const int ng = pick(1, 2), np = ng * pick(1, 3), hn = 4 * pick(1, 2);
  c = small_config(4 * pick(2, 4), np, ng, pick(4, 12));
  c.kv_channels = hn;
  c.normalization = coin() ? "LayerNorm" : "RMSNorm";
  static const char* acts[] = {"gelu",      "silu",     "quick_gelu", "openai_gelu",
                               "fast_gelu", "erf_gelu", "relu",       "squared_relu"};
  c.activation_func = acts[pick(0, 7)];
  c.gated_linear_unit = coin();
  if (c.gated_linear_unit && coin(0.25)) c.glu_linear_offset = 0.5;
  if (c.gated_linear_unit && coin(0.25)) c.activation_func_clamp_value = 1.0;
  c.add_bias_linear = coin();
  c.add_qkv_bias = !c.add_bias_linear && coin();
  c.qk_layernorm = coin();
  c.attention_softmax_in_fp32 = true;
  c.apply_query_key_layer_scaling = coin(0.25);
  if (c.apply_query_key_layer_scaling) k.layer_number = pick(1, 3);
  if (!mla && coin(0.2)) c.softmax_type = "off-by-one";
  k.training = coin();
  if (k.training && coin()) {
    c.hidden_dropout = 0.25;
    c.attention_dropout = 0.25;
    k.rng = DropoutRng{static_cast<std::uint64_t>(pick(0, 1 << 20)), static_cast<std::uint64_t>(pick(0, 8))};
  }
  k.s = pick(2, 5);
  k.b = pick(1, 2);
  const int h = c.hidden_size, fc1 = c.gated_linear_unit ? 2 * c.ffn() : c.ffn();
  const int qkv = np * hn + 2 * ng * hn;
  auto add = [&](const std::string& key, Shape shape, double scale) { k.params[key] = f64_tensor(g, shape, scale); };
  add("input_layernorm.weight", {h}, 1.0);
  if (c.normalization == "LayerNorm") add("input_layernorm.bias", {h}, 0.1);
  std::string mla_describe;
  if (mla) {
    c.add_qkv_bias = false;
    mla_describe = draw_mla(c, pick, coin, add, np);
  } else {
    add("self_attention.linear_qkv.weight", {qkv, h}, 0.5);
    if (c.add_bias_linear || c.add_qkv_bias) add("self_attention.linear_qkv.bias", {qkv}, 0.1);
    add("self_attention.linear_proj.weight", {h, np * hn}, 0.5);
    if (c.add_bias_linear) add("self_attention.linear_proj.bias", {h}, 0.1);
  }
  if (c.qk_layernorm && !mla) {
    add("self_attention.q_layernorm.weight", {hn}, 1.0);
    add("self_attention.k_layernorm.weight", {hn}, 1.0);
    if (c.normalization == "LayerNorm") {
      add("self_attention.q_layernorm.bias", {hn}, 0.1);
      add("self_attention.k_layernorm.bias", {hn}, 0.1);
    }
  }
  add("pre_mlp_layernorm.weight", {h}, 1.0);
  if (c.normalization == "LayerNorm") add("pre_mlp_layernorm.bias", {h}, 0.1);
  add("mlp.linear_fc1.weight", {fc1, h}, 0.5);
  if (c.add_bias_linear) add("mlp.linear_fc1.bias", {fc1}, 0.1);
  add("mlp.linear_fc2.weight", {h, c.ffn()}, 0.5);
  if (c.add_bias_linear) add("mlp.linear_fc2.bias", {h}, 0.1);
  k.hidden_states = f64_tensor(g, {k.s, k.b, h}, 1.0);
  k.grad_output = f64_tensor(g, {k.s, k.b, h}, 1.0);
  // Mask: the causal default, an explicit random one, or none (padding type without a mask).
  const int mask_kind = pick(0, 2);
  if (mask_kind == 1) {
    std::vector<bool> m(static_cast<std::size_t>(k.b) * k.s * k.s);
    for (std::size_t i = 0; i < m.size(); ++i) m[i] = coin(0.3);
    k.attention_mask = Tensor::from_vector<bool>({k.b, 1, k.s, k.s}, m);
  }
  if (mask_kind == 2) c.attn_mask_type = "padding";
  if (!mla && coin()) {
    c.position_embedding_type = "rope";
    c.rotary_interleaved = coin();
    c.rotary_percent = coin() ? 1.0 : 0.5;
    k.rotary_pos_emb = RotaryEmbedding(hn, c.rotary_percent, c.rotary_interleaved).forward(k.s);
  }
  std::ostringstream d;
  d << "h " << h << " np " << np << " ng " << ng << " hn " << hn << " ffn " << c.ffn() << " s " << k.s << " b " << k.b
    << " " << c.normalization << " " << c.activation_func << (c.gated_linear_unit ? " glu" : "")
    << (c.glu_linear_offset != 0.0 ? " offset" : "") << (c.activation_func_clamp_value ? " clamp" : "")
    << (c.add_bias_linear ? " bias" : "") << (c.add_qkv_bias ? " qkv_bias" : "")
    << (c.qk_layernorm ? " qk_layernorm" : "") << (c.apply_query_key_layer_scaling ? " qk_layer_scaling" : "")
    << " softmax " << c.softmax_type << " mask "
    << (mask_kind == 0   ? "causal"
        : mask_kind == 1 ? "explicit"
                         : "none")
    << (k.rotary_pos_emb ? " rope" : "") << (c.rotary_interleaved ? " interleaved" : "")
    << (k.training ? " training" : "") << (c.hidden_dropout > 0 ? " dropout" : "") << mla_describe;
  k.describe = d.str();
  return k;
}

struct Run {
  double loss = 0.0, magnitude = 0.0;  // sum(out * G), sum |out * G|
  Mat activation_input;                // the MLP activation's input (kink detection)
};

class Harness {
 public:
  explicit Harness(const Case& k)
      : k_(k),
        spec_(get_gpt_layer_local_spec(std::nullopt, k.config.qk_layernorm, k.config.normalization, false,
                                       attn_mask_type_from_name(k.config.attn_mask_type),
                                       k.config.multi_latent_attention)) {
    in_.attention_mask = k_.attention_mask ? &*k_.attention_mask : nullptr;
    in_.rotary_pos_emb = k_.rotary_pos_emb ? &*k_.rotary_pos_emb : nullptr;
  }

  std::unique_ptr<TransformerLayer> layer(const std::map<std::string, Tensor>& params) const {
    auto l = std::make_unique<TransformerLayer>(k_.config, spec_.submodules, k_.layer_number, std::nullopt, exact());
    l->load_state_dict(params);
    l->training = k_.training;
    l->rng = k_.rng;
    return l;
  }

  Run run(const std::map<std::string, Tensor>& params, const Tensor& x) const {
    TransformerLayerSaved saved;
    const Tensor out = layer(params)->forward(x, in_, {}, &saved).first;
    Run r;
    const std::vector<double> o = out.to_f64(), gy = k_.grad_output.to_f64();
    for (std::size_t i = 0; i < o.size(); ++i) {
      r.loss += o[i] * gy[i];
      r.magnitude += std::fabs(o[i] * gy[i]);
    }
    r.activation_input = saved.mlp.activation_input;
    return r;
  }

  TransformerLayerGrads grads() const {
    TransformerLayerSaved saved;
    auto l = layer(k_.params);
    l->forward(k_.hidden_states, in_, {}, &saved);
    return l->backward(k_.grad_output, std::move(saved));
  }

 private:
  const Case& k_;
  ModuleSpec spec_;
  LayerInputs in_;
};

// Which side of each kink every activation input is on (relu at 0; clamp at +-v).
std::vector<int> kink_sides(const TransformerConfig& c, const Mat& a) {
  std::vector<int> sides;
  const bool relu = c.activation_func == "relu" || c.activation_func == "squared_relu";
  const Eigen::Index half = c.gated_linear_unit ? a.cols() / 2 : a.cols();
  for (Eigen::Index r = 0; r < a.rows(); ++r)
    for (Eigen::Index col = 0; col < a.cols(); ++col) {
      const double x = a(r, col);
      if (relu && col < half) sides.push_back(x > 0.0);
      if (c.activation_func_clamp_value) {
        const double v = *c.activation_func_clamp_value;
        sides.push_back((x > v) + 2 * (x < -v));
      }
    }
  return sides;
}

// Compares one coordinate; returns false (with a message) on a mismatch.
::testing::AssertionResult probe(const Case& k, const Harness& hx, const std::string& name, std::int64_t i,
                                 double analytic, twin::test::FdTally& tally) {
  const bool is_input = name == "input.hidden_states";
  const Tensor& base = is_input ? k.hidden_states : k.params.at(name.substr(6));
  auto run = [&](double v) {
    if (is_input) return hx.run(k.params, with_element(base, i, v));
    auto p = k.params;
    p[name.substr(6)] = with_element(base, i, v);
    return hx.run(p, k.hidden_states);
  };
  // A kink between theta - d and theta + d: not differentiable there.
  auto kink = [&](const Run& plus, const Run& minus, const Run&, const Run&) {
    return kink_sides(k.config, plus.activation_input) != kink_sides(k.config, minus.activation_input);
  };
  const double depth = 1e3;  // operations deep of one forward (see the file comment)
  return twin::test::probe_coordinate(
      base.at_f64(i), analytic, run, kink, depth,
      "case " + std::to_string(k.id) + " (" + k.describe + "): d L / d " + name + "[" + std::to_string(i) + "]", k.id,
      tally);
}

void check_central_differences(bool mla) {
  twin::test::FdTally total;
  int cases = 0;
  for (const std::uint64_t id : twin::test::fd_case_ids()) {
    const Case k = make_case(id, mla);
    const Harness hx(k);
    const TransformerLayerGrads grads = hx.grads();
    std::mt19937_64 g(id + 7);
    twin::test::FdTally tally;
    // Every parameter the layer owns has a gradient, and nothing else does.
    std::map<std::string, const ParamGrad*> by_key;
    for (const ParamGrad& p : grads.params) by_key[p.name] = &p;
    ASSERT_EQ(by_key.size(), k.params.size()) << "case " << id << " (" << k.describe << ")";
    std::vector<std::pair<std::string, std::vector<double>>> targets;
    targets.emplace_back("input.hidden_states", grads.hidden_states.to_f64());
    for (const auto& [key, t] : k.params) {
      ASSERT_TRUE(by_key.count(key)) << "case " << id << ": no gradient for " << key;
      const ParamGrad& p = *by_key[key];
      ASSERT_EQ(p.shape, t.shape()) << "case " << id << ": " << key;
      targets.emplace_back("param." + key, p.value.to_f64());
    }
    for (const auto& [name, analytic] : targets) {
      for (const std::int64_t i : twin::test::probe_coords(analytic, g, 3))
        ASSERT_TRUE(probe(k, hx, name, i, analytic[static_cast<std::size_t>(i)], tally));
    }
    EXPECT_GT(tally.compared, 0) << "case " << id << " (" << k.describe << "): every probe was excluded";
    total.compared += tally.compared;
    total.excluded += tally.excluded;
    ++cases;
  }
  std::cout << cases << " cases, " << total.compared << " probes compared, " << total.excluded
            << " excluded at non-smooth points\n";
}

}  // namespace

TEST(TransformerLayerBackward, MatchesCentralDifferencesInExactMode) { check_central_differences(false); }

// The layer with multi-latent attention (MLASelfAttention): the same probes on its parameters.
TEST(TransformerLayerBackward, MultiLatentAttentionMatchesCentralDifferencesInExactMode) {
  check_central_differences(true);
}
