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

Mat SharedExpertMLP::forward(const Mat& hidden_states, const Shape& lead, const Taps& taps,
                             SharedExpertSaved* saved) const {
  MlpArgs args;
  args.lead = lead;
  Mat output = mlp.forward_inner(hidden_states, args, taps, saved ? &saved->mlp : nullptr).output;  // [n, h]
  if (saved) {
    saved->hidden_states = hidden_states;
    saved->mlp_output = output;
    saved->gate_score.clear();
  }
  if (use_shared_expert_gate) {
    for (Index t = 0; t < output.rows(); ++t) {
      const double logits = p_.act(hidden_states.row(t).dot(gate_weight));  // rounds: linear(x, gate_weight)
      const double gate_score = p_.act(1.0 / (1.0 + std::exp(-logits)));    // rounds: sigmoid
      if (saved) saved->gate_score.push_back(gate_score);
      for (Index j = 0; j < output.cols(); ++j) output(t, j) = p_.act(output(t, j) * gate_score);  // rounds: product
    }
    p_.count_act();  // the product (the gate is a shorter branch from hidden_states)
  }
  return output;
}

MlpGrads SharedExpertMLP::backward(const Mat& doutput, SharedExpertSaved&& saved) const {
  if (saved.mlp_output.rows() != doutput.rows() || saved.mlp_output.cols() != doutput.cols())
    throw ShapeError("SharedExpertMLP backward: grad_output is [" + std::to_string(doutput.rows()) + ", " +
                     std::to_string(doutput.cols()) + "], the saved output [" +
                     std::to_string(saved.mlp_output.rows()) + ", " + std::to_string(saved.mlp_output.cols()) + "]");
  MlpArgs args;
  args.lead = {doutput.rows()};
  if (!use_shared_expert_gate) return mlp.backward(doutput, std::move(saved.mlp), args);
  const Index n = doutput.rows();
  Mat dmlp(n, doutput.cols());  // [n, h]
  Eigen::VectorXd dlogits(n);   // [n]
  for (Index t = 0; t < n; ++t) {
    const double s = saved.gate_score[t];
    double dscore = 0.0;
    for (Index j = 0; j < doutput.cols(); ++j) {
      dscore += doutput(t, j) * saved.mlp_output(t, j);
      dmlp(t, j) = p_.act(doutput(t, j) * s);  // rounds: grad * gate_score
    }
    dscore = p_.act(dscore);                      // rounds: (grad * output).sum(-1) (the broadcast's reduction)
    dlogits[t] = p_.act(dscore * s * (1.0 - s));  // rounds: sigmoid_backward
  }
  p_.count_act();  // grad * gate_score, the MLP's branch
  const RoundingCount mlp_branch_start = rounding_now();
  p_.count_reduce(doutput.cols());
  p_.count_act(2);
  const RoundingCount gate_branch = rounding_now();
  rounding_set(mlp_branch_start);
  MlpGrads g = mlp.backward(dmlp, std::move(saved.mlp), args);
  rounding_join(gate_branch);
  // linear(x, gate_weight)'s backward: d x = d logits gate_weight, d gate_weight = d logits^T x.
  const Mat dgate = (dlogits.transpose() * saved.hidden_states);  // [1, h]
  for (Index t = 0; t < n; ++t)
    for (Index j = 0; j < g.hidden_states.cols(); ++j)
      g.hidden_states(t, j) = p_.act(g.hidden_states(t, j) + p_.act(dlogits[t] * gate_weight[j]));  // rounds: d x, sum
  const double gate_weight_magnitude = (dlogits.cwiseAbs().transpose() * saved.hidden_states.cwiseAbs()).maxCoeff();
  p_.count_act(2);
  g.params.push_back({"gate_weight", p_.act(dgate), {1, dgate.cols()}, gate_weight_magnitude});  // rounds: wgrad
  p_.count_reduce(n);
  return g;
}

}  // namespace twin::reference::moe
