// megatron/core/models/retro/encoder_spec.py: the Retro encoder layer specs and the encoder block
// spec.
//
// get_retro_encoder_layer_{te,local}_spec: a GPT layer spec (get_gpt_layer_*_spec() with its
//   defaults: no qk_layernorm, no MoE) with
//     pre_cross_attn_layernorm = TENorm | FusedLayerNorm
//     cross_attention          = RetroEncoderCrossAttention (padding mask type)
//     cross_attn_bda           = RetroEncoderBiasDropoutAdd
//     pre_mlp_layernorm        = RetroEncoderLayerNorm(submodules=TENorm | FusedLayerNorm)
//     mlp                      = MLP
// get_retro_encoder_block_spec(config, use_transformer_engine): retro_encoder_num_layers layers,
//   layer 1 the Retro encoder layer, the rest GPT layers; for both specs hidden_dropout =
//   retro_encoder_hidden_dropout, self-attention mask type padding and core_attention
//   attention_dropout = retro_encoder_attention_dropout. (The cross attention keeps the config's
//   attention_dropout, as in Megatron.)
//
// Families: the TE specs name Transformer Engine modules, the local specs Megatron-Core's. The
// reference builds the same (local, unfused) numerics for both; the differences it keeps are the
// norms: FusedLayerNorm supports LayerNorm only (ConfigError for RMSNorm, as Megatron asserts),
// TENorm is LayerNorm or RMSNorm by config.normalization; both honour
// layernorm_zero_centered_gamma. Parameters keep the local spec's state_dict keys.
#pragma once

#include <string>

#include "reference/transformer_block.h"
#include "reference/transformer_layer.h"

namespace twin::reference::retro {

enum class SpecFamily { TransformerEngine, Local };
const char* spec_family_name(SpecFamily f);  // "transformer_engine" | "local"

// A layer spec and the implementation family it names.
struct RetroLayerSpec {
  SpecFamily family;
  ModuleSpec spec;
};

// FusedLayerNorm (local) / TENorm (TE) builders.
NormBuilder fused_layer_norm_builder();
NormBuilder te_norm_builder();

RetroLayerSpec get_retro_encoder_layer_te_spec();
RetroLayerSpec get_retro_encoder_layer_local_spec();

// Validates the Retro config (ConfigError).
TransformerBlockSubmodules get_retro_encoder_block_spec(const TransformerConfig& config, bool use_transformer_engine);

}  // namespace twin::reference::retro
