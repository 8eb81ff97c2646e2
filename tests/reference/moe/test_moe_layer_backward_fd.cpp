// The reference's MoETransformerLayer backward against central finite differences of its own
// forward, both in fp64 exact mode (the dense layer's test, tests/reference/test_layer_backward_fd.cpp,
// with an MoELayer in the mlp slot).
//
// Each case is a config, parameters and inputs drawn from one seed, its case id: a failure names
// it, and TWIN_FD_CASE=<id> reruns just that case (TWIN_FD_CASES=<n> runs ids 0 .. n-1; 100 by
// default, which CI runs). The configs cover the router (softmax before / after the top-k,
// sigmoid with its renormalisation, group-limited top-k, the scaling factor, expert bias, the
// router dtype), the losses (aux_loss, seq_aux_loss, global_aux_loss with their coefficients,
// z-loss), token dropping (probs / position, padding to capacity), a padding mask, both
// dispatchers and shared experts with and without their gate. Per case, the loss is
// L = sum(output * G) plus what the autoscaler attaches (every MoE loss, with gradient 1.0), whose
// gradient backward(G) returns; probes compare it with central differences
//   D(d) = (L(theta + d e_i) - L(theta - d e_i)) / (2 d)
// on the input hidden_states and on every parameter (the coordinate with the largest analytic
// gradient and random ones).
//
// The MoE losses are part of L: Megatron logs them as loss / coeff (aux_losses), so the forward's
// L adds coeff * each logged value.
//
// Tolerance (derived, not tuned), as the dense test: |analytic - D(d/2)| <= |D(d) - D(d/2)|
// (three times Richardson's truncation estimate) + k u64 (M / d + |analytic|) for a forward
// k = 10^3 operations deep, M = sum |output * G| + |losses|.
//
// Non-smooth points: the routing is piecewise constant in the parameters; where a top-k tie, a
// capacity boundary or the load-balancing loss's own top-k (its token counts) changes between
// theta - d and theta + d, L jumps. A probe whose four perturbed forwards do not all keep the
// unperturbed routing (the top-k choice, the post-drop routing map and the loss gradient's token
// counts) is excluded and counted, never compared.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <iostream>
#include <limits>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "tests/reference/fd_check.h"
#include "reference/moe/moe_transformer_layer.h"

using namespace twin;
using namespace twin::reference;
using namespace twin::reference::moe;

