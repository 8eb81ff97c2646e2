#include "reference/transformer_block.h"

#include <stdexcept>

#include "core/progress.h"

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
                                 const DropoutRng& rng, const Taps& taps, std::optional<Tensor>* context_out,
                                 TransformerBlockSaved* saved) {
  if (saved) {
    if (const auto why = backward_unsupported()) throw std::logic_error("TransformerBlock has no backward: " + *why);
    *saved = TransformerBlockSaved{};
    saved->layers.resize(layers.size());
    saved->contexts.reserve(layers.size());  // never reallocated: the layers' saved inputs point into it
    saved->hidden_shape = hidden_states_in.shape();
  }
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
    layer.rng = rng.with_offset(block_layer_offset(rng.offset, l_no));
    LayerInputs layer_inputs = inputs;
    layer_inputs.context = context ? &*context : nullptr;
    const Taps t = layer_taps.child(std::to_string(l_no));
    const progress::Step step("layers." + std::to_string(l_no));
    if (saved) {
      saved->contexts.push_back(context);
      layer_inputs.context = context ? &*saved->contexts.back() : nullptr;
    }
    auto [h, c] = saved ? layer.forward(hidden_states, layer_inputs, t, &saved->layers[l_no])
                        : layer.forward(hidden_states, layer_inputs, t);
    hidden_states = layer_taps.record(std::to_string(l_no) + ".0", h);
    context = std::move(c);
    if (context) context = layer_taps.record(std::to_string(l_no) + ".1", *context);
  }
  // Final layer norm.
  if (final_layernorm) {
    const std::int64_t s = hidden_states.size(0), b = hidden_states.size(1), h = hidden_states.size(2);
    const Mat x = to_mat(hidden_states, s * b, h, "hidden_states");
    if (saved) saved->final_layernorm_input = x;
    hidden_states = taps.record("final_layernorm", precision.to_tensor(final_layernorm->forward(x), {s, b, h}));
    if (taps.enabled()) taps.set_magnitude(final_layernorm->error_magnitude(x));
  }
  if (context_out) *context_out = context;
  return hidden_states;
}

std::optional<std::string> TransformerBlock::backward_unsupported() const {
  for (std::size_t i = 0; i < layers.size(); ++i)
    if (auto why = layers[i]->backward_unsupported()) return "layer " + std::to_string(i + 1) + ": " + *why;
  return std::nullopt;
}

TransformerBlockGrads TransformerBlock::backward(const Tensor& grad_output, TransformerBlockSaved&& saved,
                                                 const Tensor* grad_context) const {
  if (saved.layers.size() != layers.size() || saved.hidden_shape.size() != 3)
    throw std::logic_error("TransformerBlock::backward: `saved` was not filled by forward(..., &saved)");
  if (grad_output.shape() != saved.hidden_shape)
    throw ShapeError("TransformerBlock grad_output: expected the output's shape " + shape_str(saved.hidden_shape) +
                     ", got " + shape_str(grad_output.shape()));
  TransformerBlockGrads g;
  Tensor d = grad_output;
  if (final_layernorm) {
    const std::int64_t n = saved.hidden_shape[0] * saved.hidden_shape[1], h = saved.hidden_shape[2];
    const NormGrads ng = final_layernorm->backward(to_mat(d, n, h, "grad_output"), saved.final_layernorm_input);
    add_param_grads(g.params, "final_layernorm.", ng);
    d = precision.to_tensor(ng.input, saved.hidden_shape);
  }
  std::optional<Tensor> dcontext;  // d of the context the layer below returned
  if (grad_context) dcontext = *grad_context;
  for (std::size_t i = layers.size(); i-- > 0;) {
    const progress::Step step("layers." + std::to_string(i));
    TransformerLayerGrads lg = layers[i]->backward(d, std::move(saved.layers[i]), dcontext ? &*dcontext : nullptr);
    const std::string prefix = "layers." + std::to_string(i) + ".";
    for (ParamGrad& p : lg.params) p.name = prefix + p.name;
    g.params.insert(g.params.begin(), std::make_move_iterator(lg.params.begin()),
                    std::make_move_iterator(lg.params.end()));
    d = std::move(lg.hidden_states);
    dcontext = std::move(lg.context);
  }
  g.hidden_states = std::move(d);
  g.context = std::move(dcontext);
  return g;
}

}  // namespace twin::reference
