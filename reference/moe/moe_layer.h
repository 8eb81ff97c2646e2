// MoELayer, mirroring megatron/core/transformer/moe/moe_layer.py (Megatron-LM 93ddc24), at one
// expert-parallel rank: TopKRouter, an allgather or alltoall token dispatcher, SequentialMLP
// experts and optional SharedExpertMLP. It fills the layer's `mlp` slot (reference/mlp.h MlpModule).
//
//   forward(hidden_states, padding_mask):            # hidden [s, b, h]; padding_mask [b, s]
//     padding_mask = padding_mask.transpose(0, 1)    # -> [s, b], flattened t = s_idx * b + b_idx
//     shared_expert_output = shared_experts_compute(hidden_states)
//     probs, routing_map = route(hidden_states, padding_mask)
//     hidden_states, probs = preprocess(hidden_states, probs, routing_map)
//     dispatched_input, probs = dispatch(hidden_states, probs)
//     output, mlp_bias = routed_experts_compute(dispatched_input, probs)
//     output = combine(output)
//     output = postprocess(output, shared_expert_output)   # + shared_expert_output
//     return output, mlp_bias                              # mlp_bias is None
//
// Taps (under "mlp."): shared_experts.linear_fc1.0, shared_experts.linear_fc2.0, shared_experts,
// router.logits, router.0 (probs), router.1 (routing_map), the experts' inputs as
// experts.input.dispatched_input / experts.input.tokens_per_expert / experts.input.permuted_probs
// (the fixtures' tap_in.mlp.experts.*), experts.local_experts.<i>.*, experts.0, and "0".
// The losses of the last forward are in aux_losses (name -> loss / coeff, as Megatron logs them).
//
// Backward, from the gradient of the output [s * b, h] (MoELayerSaved from forward(..., &saved)):
//   postprocess:  the gradient reaches the combined experts' output and the shared experts' output
//   combine:      the unpermute's scatter-add (rows -> tokens) has a gather as its backward: each
//                 dispatched row gets its token's gradient
//   experts:      SequentialMLP's backward -> the rows' gradients and their probabilities'
//   dispatch:     the permute's gather (tokens -> rows) has a scatter-add as its backward: each
//                 token sums its rows' gradients (stored in the activation dtype after each add);
//                 each row's probability gradient goes back to its (token, expert) entry of probs
//   router:       TopKRouter's backward (score function, losses, gating GEMM) -> its input's gradient
//   shared experts' backward; the input's gradient is autograd's sum of the three uses.
// At one expert-parallel rank both dispatchers' permutation 2 (the chunk sort by local expert) is
// the identity, so a dispatched row is its permutation-1 row: token and expert follow from the
// dispatcher's reversed_local_input_permutation_mapping and the tokens per expert.
#pragma once

#include <memory>
#include <optional>
#include <vector>

#include "core/config.h"
#include "reference/mlp.h"
#include "reference/moe/experts.h"
#include "reference/moe/router.h"
#include "reference/moe/shared_experts.h"
#include "reference/moe/token_dispatcher.h"

namespace twin::reference::moe {

// The MoE checks the reference adds to validate_transformer_config (reference/transformer_config.h):
// what Megatron cannot run on one rank without Transformer Engine, or runs into nonsense. MoEError.
void validate_moe_layer_config(const TransformerConfig& config);

// MoELayer.forward's padding_mask [b, s] (True = padding) as one flag per token in [s, b] order
// (t = s_idx * b + b_idx). ShapeError naming both shapes when it is not [b, s].
std::vector<bool> padding_mask_tokens(const Tensor& padding_mask, Index seq_length, Index bsz);

// What route + preprocess hand to the expert computation (MoETransformerLayer's router phase).
struct MoERouteOutput {
  DispatchTensors hidden_states_and_probs;  // after dispatch_preprocess
  std::optional<Mat> shared_expert_output;  // [T, h]
  DispatcherState token_dispatcher_attrs;   // the dispatcher's attributes between the phases
};

// What MoELayer's backward needs from its forward.
struct MoELayerSaved {
  Index tokens = 0;  // T = s * b
  RouterSaved router;
  SequentialMLPSaved experts;
  std::optional<SharedExpertSaved> shared_experts;
  std::vector<Index> row_tokens, row_experts;  // [N] each dispatched row's token and expert
};

class MoELayer : public MlpModule {
 public:
  MoELayer(const TransformerConfig& config, Precision p, int layer_number = 1);

  // hidden_states [s * b, h] with args.lead = {s, b} ({n} means s = n, b = 1),
  // args.padding_mask [b, s] or null, args.training. Returns (output [s * b, h], no bias).
  OutputWithBias forward(const Mat& hidden_states, const MlpArgs& args, const Taps& taps) override;
  // The same, keeping what backward needs in `saved` (MoEError when backward_unsupported()).
  OutputWithBias forward(const Mat& hidden_states, const MlpArgs& args, const Taps& taps, MoELayerSaved* saved);
  // doutput [s * b, h]: the gradient of forward's output. Gradients of the input and of every
  // parameter ("router.weight", "experts.local_experts.<i>.linear_fc1.weight", "shared_experts.*").
  MlpGrads backward(const Mat& doutput, MoELayerSaved&& saved) const;  // consumes saved, as MLP::backward
  // Why backward cannot run for this config (nullopt: it can).
  std::optional<std::string> backward_unsupported() const;
  // router.*, experts.local_experts.<i>.*, shared_experts.* under `prefix` ("mlp.").
  void load_state_dict(const StateDict& sd, const std::string& prefix) override;

  // --- the steps of forward, each callable on its own
  std::optional<Mat> shared_experts_compute(const Mat& hidden_states, const Shape& lead, const Taps& taps) const;
  RouterOutput route(const Mat& hidden_states, Index seq_length, Index bsz, const std::vector<bool>* padding_mask,
                     const Taps& taps, const BoolMat* recorded_routing_map = nullptr);
  DispatchTensors preprocess(const Mat& hidden_states, Index seq_length, Index bsz, const Mat& probs,
                             const BoolMat& routing_map);
  DispatchTensors dispatch(DispatchTensors x);
  OutputWithBias routed_experts_compute(DispatchTensors x, const Taps& taps);
  Mat combine(Mat output);
  Mat postprocess(Mat output, const std::optional<Mat>& shared_expert_output);

  // The three groups MoETransformerLayer calls separately ("route", "expert_compute",
  // "postprocess" of fwd_execution_map); forward() is their composition.
  MoERouteOutput forward_route(const Mat& hidden_states, const MlpArgs& args, const Taps& taps);
  OutputWithBias forward_expert_compute(const DispatchTensors& hidden_states_and_probs,
                                        const DispatcherState& token_dispatcher_attrs, const Taps& taps);
  Mat forward_postprocess(const Mat& output, const std::optional<Mat>& shared_expert_output, const Taps& taps);

  TopKRouter router;
  std::unique_ptr<MoETokenDispatcher> token_dispatcher;
  SequentialMLP experts;
  std::optional<SharedExpertMLP> shared_experts;
  AuxLosses aux_losses;  // of the last forward_route

 private:
  TransformerConfig config_;
  Precision p_;
  int layer_number_;
  MoELayerSaved* saving_ = nullptr;  // set while forward(..., saved) runs
};

}  // namespace twin::reference::moe
