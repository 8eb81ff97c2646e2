#include "reference/moe/moe_transformer_layer.h"

#include <stdexcept>

namespace twin::reference::moe {

MlpBuilder moe_layer_builder() {
  return [](const TransformerConfig& c, int layer_number, Precision p) -> std::unique_ptr<MlpModule> {
    return std::make_unique<MoELayer>(c, p, layer_number);
  };
}

ModuleSpec get_gpt_layer_local_moe_spec(int num_experts, bool moe_grouped_gemm, bool qk_layernorm,
                                        const std::string& normalization, bool qk_l2_norm,
                                        bool multi_latent_attention) {
  if (num_experts <= 0)
    throw MoEError("get_gpt_layer_local_spec: num_experts must be positive, got " + std::to_string(num_experts));
  if (moe_grouped_gemm)
    throw MoEError(
        "get_gpt_layer_local_spec: moe_grouped_gemm=True (GroupedMLP) is not implemented; SequentialMLP only");
  ModuleSpec spec = get_gpt_layer_local_spec(std::nullopt, qk_layernorm, normalization, qk_l2_norm,
                                             AttnMaskType::causal, multi_latent_attention);
  spec.submodules.mlp = moe_layer_builder();  // get_mlp_module_spec_for_backend(num_experts=...) -> MoELayer
  spec.module = [](const TransformerConfig& c, const TransformerLayerSubmodules& s, int layer_number,
                   Precision p) -> std::unique_ptr<BaseTransformerLayer> {
    return std::make_unique<MoETransformerLayer>(c, s, layer_number, std::nullopt, p);
  };
  return spec;
}

MoETransformerLayer::MoETransformerLayer(const TransformerConfig& config, const TransformerLayerSubmodules& submodules,
                                         int layer_number, std::optional<double> hidden_dropout, Precision precision)
    : TransformerLayer(config, submodules, layer_number, hidden_dropout, precision),
      moe_(dynamic_cast<MoELayer*>(mlp.get())) {
  if (!moe_) throw std::invalid_argument("MoETransformerLayer: submodules.mlp does not build an MoELayer");
}

MoERouterPhaseOutput MoETransformerLayer::_forward_mlp_router(const Mat& hidden_states, int s, int b,
                                                              const LayerInputs& inputs, const Taps& taps) {
  MoERouterPhaseOutput r;
  r.s = s;
  r.b = b;
  r.residual = hidden_states;
  const Mat pre_mlp_layernorm_output = _forward_pre_mlp_layernorm(hidden_states, s, b, taps);
  MlpArgs args;
  args.lead = {s, b};
  args.padding_mask = inputs.padding_mask;
  args.recorded_routing_map = inputs.recorded_routing_map;
  args.training = training;
  MoERouteOutput routed = moe_->forward_route(pre_mlp_layernorm_output, args, taps.child("mlp"));
  r.hidden_states_and_probs = std::move(routed.hidden_states_and_probs);
  r.shared_expert_output = std::move(routed.shared_expert_output);
  r.token_dispatcher_attrs = std::move(routed.token_dispatcher_attrs);
  return r;
}

MoEExpertComputeOutput MoETransformerLayer::_forward_mlp_expert_compute(const MoERouterPhaseOutput& routed,
                                                                        const Taps& taps) {
  const OutputWithBias out =
      moe_->forward_expert_compute(routed.hidden_states_and_probs, routed.token_dispatcher_attrs, taps.child("mlp"));
  return {out.output, out.bias};
}

Mat MoETransformerLayer::_forward_mlp_postprocess(const Mat& residual, const Mat& output,
                                                  const std::optional<Mat>& shared_expert_output,
                                                  const std::optional<RowVec>& mlp_bias, const Taps& taps) {
  OutputWithBias mlp_output_with_bias;
  mlp_output_with_bias.output = moe_->forward_postprocess(output, shared_expert_output, taps.child("mlp"));
  mlp_output_with_bias.bias = mlp_bias;
  return _forward_post_mlp(mlp_output_with_bias, residual);
}

OutputWithBias MoETransformerLayer::forward_mlp_saving(const Mat& hidden_states, const MlpArgs& args, const Taps& taps,
                                                       TransformerLayerSaved& saved) {
  auto kept = std::make_shared<MoETransformerLayerSaved>();
  saved.mlp_module = kept;
  return moe_->forward(hidden_states, args, taps, &kept->moe);
}

MlpGrads MoETransformerLayer::backward_mlp(const Mat& doutput, TransformerLayerSaved& saved, const MlpArgs&) const {
  auto* kept = dynamic_cast<MoETransformerLayerSaved*>(saved.mlp_module.get());
  if (!kept) throw std::logic_error("MoETransformerLayer::backward: `saved` holds no MoELayer forward");
  MlpGrads g = moe_->backward(doutput, std::move(kept->moe));
  saved.mlp_module.reset();  // consumed
  return g;
}

std::optional<std::string> MoETransformerLayer::mlp_backward_unsupported() const {
  return moe_->backward_unsupported();
}

}  // namespace twin::reference::moe
