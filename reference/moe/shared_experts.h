// SharedExpertMLP, mirroring megatron/core/transformer/moe/shared_experts.py (Megatron-LM
// 93ddc24): an MLP with ffn_hidden_size = moe_shared_expert_intermediate_size that sees every
// token, optionally scaled by a sigmoid gate:
//   output, _ = MLP.forward(hidden_states)
//   if use_shared_expert_gate: output = output * sigmoid(linear(hidden_states, gate_weight))
// Megatron asserts add_bias_linear == False for shared experts (MoEError here).
// Taps (under "mlp.shared_experts."): linear_fc1.0, linear_fc2.0; the caller records the module's
// own output as "mlp.shared_experts" (a tensor, not a tuple).
//
// Backward: with the gate, d output = d (output * gate_score) -> (d * gate_score) into the MLP's
// backward, d gate_score = sum_j d * output, d logits = d gate_score * s (1 - s) (sigmoid's
// backward), d hidden_states += d logits gate_weight, d gate_weight = sum_t d logits hidden_states.
#pragma once

#include <optional>

#include "core/config.h"
#include "reference/mlp.h"
#include "reference/moe/moe_utils.h"

namespace twin::reference::moe {

struct SharedExpertSaved {
  MlpSaved mlp;
  Mat hidden_states;               // [n, h] the input (the gate's)
  Mat mlp_output;                  // [n, h] the MLP's output before the gate
  std::vector<double> gate_score;  // [n] sigmoid(linear(hidden_states, gate_weight))
};

class SharedExpertMLP {
 public:
  SharedExpertMLP(const TransformerConfig& config, Precision p, bool gate);

  Mat forward(const Mat& hidden_states, const Shape& lead, const Taps& taps,
              SharedExpertSaved* saved = nullptr) const;  // [n, h] -> [n, h]
  // doutput [n, h]: the gradient of forward's output. Params "linear_fc1.weight", ..., "gate_weight".
  MlpGrads backward(const Mat& doutput, SharedExpertSaved&& saved) const;  // consumes saved
  // linear_fc1.weight, linear_fc2.weight (+ gate_weight [1, h]) under `prefix` ("mlp.shared_experts.").
  void load_state_dict(const StateDict& sd, const std::string& prefix);

  MLP mlp;
  bool use_shared_expert_gate;
  RowVec gate_weight;  // [h] (stored [1, h])

 private:
  Precision p_;
};

}  // namespace twin::reference::moe
