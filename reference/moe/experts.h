// SequentialMLP, mirroring megatron/core/transformer/moe/experts.py (Megatron-LM 93ddc24): one
// MLP per local expert (the dense reference/mlp.h MLP with ffn_hidden_size = moe_ffn_hidden_size),
// each run on its contiguous slice of the expert-major dispatched tokens.
//
// An expert is MLP.forward(tokens, per_token_scale=probs) (reference/mlp.h MlpArgs::per_token_scale):
// the routing probability multiplies the ACTIVATION (before linear_fc2), stored back in the
// activation dtype; an fc2 bias is added scaled by the probability too (output += bias * prob), so
// the experts return no bias.
// moe_apply_probs_on_input (top-1 only) scales the input instead and then uses probability 1.
//
// Taps (under "mlp.experts."): local_experts.<i>.linear_fc1.0 / .1, local_experts.<i>.linear_fc2.0,
// local_experts.<i>.0 (each expert's output, also for an expert without tokens: [0, h]), then
// "0" (all outputs, concatenated expert-major).
//
// Backward: each expert's MLP backward (reference/mlp.h, with per_token_scale) on its slice of
// the outputs' gradient, giving the gradient of its input rows, of its rows' probabilities and of
// its parameters. moe_apply_probs_on_input has no backward here (MoEError).
#pragma once

#include <vector>

#include "core/config.h"
#include "reference/mlp.h"
#include "reference/moe/moe_utils.h"
#include "reference/taps.h"

namespace twin::reference::moe {

// What SequentialMLP's backward needs from its forward.
struct SequentialMLPSaved {
  std::vector<MlpSaved> local_experts;   // one per local expert
  std::vector<Index> tokens_per_expert;  // [local E]
  std::vector<double> permuted_probs;    // [N]
};

struct SequentialMLPGrads {
  Mat permuted_local_hidden_states;    // [N, h]
  std::vector<double> permuted_probs;  // [N], in the probabilities' dtype
  ParamGrads params;                   // "local_experts.<i>.linear_fc1.weight", ...
};

class SequentialMLP {
 public:
  // probs_dtype: the dtype of the routing probabilities (the router dtype).
  SequentialMLP(int num_local_experts, const TransformerConfig& config, Precision p, DType probs_dtype);

  // permuted_local_hidden_states [N, h] expert-major, tokens_per_expert [local E] summing to N,
  // permuted_probs [N]. Returns the outputs [N, h] (the bias is None: added inside).
  Mat forward(const Mat& permuted_local_hidden_states, const std::vector<Index>& tokens_per_expert,
              const std::vector<double>& permuted_probs, const Taps& taps, SequentialMLPSaved* saved = nullptr) const;
  // doutput [N, h]: the gradient of forward's output.
  SequentialMLPGrads backward(const Mat& doutput, SequentialMLPSaved&& saved) const;  // consumes saved

  // local_experts.<i>.linear_fc1.weight ... under `prefix` ("mlp.experts.").
  void load_state_dict(const StateDict& sd, const std::string& prefix);

  std::vector<MLP> local_experts;

 private:
  TransformerConfig config_;
  Precision p_;
  DType probs_dtype_;
};

}  // namespace twin::reference::moe
