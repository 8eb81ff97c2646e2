#include "reference/moe/shared_experts.h"

#include <cmath>

namespace twin::reference::moe {

namespace {
TransformerConfig shared_config(const TransformerConfig& config) {
  if (config.add_bias_linear)
    throw MoEError(
        "bias is not supported in the shared experts, please set add_bias_linear=False "
        "(moe_shared_expert_intermediate_size is set)");
  if (!config.moe_shared_expert_intermediate_size)
    throw MoEError("SharedExpertMLP: moe_shared_expert_intermediate_size is not set");
  return config;
}
}  // namespace

SharedExpertMLP::SharedExpertMLP(const TransformerConfig& config, Precision p, bool gate)
    : mlp(shared_config(config), p, std::nullopt, *config.moe_shared_expert_intermediate_size),
      use_shared_expert_gate(gate),
      p_(p) {}

void SharedExpertMLP::load_state_dict(const StateDict& sd, const std::string& prefix) {
  mlp.load_state_dict(sd, prefix);
  if (use_shared_expert_gate) gate_weight = sd.matrix(prefix + "gate_weight", 1, mlp.linear_fc1.input_size()).row(0);
}

Mat SharedExpertMLP::forward(const Mat& hidden_states, const Shape& lead, const Taps& taps) const {
  MlpArgs args;
  args.lead = lead;
  Mat output = mlp.forward_inner(hidden_states, args, taps).output;  // [n, h]
  if (use_shared_expert_gate) {
    for (Index t = 0; t < output.rows(); ++t) {
      const double logits = p_.act(hidden_states.row(t).dot(gate_weight));  // rounds: linear(x, gate_weight)
      const double gate_score = p_.act(1.0 / (1.0 + std::exp(-logits)));    // rounds: sigmoid
      for (Index j = 0; j < output.cols(); ++j) output(t, j) = p_.act(output(t, j) * gate_score);  // rounds: product
    }
    p_.count_act();  // the product (the gate is a shorter branch from hidden_states)
  }
  return output;
}

}  // namespace twin::reference::moe
