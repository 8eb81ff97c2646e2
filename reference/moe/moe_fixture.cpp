// Fixture kind `moe_layer`: a TransformerLayer from get_gpt_layer_local_spec(num_experts=E) (an
// MoETransformerLayer here) run on the file's inputs with its parameters.
//
// Compared: output.hidden_states, EVERY tap.* and tap_in.* tensor (the experts' inputs, recorded
// by MoELayer as mlp.experts.input.*), every aux.* loss (as Megatron logs it: loss / coeff) and
// state.mlp.router.local_tokens_per_expert_after. A file tensor the reference does not produce
// is a failing comparison. Routing maps, token counts and the token counter are compared exactly.
// Not compared: grad.* and grad_in.* (backward; the reference is forward-only).
//
// tie_break_dependent = "true": the kept tokens under the capacity come from torch.topk's
// implementation-defined order among tied values; the recorded post-drop map tap.mlp.router.1 is
// then the ground truth for routing (the router checks it is a valid outcome: same tokens per
// expert, only top-k pairs unless padding to capacity).
//
// Tolerances (|a - e| <= atol + rtol |e|):
//   fp32 files: atol 1e-5, rtol 1e-4 (the cap; both sides store every op in fp32, they
//     differ in reduction order only: measured maxima ~4e-7, see `twin fixture`).
//   bf16/fp16 files: n rounding points to unit roundoff u before a tensor, one of which may differ
//     at each: atol = n u max|e|, rtol = n u (n counted per tap below, from the `rounds:` points).
//     Router probabilities and losses move with the logits' absolute error n u max|logit|:
//     atol = n u (1 + max|logits|).
#include <cmath>
#include <set>
#include <string>
#include <vector>

#include "parity/compare.h"
#include "reference/fixture_handlers.h"
#include "reference/moe/moe_transformer_layer.h"

