// The layout of get_retro_decoder_block_spec (megatron/core/models/retro/decoder_spec.py): which
// decoder layers are plain GPT layers, Retro decoder layers (chunked cross-attention), and the
// first Retro layer, which also owns the Retro encoder block.
//
// Rule: Retro layers are every third layer starting at layer 6 when the block has at most 15
// layers, else at layer 9; the first of them owns the encoder.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "core/config.h"

namespace twin::reference::retro {

enum class RetroLayerKind { Gpt, Retro, RetroWithEncoder };

// "gpt" | "retro" | "retro_with_encoder" (the names of retro_decoder_layout_table.json).
const char* retro_layer_kind_name(RetroLayerKind kind);

// Layer kinds of the decoder block, layer number i + 1 at index i. As Megatron: pipeline and
// virtual pipeline parallelism are rejected, and the layer count is get_num_layers_to_build's.
// Throws ConfigError for pipeline_model_parallel_size != 1, a virtual pipeline size, or fewer than
// 6 layers (no Retro layer; Megatron fails there with IndexError).
std::vector<RetroLayerKind> get_retro_decoder_block_layout(const TransformerConfig& config,
                                                           std::optional<int> vp_stage = std::nullopt,
                                                           std::optional<int> pp_rank = std::nullopt);
// The same for a block of num_layers layers and no parallelism.
std::vector<RetroLayerKind> get_retro_decoder_block_layout(int num_layers);

// Text: one line per layer, "layer <n>: <kind>". JSON: {"num_layers": N, "layers": [...]}, the
// format of retro_decoder_layout_table.json's entries.
std::string format_retro_layout(const std::vector<RetroLayerKind>& layout, bool json = false);

}  // namespace twin::reference::retro
