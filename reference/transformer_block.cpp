#include "reference/transformer_block.h"

#include <stdexcept>

namespace twin::reference {

TransformerBlock::TransformerBlock(const TransformerConfig& config_, const TransformerBlockSubmodules& spec,
                                   Precision p, bool post_layer_norm, bool /*pre_process*/, bool post_process)
    : config(config_), precision(p) {
  // offset is implicit in TransformerLayer (0 at pipeline size 1)
  for (std::size_t i = 0; i < spec.layer_specs.size(); ++i) {
    std::unique_ptr<BaseTransformerLayer> built = spec.layer_specs[i].build(config, static_cast<int>(i) + 1, precision);
    auto* layer = dynamic_cast<TransformerLayer*>(built.get());
    if (!layer)
      throw std::invalid_argument("TransformerBlock: layer spec " + std::to_string(i + 1) +
                                  " does not build a TransformerLayer");
    built.release();
    layers.emplace_back(layer);
  }
  if (spec.layer_norm && post_process && post_layer_norm)
    final_layernorm = spec.layer_norm(config, config.hidden_size, config.layernorm_epsilon, precision);
}

void TransformerBlock::load_state_dict(const StateDict& sd, const std::string& prefix) {
  for (std::size_t i = 0; i < layers.size(); ++i) {
    const std::string layer_prefix = prefix + "layers." + std::to_string(i) + ".";
    StateDict layer_sd;
    for (const auto& [key, t] : sd.tensors())
      if (key.compare(0, layer_prefix.size(), layer_prefix) == 0) layer_sd.set(key.substr(layer_prefix.size()), t);
    layers[i]->load_state_dict(layer_sd);  // strict per layer
    for (const auto& [key, t] : sd.tensors())
      if (key.compare(0, layer_prefix.size(), layer_prefix) == 0) sd.get(key, t.shape());  // mark used
  }
  if (final_layernorm) final_layernorm->load_state_dict(sd, prefix + "final_layernorm.");
}

Tensor TransformerBlock::forward(const Tensor& hidden_states_in, const LayerInputs& inputs, bool training,
                                 const DropoutRng& rng, const Taps& taps, std::optional<Tensor>* context_out) {
  Tensor hidden_states = hidden_states_in;
  std::optional<Tensor> context;
  if (inputs.context) context = *inputs.context;
  const Taps layer_taps = taps.child("layers");
  // The block's inputs reach every layer (the context as is): each layer starts from at least their
  // rounding points (a no-op end to end, where the count only grows; in isolation each layer's
  // output tap resets it).
  const RoundingCount inputs_rounding = rounding_now();
  for (std::size_t l_no = 0; l_no < layers.size(); ++l_no) {
    rounding_join(inputs_rounding);
    TransformerLayer& layer = *layers[l_no];
    layer.training = training;
    layer.rng = rng.with_offset(rng.offset + 8 * l_no);
    LayerInputs layer_inputs = inputs;
    layer_inputs.context = context ? &*context : nullptr;
    const Taps t = layer_taps.child(std::to_string(l_no));
    auto [h, c] = layer.forward(hidden_states, layer_inputs, t);
    hidden_states = layer_taps.record(std::to_string(l_no) + ".0", h);
    context = std::move(c);
    if (context) context = layer_taps.record(std::to_string(l_no) + ".1", *context);
  }
  // Final layer norm.
  if (final_layernorm) {
    const std::int64_t s = hidden_states.size(0), b = hidden_states.size(1), h = hidden_states.size(2);
    const Mat x = to_mat(hidden_states, s * b, h, "hidden_states");
    hidden_states = taps.record("final_layernorm", precision.to_tensor(final_layernorm->forward(x), {s, b, h}));
    if (taps.enabled()) taps.set_magnitude(final_layernorm->error_magnitude(x));
  }
  if (context_out) *context_out = context;
  return hidden_states;
}

}  // namespace twin::reference
