// Fixture kind `dense_layer`: a TransformerLayer built from get_gpt_layer_local_spec, run on the
// file's inputs with its parameters; every tap and the output compared.
//
// Compared: output.hidden_states and EVERY tap.* tensor of the file, in the order the layer
// computes them (a file tap the reference does not produce is a failing comparison, not a skip).
// Not compared: grad.* and grad_in.* (backward results; the reference is forward-only).
//
// Tolerances (|a - e| <= atol + rtol |e|), from the numerics:
//   fp32 files: atol 1e-5, rtol 1e-4 (the cap). Both sides round every op's output to fp32
//     (u = 2^-24 ~ 6e-8); they differ only in how a reduction accumulates before that rounding
//     (torch: fp32 blocked sums; here: double), bounded by ~K u |x||w| for K <= 512 terms, i.e.
//     ~3e-5 relative in the worst case, ~sqrt(K) u ~ 1.4e-6 typically, per GEMM; a layer chains
//     ~6 of them. The measured maxima are reported by `twin fixture`.
//   bf16/fp16 files: a value that went through n rounding points to the activation dtype (unit
//     roundoff u) can differ by one rounding at each, each amplified at most ~1 x the tensor's
//     scale by the following op: atol = n u max|e|, rtol = n u, n counted per tap below.
//   Bias taps (".1" of a skip_bias_add linear) are the parameters themselves: compared exactly.
#include <cmath>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "reference/fixture_handlers.h"
#include "reference/transformer_config.h"
#include "reference/transformer_layer.h"

namespace twin::reference {

namespace {

// Rounding points to the activation dtype on the path to each tap of the local-spec layer
// (bf16 tolerance; counted from the Precision's `rounds:` points along the forward).
int rounding_depth(const std::string& name, bool rope) {
  static const std::map<std::string, int> depth = {
      {"input_layernorm", 1},
      {"self_attention.linear_qkv.0", 3},            // + GEMM, + bias
      {"self_attention.q_layernorm", 5},             // + RMSNorm's two stores
      {"self_attention.k_layernorm", 5},
      {"self_attention.core_attention", 8},          // + scores, probs cast, bmm
      {"self_attention.linear_proj.0", 9},
      {"self_attention.0", 9},
      {"pre_mlp_layernorm", 13},                     // + bias add, residual add, norm (+ residual cast)
      {"mlp.linear_fc1.0", 14},
      {"mlp.linear_fc2.0", 18},                      // + bias, activation (<= 2), GEMM
      {"mlp.0", 18},
      {"output.hidden_states", 21},                  // + bias add, residual add (+ cast)
  };
  auto it = depth.find(name);
  int n = it == depth.end() ? 21 : it->second;
  const bool after_rope = name.rfind("self_attention.core_attention", 0) == 0 || name.rfind("self_attention.linear_proj", 0) == 0 ||
                          name == "self_attention.0" || name.rfind("mlp", 0) == 0 || name == "pre_mlp_layernorm" ||
                          name == "output.hidden_states";
  if (rope && after_rope) n += 3;  // t * cos, rotate * sin, sum
  return n;
}

Tolerance tolerance_for(const std::string& name, const Tensor& expected, const TransformerConfig& cfg) {
  const bool bias_tap = name.size() > 2 && name.compare(name.size() - 2, 2, ".1") == 0;
  if (bias_tap) return {0.0, 0.0, "a bias parameter returned by skip_bias_add: exact"};
  if (expected.dtype() == DType::F32)
    return {1e-5, 1e-4, "fp32 golden: per-op fp32 rounding on both sides, reductions differ only in accumulation order "
                        "(<= ~K u |x||w| per GEMM, u = 2^-24); the issue's cap 1e-5 + 1e-4 |e|"};
  const double u = unit_roundoff(expected.dtype());
  const int n = rounding_depth(name, cfg.position_embedding_type == "rope");
  double scale = 0.0;
  for (double v : expected.to_f64()) scale = std::max(scale, std::abs(v));
  return {n * u * scale, n * u,
          std::string(dtype_name(expected.dtype())) + " golden: " + std::to_string(n) +
              " rounding points to unit roundoff u = " + std::to_string(u) + " before this tensor; one rounding may "
              "differ at each: atol = n u max|e|, rtol = n u"};
}

Comparison missing(const std::string& name, const Shape& shape, const std::string& why) {
  Comparison c;
  c.name = name;
  c.shape = shape;
  c.pass = false;
  c.message = why;
  return c;
}

}  // namespace

std::vector<Comparison> run_dense_layer_fixture(const Fixture& f) {
  const TransformerConfig& cfg = f.config;
  validate_transformer_config(cfg);
  const Precision precision = Precision::from_config(cfg, ComputeMode::FP32);

  // The inputs this kind has; any other input.* is bad input, not something to ignore.
  static const std::set<std::string> known_inputs = {"input.hidden_states", "input.attention_mask", "input.rotary_pos_emb"};
  for (const auto& n : f.names_with_prefix("input."))
    if (!known_inputs.count(n)) throw FixtureError(f.path + ": unexpected input tensor " + n + " for kind dense_layer");

  const ModuleSpec spec = get_gpt_layer_local_spec(std::nullopt, cfg.qk_layernorm, cfg.normalization, cfg.qk_l2_norm,
                                                   attn_mask_type_from_name(cfg.attn_mask_type));
  TransformerLayer layer(cfg, spec.submodules, f.layer_number, std::nullopt, precision);
  layer.training = f.training;

  StateDict sd;
  for (const auto& n : f.names_with_prefix("param.")) sd.set(n.substr(6), f.tensor(n));
  layer.load_state_dict(sd);

  LayerInputs in;
  if (f.has("input.attention_mask")) in.attention_mask = &f.tensor("input.attention_mask");
  if (f.has("input.rotary_pos_emb")) in.rotary_pos_emb = &f.tensor("input.rotary_pos_emb");
  if (cfg.position_embedding_type == "rope" && !in.rotary_pos_emb)
    throw FixtureError(f.path + ": position_embedding_type is rope but input.rotary_pos_emb is missing");

  TapRecord record;
  auto [output, context] = layer.forward(f.tensor("input.hidden_states"), in, Taps(&record));

  std::vector<Comparison> out;
  std::set<std::string> compared;
  for (const auto& [name, actual] : record.tensors) {  // computation order
    const std::string key = "tap." + name;
    if (!f.has(key)) continue;  // a submodule the hooks did not capture
    const Tensor& expected = f.tensor(key);
    out.push_back(compare(key, actual, expected, tolerance_for(name, expected, cfg)));
    compared.insert(key);
  }
  const Tensor& expected_out = f.tensor("output.hidden_states");
  out.push_back(compare("output.hidden_states", output, expected_out, tolerance_for("output.hidden_states", expected_out, cfg)));
  for (const auto& key : f.names_with_prefix("tap."))
    if (!compared.count(key))
      out.push_back(missing(key, f.tensor(key).shape(), "the reference produces no tensor for this tap"));
  for (const auto& key : f.names_with_prefix("output."))
    if (key != "output.hidden_states")
      out.push_back(missing(key, f.tensor(key).shape(), "the reference produces no such output for dense_layer"));
  return out;
}

}  // namespace twin::reference
