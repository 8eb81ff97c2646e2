// Helpers shared by the MoE reference tests: fixture paths, the fixture's parameters as a
// StateDict, and the MoE fixture files.
#pragma once

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include <random>

#include "core/config.h"
#include "fixtures/fixture.h"
#include "reference/moe/moe_utils.h"
#include "reference/state_dict.h"

namespace twin::reference::moe::testing {

inline std::vector<std::string> moe_fixture_paths() { return golden_files("moe_"); }

inline StateDict fixture_state_dict(const Fixture& f) {
  StateDict sd;
  for (const std::string& name : f.names_with_prefix("param.")) sd.set(name.substr(6), f.tensor(name));
  return sd;
}

// A small MoE config that validates: hidden 8, 2 heads, E experts, top-k, fp32.
inline TransformerConfig small_moe_config(int num_experts, int topk) {
  TransformerConfig c;
  c.num_layers = 1;
  c.hidden_size = 8;
  c.num_attention_heads = 2;
  c.ffn_hidden_size = 16;
  c.hidden_dropout = 0.0;
  c.attention_dropout = 0.0;
  c.add_bias_linear = false;
  c.num_moe_experts = num_experts;
  c.moe_ffn_hidden_size = 6;
  c.moe_router_topk = topk;
  c.moe_router_pre_softmax = topk == 1;
  c.moe_aux_loss_coeff = 0.01;
  c.moe_router_load_balancing_type = "aux_loss";
  return c;
}

// Random N(0, scale^2) matrix from a seeded engine.
inline Mat random_mat(std::mt19937_64& rng, Index rows, Index cols, double scale = 1.0) {
  std::normal_distribution<double> n(0.0, scale);
  Mat m(rows, cols);
  for (Index i = 0; i < m.size(); ++i) m.data()[i] = n(rng);
  return m;
}

inline Tensor f64_tensor(const Mat& m, Shape shape) { return to_tensor(m, DType::F64, std::move(shape)); }

// Every parameter an MoELayer of config `c` loads, random, under "mlp.".
inline StateDict random_moe_state_dict(const TransformerConfig& c, std::mt19937_64& rng) {
  StateDict sd;
  const Index h = c.hidden_size, E = *c.num_moe_experts;
  const Index ffn = c.moe_ffn_hidden_size.value_or(c.ffn());
  const Index glu = c.gated_linear_unit ? 2 : 1;
  sd.set("mlp.router.weight", f64_tensor(random_mat(rng, E, h), {E, h}));
  if (c.add_bias_linear) sd.set("mlp.router.bias", f64_tensor(random_mat(rng, 1, E, 0.1), {E}));
  for (Index e = 0; e < E; ++e) {
    const std::string k = "mlp.experts.local_experts." + std::to_string(e) + ".";
    sd.set(k + "linear_fc1.weight", f64_tensor(random_mat(rng, glu * ffn, h, 0.5), {glu * ffn, h}));
    sd.set(k + "linear_fc2.weight", f64_tensor(random_mat(rng, h, ffn, 0.5), {h, ffn}));
    if (c.add_bias_linear) {
      sd.set(k + "linear_fc1.bias", f64_tensor(random_mat(rng, 1, glu * ffn, 0.1), {glu * ffn}));
      sd.set(k + "linear_fc2.bias", f64_tensor(random_mat(rng, 1, h, 0.1), {h}));
    }
  }
  if (c.moe_shared_expert_intermediate_size) {
    const Index sh = *c.moe_shared_expert_intermediate_size;
    sd.set("mlp.shared_experts.linear_fc1.weight", f64_tensor(random_mat(rng, glu * sh, h, 0.5), {glu * sh, h}));
    sd.set("mlp.shared_experts.linear_fc2.weight", f64_tensor(random_mat(rng, h, sh, 0.5), {h, sh}));
    if (c.moe_shared_expert_gate) sd.set("mlp.shared_experts.gate_weight", f64_tensor(random_mat(rng, 1, h), {1, h}));
  }
  return sd;
}

}  // namespace twin::reference::moe::testing