namespace twin::reference {

namespace {

using moe::Index;

double max_abs(const Tensor& t) {
  double m = 0.0;
  for (double v : t.to_f64()) m = std::max(m, std::abs(v));
  return m;
}

// Rounding points to the activation dtype before each MoE tap (bf16 / fp16 bound).
int rounding_depth(const std::string& name, bool rope, int topk) {
  const int attn_rope = rope ? 3 : 0;
  const int base = 13 + attn_rope;  // pre_mlp_layernorm (dense_layer_fixture.cpp's count)
  auto starts = [&](const char* p) { return name.rfind(p, 0) == 0; };
  if (name == "input_layernorm") return 1;
  if (starts("self_attention.linear_qkv") || starts("self_attention.q_layernorm") || starts("self_attention.k_layernorm"))
    return 5;
  if (starts("self_attention")) return 9 + attn_rope;
  if (name == "pre_mlp_layernorm" || name == "mlp.experts.input.dispatched_input") return base;  // a row copy
  if (name == "mlp.router.logits") return base + 1;
  if (starts("mlp.router") || name == "mlp.experts.input.permuted_probs") return base + 3;  // + fp32 softmax, cast
  if (starts("mlp.shared_experts.linear_fc1")) return base + 1;
  if (starts("mlp.shared_experts.linear_fc2")) return base + 5;
  if (name == "mlp.shared_experts") return base + 8;  // + gate linear, sigmoid, product
  if (name.find("linear_fc1") != std::string::npos) return base + 2;
  // expert: fc1, bias, activation / glu (<= 2), * prob (prob itself base + 3), fc2, bias
  if (starts("mlp.experts")) return base + 10;
  if (name == "mlp.0") return base + 11 + topk;  // + the k scatter-adds, + shared experts
  return base + 13 + topk;                       // output.hidden_states: + bda
}

Tolerance tolerance_for(const std::string& name, const Tensor& expected, const TransformerConfig& cfg,
                        double max_logit) {
  if (expected.dtype() == DType::F32 || expected.dtype() == DType::F64)
    return {1e-5, 1e-4, "fp32 golden: per-op fp32 rounding on both sides, reductions differ only in accumulation "
                        "order; the issue's cap 1e-5 + 1e-4 |e|"};
  const double u = unit_roundoff(expected.dtype());
  const int n = rounding_depth(name, cfg.position_embedding_type == "rope", cfg.moe_router_topk);
  const bool router = name.rfind("mlp.router", 0) == 0 || name == "mlp.experts.input.permuted_probs";
  const double atol = router && name != "mlp.router.logits" ? n * u * (1.0 + max_logit) : n * u * max_abs(expected);
  return {atol, n * u,
          std::string(dtype_name(expected.dtype())) + " golden: " + std::to_string(n) +
              " rounding points to u = " + std::to_string(u) + " before this tensor"};
}

Comparison missing(const std::string& name, const Shape& shape, const std::string& why) {
  Comparison c;
  c.name = name;
  c.shape = shape;
  c.pass = false;
  c.message = why;
  return c;
}

bool exact_kind(const Tensor& t) { return t.dtype() == DType::BOOL || t.dtype() == DType::I64 || t.dtype() == DType::I32; }

// Fixture name of a recorded tap: tap.<name>, or tap_in.mlp.experts.<x> for mlp.experts.input.<x>.
std::string fixture_key(const std::string& name) {
  const std::string in = "mlp.experts.input.";
  if (name.rfind(in, 0) == 0) return "tap_in.mlp.experts." + name.substr(in.size());
  return "tap." + name;
}

}  // namespace

std::vector<Comparison> run_moe_layer_fixture(const Fixture& f) {
  const TransformerConfig& cfg = f.config;
  if (!cfg.num_moe_experts) throw FixtureError(f.path + ": kind moe_layer but config.num_moe_experts is None");
  const Precision precision = Precision::from_config(cfg, ComputeMode::FP32);

  static const std::set<std::string> known_inputs = {"input.hidden_states", "input.attention_mask",
                                                     "input.rotary_pos_emb", "input.padding_mask"};
  for (const auto& n : f.names_with_prefix("input."))
    if (!known_inputs.count(n)) throw FixtureError(f.path + ": unexpected input tensor " + n + " for kind moe_layer");

  const ModuleSpec spec = moe::get_gpt_layer_local_moe_spec(*cfg.num_moe_experts, cfg.moe_grouped_gemm, cfg.qk_layernorm,
                                                            cfg.normalization, cfg.qk_l2_norm);
  moe::MoETransformerLayer layer(cfg, spec.submodules, f.layer_number, std::nullopt, precision);
  layer.training = f.training;

  StateDict sd;
  for (const auto& n : f.names_with_prefix("param.")) sd.set(n.substr(6), f.tensor(n));
  layer.load_state_dict(sd);

  moe::TopKRouter& router = layer.moe_layer().router;
  const std::string tie = f.meta("tie_break_dependent", "false");
  if (tie != "true" && tie != "false")
    throw FixtureError(f.path + ": __metadata__.tie_break_dependent must be \"true\" or \"false\", got \"" + tie + "\"");
  if (tie == "true") {
    const Tensor& rec = f.tensor("tap.mlp.router.1");
    if (rec.dim() != 2) throw FixtureError(f.path + ": tap.mlp.router.1 must be [T, E], got " + rec.describe());
    router.recorded_routing_map = moe::to_bool_mat(rec, rec.size(0), rec.size(1));
  }

  LayerInputs in;
  if (f.has("input.attention_mask")) in.attention_mask = &f.tensor("input.attention_mask");
  if (f.has("input.rotary_pos_emb")) in.rotary_pos_emb = &f.tensor("input.rotary_pos_emb");
  if (f.has("input.padding_mask")) in.padding_mask = &f.tensor("input.padding_mask");
  if (cfg.position_embedding_type == "rope" && !in.rotary_pos_emb)
    throw FixtureError(f.path + ": position_embedding_type is rope but input.rotary_pos_emb is missing");

  TapRecord record;
  auto [output, context] = layer.forward(f.tensor("input.hidden_states"), in, Taps(&record));
  const double max_logit = f.has("tap.mlp.router.logits") ? max_abs(f.tensor("tap.mlp.router.logits")) : 0.0;

  std::vector<Comparison> out;
  std::set<std::string> compared;
  for (const auto& [name, actual] : record.tensors) {  // computation order
    const std::string key = fixture_key(name);
    if (!f.has(key)) continue;  // a submodule the hooks did not capture
    const Tensor& expected = f.tensor(key);
    out.push_back(exact_kind(expected) ? compare_exact(key, actual, expected)
                                       : compare(key, actual, expected, tolerance_for(name, expected, cfg, max_logit)));
    compared.insert(key);
  }
  const Tensor& expected_out = f.tensor("output.hidden_states");
  out.push_back(compare("output.hidden_states", output, expected_out,
                        tolerance_for("output.hidden_states", expected_out, cfg, max_logit)));
  compared.insert("output.hidden_states");

  // aux.<name>: the losses as Megatron logs them (loss / coeff).
  const moe::AuxLosses& aux = layer.moe_layer().aux_losses;
  for (const auto& key : f.names_with_prefix("aux.")) {
    const std::string loss = key.substr(4);
    const Tensor& expected = f.tensor(key);
    auto it = aux.find(loss);
    if (it == aux.end()) {
      out.push_back(missing(key, expected.shape(), "the reference logged no loss named " + loss));
    } else {
      Tolerance tol = tolerance_for("mlp.router.0", expected, cfg, max_logit);
      out.push_back(compare(key, Tensor::from_doubles(DType::F64, expected.shape(), {it->second}), expected, tol));
    }
    compared.insert(key);
  }
  for (const auto& [loss, value] : aux)
    if (!f.has("aux." + loss))
      out.push_back(missing("aux." + loss, {}, "the reference logged this loss (" + std::to_string(value) +
                                                   ") but the file has none"));

  // The expert-bias token counter after the forward.
  const std::string counter = "state.mlp.router.local_tokens_per_expert_after";
  if (f.has(counter)) {
    const Tensor& expected = f.tensor(counter);
    out.push_back(compare_exact(counter, Tensor::from_doubles(DType::F64, {static_cast<Index>(router.local_tokens_per_expert.size())},
                                                              router.local_tokens_per_expert),
                                expected));
    compared.insert(counter);
  }

  for (const auto& prefix : {"tap.", "tap_in.", "output.", "state."})
    for (const auto& key : f.names_with_prefix(prefix))
      if (!compared.count(key))
        out.push_back(missing(key, f.tensor(key).shape(), "the reference produces no tensor for this name"));
  return out;
}

}  // namespace twin::reference