namespace {

struct Case {
  std::uint64_t id = 0;
  TransformerConfig config;
  int s = 0, b = 0;
  std::map<std::string, Tensor> params;
  Tensor hidden_states, grad_output;
  std::optional<Tensor> padding_mask;
  std::string describe;
};

using twin::test::f64_tensor;
using twin::test::with_element;

Case make_case(std::uint64_t id) {
  std::mt19937_64 g(id * 0x9E3779B97F4A7C15ull + 3);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(g); };
  auto coin = [&](double p = 0.5) { return std::bernoulli_distribution(p)(g); };
  Case k;
  k.id = id;
  TransformerConfig& c = k.config;
  c.num_layers = 1;
  c.hidden_size = 8;
  c.num_attention_heads = 2;
  c.num_query_groups = 2;
  c.kv_channels = 4;
  c.ffn_hidden_size = 8;
  c.hidden_dropout = 0.0;
  c.attention_dropout = 0.0;
  c.add_bias_linear = false;
  c.normalization = coin() ? "LayerNorm" : "RMSNorm";
  c.gated_linear_unit = coin();
  c.activation_func = coin() ? "gelu" : "silu";  // smooth: the dense test covers the kinks
  const int E = pick(2, 4);
  c.num_moe_experts = E;
  c.moe_ffn_hidden_size = pick(2, 5);
  c.moe_router_topk = pick(1, std::min(E, 3));
  const int topk = c.moe_router_topk;
  c.moe_router_score_function = coin(0.3) ? "sigmoid" : "softmax";
  c.moe_router_pre_softmax = topk == 1 || coin();
  if (c.moe_router_score_function == "sigmoid" && coin()) c.moe_router_enable_expert_bias = true;
  if (E == 4 && coin(0.3)) {
    c.moe_router_num_groups = 2;
    c.moe_router_group_topk = topk <= 2 ? pick(1, 2) : 2;
  }
  if (coin(0.3)) c.moe_router_topk_scaling_factor = 1.5;
  const int dt = pick(0, 2);
  if (dt == 1) c.moe_router_dtype = "fp32";
  if (dt == 2) c.moe_router_dtype = "fp64";
  c.moe_token_dispatcher_type = coin() ? "allgather" : "alltoall";
  static const char* lbs[] = {"aux_loss", "seq_aux_loss", "global_aux_loss", "none", "sinkhorn"};
  c.moe_router_load_balancing_type = lbs[pick(0, 4)];
  const bool sinkhorn = c.moe_router_load_balancing_type == std::string("sinkhorn");
  // large enough that a wrong loss gradient shows; sinkhorn has no aux loss (Megatron asserts it)
  c.moe_aux_loss_coeff = sinkhorn ? 0.0 : coin() ? 0.1 : 1.0;
  if (coin(0.4)) c.moe_z_loss_coeff = 0.1;
  k.s = pick(2, 4);
  k.b = pick(1, 2);
  const int T = k.s * k.b;
  if (!sinkhorn && coin(0.35)) {  // a capacity needs a loss-based balancing
    c.moe_expert_capacity_factor = coin() ? 1.0 : 1.5;
    c.moe_token_drop_policy = coin() ? "probs" : "position";
    // Padding to capacity needs a capacity within the tokens (alltoall's permute).
    const double cap = std::ceil(static_cast<double>(T) * topk / E * *c.moe_expert_capacity_factor);
    c.moe_pad_expert_input_to_capacity = cap <= T && coin(0.4);
  }
  if (coin(0.4)) {
    c.moe_shared_expert_intermediate_size = pick(2, 6);
    c.moe_shared_expert_gate = coin();
  }
  const int h = c.hidden_size, hn = 4, np = c.num_attention_heads, ng = 2;  // kv_channels, num_query_groups above
  auto add = [&](const std::string& key, Shape shape, double scale) { k.params[key] = f64_tensor(g, shape, scale); };
  add("input_layernorm.weight", {h}, 1.0);
  if (c.normalization == "LayerNorm") add("input_layernorm.bias", {h}, 0.1);
  add("self_attention.linear_qkv.weight", {np * hn + 2 * ng * hn, h}, 0.5);
  add("self_attention.linear_proj.weight", {h, np * hn}, 0.5);
  add("pre_mlp_layernorm.weight", {h}, 1.0);
  if (c.normalization == "LayerNorm") add("pre_mlp_layernorm.bias", {h}, 0.1);
  const int glu = c.gated_linear_unit ? 2 : 1, ffn = *c.moe_ffn_hidden_size;
  add("mlp.router.weight", {E, h}, 1.0);
  if (c.moe_router_enable_expert_bias) add("mlp.router.expert_bias", {E}, 0.1);
  for (int e = 0; e < E; ++e) {
    const std::string p = "mlp.experts.local_experts." + std::to_string(e) + ".";
    add(p + "linear_fc1.weight", {glu * ffn, h}, 0.5);
    add(p + "linear_fc2.weight", {h, ffn}, 0.5);
  }
  if (c.moe_shared_expert_intermediate_size) {
    const int sh = *c.moe_shared_expert_intermediate_size;
    add("mlp.shared_experts.linear_fc1.weight", {glu * sh, h}, 0.5);
    add("mlp.shared_experts.linear_fc2.weight", {h, sh}, 0.5);
    if (c.moe_shared_expert_gate) add("mlp.shared_experts.gate_weight", {1, h}, 0.5);
  }
  k.hidden_states = f64_tensor(g, {k.s, k.b, h}, 1.0);
  k.grad_output = f64_tensor(g, {k.s, k.b, h}, 1.0);
  if (coin(0.3)) {
    std::vector<bool> m(static_cast<std::size_t>(k.b * k.s));
    for (std::size_t i = 1; i < m.size(); ++i) m[i] = coin(0.3);  // token 0 stays valid
    k.padding_mask = Tensor::from_vector<bool>({k.b, k.s}, m);
  }
  std::ostringstream d;
  d << "s " << k.s << " b " << k.b << " E " << E << " k " << topk << " " << c.moe_router_score_function
    << (c.moe_router_pre_softmax ? " pre_softmax" : "") << (c.moe_router_enable_expert_bias ? " expert_bias" : "")
    << (c.moe_router_num_groups ? " groups " + std::to_string(*c.moe_router_group_topk) + "/2" : "")
    << (c.moe_router_topk_scaling_factor ? " scale 1.5" : "") << " router_dtype " << c.moe_router_dtype.value_or("none")
    << " " << c.moe_token_dispatcher_type << " " << c.moe_router_load_balancing_type << " coeff "
    << c.moe_aux_loss_coeff << (c.moe_z_loss_coeff ? " z_loss" : "");
  if (c.moe_expert_capacity_factor)
    d << " capacity " << *c.moe_expert_capacity_factor << " " << c.moe_token_drop_policy
      << (c.moe_pad_expert_input_to_capacity ? " pad" : "");
  if (c.moe_shared_expert_intermediate_size) d << " shared" << (c.moe_shared_expert_gate ? " gate" : "");
  d << " " << c.normalization << " " << c.activation_func << (c.gated_linear_unit ? " glu" : "")
    << (k.padding_mask ? " padding_mask" : "");
  k.describe = d.str();
  return k;
}

