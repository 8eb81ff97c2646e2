// megatron/core/models/retro/decoder_spec.py, the layer specs and the block spec:
//
// get_retro_decoder_layer_{te,local}_spec(encoder_block_spec=None): a GPT layer spec
//   (get_gpt_layer_*_spec() with its defaults: no qk_layernorm, no MoE) with
//     pre_cross_attn_layernorm = TENorm | FusedLayerNorm
//     cross_attention          = RetroDecoderCrossAttention(encoder_block_spec)  (padding mask type)
//     cross_attn_bda           = RetroDecoderBiasDropoutAdd
//   Only the first Retro layer gets an encoder_block_spec: its cross attention builds the encoder
//   TransformerBlock (pre_process=True, post_process=False).
// get_retro_decoder_block_spec(config, use_transformer_engine): the layout of
//   reference/retro/decoder_spec.h (gpt / retro / retro_with_encoder per layer), with
//   get_retro_encoder_block_spec for the first Retro layer.
//
// Families: see encoder_spec.h (same numerics for both; FusedLayerNorm rejects RMSNorm).
#pragma once

#include <optional>

#include "reference/retro/encoder_spec.h"
#include "reference/transformer_block.h"

namespace twin::reference::retro {

RetroLayerSpec get_retro_decoder_layer_te_spec(
    std::optional<TransformerBlockSubmodules> encoder_block_spec = std::nullopt);
RetroLayerSpec get_retro_decoder_layer_local_spec(
    std::optional<TransformerBlockSubmodules> encoder_block_spec = std::nullopt);

// ConfigError: pipeline / virtual pipeline parallelism, fewer than 6 layers, bad Retro fields.
TransformerBlockSubmodules get_retro_decoder_block_spec(const TransformerConfig& config, bool use_transformer_engine);

}  // namespace twin::reference::retro
