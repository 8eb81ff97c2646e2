// megatron/core/transformer/transformer_block.py: TransformerBlockSubmodules and TransformerBlock
// (tensor and pipeline parallel size 1: pre_process, no input tensor from a previous stage).
//
//   layers = [build_module(layer_spec, config, layer_number=i + 1) for i, layer_spec in enumerate(layer_specs)]
//   final_layernorm = layer_norm(...) if layer_norm and post_process and post_layer_norm else None
//   forward(hidden_states, attention_mask, context, context_mask, rotary_pos_emb, ...):
//     for layer in layers:
//       hidden_states, context = layer(hidden_states, attention_mask, context=context, context_mask, ...)
//     hidden_states = final_layernorm(hidden_states) if final_layernorm
//     return hidden_states
// The context a layer returns is the next layer's context: in a Retro decoder block the first
// Retro layer turns the neighbour embeddings into the encoder output, which the later Retro
// layers attend to.
//
// Taps (relative to the block's prefix): each layer's under "layers.<i>." (i from 0), then the
// layer's own output "layers.<i>.0" (hidden_states) and "layers.<i>.1" (context, when there is
// one), then "final_layernorm".
// Dropout streams: layer i runs with offset block_layer_offset(rng.offset, i) (core/dropout_site.h).
//
// Backward: forward(..., &saved) keeps each layer's TransformerLayerSaved (and the contexts the
// layers read); backward(grad_output, saved, grad_context) runs final_layernorm's backward, then
// the layers in reverse, each layer's d context (of the context it read) being the gradient of
// the context the layer before it returned. Parameters' gradients under "layers.<i>." and
// "final_layernorm.". std::logic_error for a block with a layer that has no backward.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "reference/transformer_layer.h"

namespace twin::reference {

struct TransformerBlockSubmodules {
  std::vector<ModuleSpec> layer_specs;
  NormBuilder layer_norm;  // empty: None (no final layernorm), as Retro's block specs leave it
};

struct TransformerBlockSaved {
  std::vector<TransformerLayerSaved> layers;
  std::vector<std::optional<Tensor>> contexts;  // the context each layer read (its saved inputs point here)
  Mat final_layernorm_input;                    // [s*b, h] when there is a final_layernorm
  Shape hidden_shape;                           // [s, b, h]
};

struct TransformerBlockGrads {
  Tensor hidden_states;           // [s, b, h]
  std::optional<Tensor> context;  // d inputs.context, when the block had one
  ParamGrads params;              // "layers.<i>.<key>", "final_layernorm.<key>"
};

class TransformerBlock {
 public:
  TransformerBlock(const TransformerConfig& config, const TransformerBlockSubmodules& spec, Precision p,
                   bool post_layer_norm = true, bool pre_process = true, bool post_process = true);

  // Loads layer i from the keys under prefix + "layers.<i>." (each layer strictly: a missing or
  // foreign key of a layer throws ShapeError) and final_layernorm from prefix + "final_layernorm.".
  // The keys it loads are marked used in `sd`.
  void load_state_dict(const StateDict& sd, const std::string& prefix = "");

  // hidden_states [s, b, h] -> [s, b, h]; inputs.context is the first layer's context. When
  // context_out is given, it receives the context the last layer returned.
  Tensor forward(const Tensor& hidden_states, const LayerInputs& inputs, bool training, const DropoutRng& rng,
                 const Taps& taps, std::optional<Tensor>* context_out = nullptr,
                 TransformerBlockSaved* saved = nullptr);
  // grad_output [s, b, h] of forward's output, grad_context of the context the last layer returned
  // (nullptr: none). ShapeError for a grad_output of another shape.
  // Consumes `saved` as TransformerLayer::backward does, layer by layer.
  TransformerBlockGrads backward(const Tensor& grad_output, TransformerBlockSaved&& saved,
                                 const Tensor* grad_context = nullptr) const;
  // Why backward does not cover this block (the first layer without one), or none.
  std::optional<std::string> backward_unsupported() const;

  const TransformerConfig config;
  const Precision precision;
  std::vector<std::unique_ptr<TransformerLayer>> layers;
  std::unique_ptr<Norm> final_layernorm;  // null: None
};

}  // namespace twin::reference
