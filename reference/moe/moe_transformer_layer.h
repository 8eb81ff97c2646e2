// MoETransformerLayer, mirroring MoETransformerLayer in megatron/core/transformer/transformer_layer.py
// (Megatron-LM 93ddc24): the dense TransformerLayer (reference/transformer_layer.h) whose `mlp`
// slot holds an MoELayer, with _forward_mlp split into three separately callable phases:
//
//   _forward_mlp_router(hidden_states, padding_mask)
//       residual = hidden_states; pre_mlp_layernorm; MoELayer "route" group (shared experts,
//       router, dispatch_preprocess) -> (residual, hidden_states, probs, shared_expert_output)
//   _forward_mlp_expert_compute(hidden_states, probs)
//       MoELayer "expert_compute" group (dispatch, experts, combine) -> (expert_output, mlp_bias)
//   _forward_mlp_postprocess(residual, output, shared_expert_output, mlp_bias)
//       MoELayer "postprocess" group (unpermute, + shared experts) -> _forward_post_mlp (bda)
//
// Backward: TransformerLayer's (forward(..., &saved), backward), whose mlp slot runs MoELayer's
// forward with saving and MoELayer::backward.
//
// Their composition is bitwise the layer's whole _forward_mlp (TransformerLayer::_forward_mlp with
// MoELayer::forward). The data between the phases is the plain structs below; the dispatcher's
// attributes travel in them (Megatron copies them through token_dispatcher_attrs).
//
// get_gpt_layer_local_spec(num_experts=E): the dense local spec with submodules.mlp = MoELayer
// (TopKRouter, SequentialMLP, SharedExpertMLP); spec.module builds an MoETransformerLayer.
#pragma once

#include <optional>

#include "reference/moe/moe_layer.h"
#include "reference/transformer_layer.h"

namespace twin::reference::moe {

// ModuleSpec(module=MoELayer, submodules=MoESubmodules(experts=SequentialMLP, shared_experts=SharedExpertMLP)).
MlpBuilder moe_layer_builder();

// get_gpt_layer_local_spec(num_experts, moe_grouped_gemm, qk_layernorm, normalization, qk_l2_norm)
// with num_experts set. moe_grouped_gemm=True (GroupedMLP) is not implemented: MoEError.
ModuleSpec get_gpt_layer_local_moe_spec(int num_experts, bool moe_grouped_gemm = false, bool qk_layernorm = false,
                                        const std::string& normalization = "LayerNorm", bool qk_l2_norm = false,
                                        bool multi_latent_attention = false);

// _forward_mlp_router's outputs: (residual, hidden_states, probs, shared_expert_output) and the
// dispatcher attributes the next phase restores.
struct MoERouterPhaseOutput {
  int s = 0, b = 0;
  Mat residual;  // [s * b, h]
  DispatchTensors
      hidden_states_and_probs;  // after dispatch_preprocess: [T, h] + [T, E] (allgather) or [N, h] + [N, 1] (alltoall)
  std::optional<Mat> shared_expert_output;  // [s * b, h]
  DispatcherState token_dispatcher_attrs;
};

// _forward_mlp_expert_compute's outputs.
struct MoEExpertComputeOutput {
  Mat expert_output;               // after combine: [s * b, h] (before unpermute for alltoall: [N, h])
  std::optional<RowVec> mlp_bias;  // None: the experts add their biases themselves
};

// What the mlp slot keeps for backward (TransformerLayerSaved::mlp_module).
struct MoETransformerLayerSaved : MlpModuleSaved {
  MoELayerSaved moe;
};

class MoETransformerLayer : public TransformerLayer {
 public:
  // submodules.mlp must build an MoELayer (std::invalid_argument otherwise).
  MoETransformerLayer(const TransformerConfig& config, const TransformerLayerSubmodules& submodules,
                      int layer_number = 1, std::optional<double> hidden_dropout = std::nullopt,
                      Precision precision = Precision{});

  MoERouterPhaseOutput _forward_mlp_router(const Mat& hidden_states, int s, int b, const LayerInputs& inputs,
                                           const Taps& taps);
  MoEExpertComputeOutput _forward_mlp_expert_compute(const MoERouterPhaseOutput& routed, const Taps& taps);
  Mat _forward_mlp_postprocess(const Mat& residual, const Mat& output, const std::optional<Mat>& shared_expert_output,
                               const std::optional<RowVec>& mlp_bias, const Taps& taps);

  MoELayer& moe_layer() { return *moe_; }

  // The MoELayer in the mlp slot: forward keeping MoELayerSaved, backward (reference/moe/moe_layer.h).
  OutputWithBias forward_mlp_saving(const Mat& hidden_states, const MlpArgs& args, const Taps& taps,
                                    TransformerLayerSaved& saved) override;
  MlpGrads backward_mlp(const Mat& doutput, TransformerLayerSaved& saved, const MlpArgs& args) const override;
  std::optional<std::string> mlp_backward_unsupported() const override;

 private:
  MoELayer* moe_;  // the mlp slot
};

}  // namespace twin::reference::moe