struct FwdRun {
  double loss = 0.0, magnitude = 0.0;  // sum(out * G) + the losses, sum |out * G| + |losses|
  BoolMat selected, routing_map;       // the router's choice before and after dropping
  Mat aux_scores_grad;                 // the load-balancing losses' token counts (times constants)
};

class Harness {
 public:
  explicit Harness(const Case& k)
      : k_(k), spec_(get_gpt_layer_local_moe_spec(*k.config.num_moe_experts, false, false, k.config.normalization)) {
    in_.padding_mask = k_.padding_mask ? &*k_.padding_mask : nullptr;
  }

  std::unique_ptr<MoETransformerLayer> layer(const std::map<std::string, Tensor>& params) const {
    auto l = std::make_unique<MoETransformerLayer>(k_.config, spec_.submodules, 1, std::nullopt,
                                                   Precision{ComputeMode::Exact, DType::F32});
    l->load_state_dict(params);
    l->training = true;  // the losses need training
    return l;
  }

  FwdRun run(const std::map<std::string, Tensor>& params, const Tensor& x) const {
    TransformerLayerSaved saved;
    auto l = layer(params);
    const Tensor out = l->forward(x, in_, {}, &saved).first;
    FwdRun r;
    const std::vector<double> o = out.to_f64(), gy = k_.grad_output.to_f64();
    for (std::size_t i = 0; i < o.size(); ++i) {
      r.loss += o[i] * gy[i];
      r.magnitude += std::fabs(o[i] * gy[i]);
    }
    // The autoscaler's losses: logged as loss / coeff.
    const TransformerConfig& c = k_.config;
    for (const auto& [name, v] : l->moe_layer().aux_losses) {
      const double coeff = name == "z_loss" ? *c.moe_z_loss_coeff : c.moe_aux_loss_coeff;
      r.loss += v * coeff;
      r.magnitude += std::fabs(v * coeff);
    }
    const auto& moe = dynamic_cast<const MoETransformerLayerSaved&>(*saved.mlp_module).moe;
    r.selected = moe.router.selected;
    r.routing_map = moe.router.routing_map;
    if (moe.router.aux_scores_grad) r.aux_scores_grad = *moe.router.aux_scores_grad;
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

bool same_routing(const FwdRun& a, const FwdRun& b) {
  return a.selected == b.selected && a.routing_map == b.routing_map && a.aux_scores_grad == b.aux_scores_grad;
}

::testing::AssertionResult probe(const Case& k, const Harness& hx, const FwdRun& base_run, const std::string& name,
                                 std::int64_t i, double analytic, twin::test::FdTally& tally) {
  const bool is_input = name == "input.hidden_states";
  const Tensor& base = is_input ? k.hidden_states : k.params.at(name.substr(6));
  auto run = [&](double v) {
    if (is_input) return hx.run(k.params, with_element(base, i, v));
    auto p = k.params;
    p[name.substr(6)] = with_element(base, i, v);
    return hx.run(p, k.hidden_states);
  };
  // The routing changes within the step: L is not differentiable there.
  auto rerouted = [&](const FwdRun& a, const FwdRun& b, const FwdRun& c, const FwdRun& e) {
    return !same_routing(a, base_run) || !same_routing(b, base_run) || !same_routing(c, base_run) ||
           !same_routing(e, base_run);
  };
  const double depth = 1e3;  // operations deep of one forward (see the file comment)
  return twin::test::probe_coordinate(
      base.at_f64(i), analytic, run, rerouted, depth,
      "case " + std::to_string(k.id) + " (" + k.describe + "): d L / d " + name + "[" + std::to_string(i) + "]", k.id,
      tally);
}

}  // namespace

TEST(MoETransformerLayerBackward, MatchesCentralDifferencesInExactMode) {
  twin::test::FdTally total;
  int cases = 0;
  for (const std::uint64_t id : twin::test::fd_case_ids()) {
    const Case k = make_case(id);
    const Harness hx(k);
    const TransformerLayerGrads grads = hx.grads();
    const FwdRun base_run = hx.run(k.params, k.hidden_states);
    if (k.config.moe_router_topk < *k.config.num_moe_experts) {
      // The exclusion can see a routing change: the negated router weight chooses other experts.
      auto negated = k.params;
      std::vector<double> w = negated.at("mlp.router.weight").to_f64();
      for (double& x : w) x = -x;
      negated["mlp.router.weight"] = Tensor::from_doubles(DType::F64, negated.at("mlp.router.weight").shape(), w);
      EXPECT_FALSE(same_routing(hx.run(negated, k.hidden_states), base_run))
          << "case " << id << " (" << k.describe << ")";
    }
    std::mt19937_64 g(id + 11);
    twin::test::FdTally tally;
    // Every parameter has a gradient (the expert bias is a buffer: none), and nothing else does.
    std::map<std::string, const ParamGrad*> by_key;
    for (const ParamGrad& p : grads.params) by_key[p.name] = &p;
    const std::size_t buffers = k.params.count("mlp.router.expert_bias");
    ASSERT_EQ(by_key.size() + buffers, k.params.size()) << "case " << id << " (" << k.describe << ")";
    std::vector<std::pair<std::string, std::vector<double>>> targets;
    targets.emplace_back("input.hidden_states", grads.hidden_states.to_f64());
    for (const auto& [key, t] : k.params) {
      if (key == "mlp.router.expert_bias") continue;
      ASSERT_TRUE(by_key.count(key)) << "case " << id << ": no gradient for " << key;
      const ParamGrad& p = *by_key[key];
      ASSERT_EQ(p.shape, t.shape()) << "case " << id << ": " << key;
      targets.emplace_back("param." + key, p.value.to_f64());
    }
    for (const auto& [name, analytic] : targets) {
      // The router and the input, whose gradients carry every routing and loss term, get more probes.
      const bool router = name == "param.mlp.router.weight" || name == "input.hidden_states";
      for (const std::int64_t i : twin::test::probe_coords(analytic, g, router ? 4 : 1))
        ASSERT_TRUE(probe(k, hx, base_run, name, i, analytic[static_cast<std::size_t>(i)], tally));
    }
    EXPECT_GT(tally.compared, 0) << "case " << id << " (" << k.describe << "): every probe was excluded";
    total.compared += tally.compared;
    total.excluded += tally.excluded;
    ++cases;
  }
  std::cout << cases << " cases, " << total.compared << " probes compared, " << total.excluded
            << " excluded where the routing changes within the step\n";
}

// A config whose backward the reference lacks is named, and forward with `saved` refuses it before
// computing anything (the fixture handler then reports the gradients as not compared, with it).
TEST(MoETransformerLayerBackward, UnsupportedConfigsAreNamed) {
  const Case base = make_case(0);
  auto why = [&](auto edit) {
    TransformerConfig c = base.config;
    edit(c);
    const ModuleSpec spec = get_gpt_layer_local_moe_spec(*c.num_moe_experts, false, false, c.normalization);
    MoETransformerLayer layer(c, spec.submodules, 1, std::nullopt, Precision{ComputeMode::Exact, DType::F32});
    const auto reason = layer.backward_unsupported();
    TransformerLayerSaved saved;
    EXPECT_THROW(layer.forward(base.hidden_states, {}, {}, &saved), std::logic_error);
    return reason.value_or("(supported)");
  };
  EXPECT_EQ(why([](TransformerConfig& c) { c.moe_input_jitter_eps = 0.01; }),
            "moe_input_jitter_eps (the jitter's backward)");
  EXPECT_EQ(why([](TransformerConfig& c) { c.calculate_per_token_loss = true; }),
            "calculate_per_token_loss (the losses scaled by the token count)");
  const Harness hx(base);
  EXPECT_EQ(hx.layer(base.params)->backward_unsupported(), std::nullopt);
}
