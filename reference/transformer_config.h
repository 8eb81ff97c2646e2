// Semantic validation of a TransformerConfig, as Megatron-Core's ModelParallelConfig.__post_init__
// and TransformerConfig.__post_init__ (megatron/core/model_parallel_config.py,
// megatron/core/transformer/transformer_config.py) perform it for the fields the twins read, plus
// RetroConfig.__post_init__ (megatron/core/models/retro/config.py).
//
// Every combination Megatron rejects is rejected here with a ConfigError naming the fields and
// their values. A few combinations that Megatron accepts in __post_init__ but cannot run (it fails
// later, in a module constructor or torch.topk) are rejected too; each is marked "twin:" below.
// Checks that depend on Transformer Engine being installed (apply_rope_fusion,
// moe_permute_fusion) are not made: the twins have no fused paths, those flags change nothing.
#pragma once

#include <optional>
#include <string>

#include "core/config.h"

namespace twin::reference {

// Throws twin::ConfigError with a one-line message on the first check that fails, in the order
// Megatron makes them.
void validate_transformer_config(const TransformerConfig& config);

// RetroConfig with Megatron's defaults applied and retro_retrieved_length derived.
struct RetroConfig {
  int retro_chunk_length = 0;
  int retro_num_neighbors = 2;
  int retro_num_retrieved_chunks = 2;
  int retro_retrieved_length = 0;  // retro_num_retrieved_chunks * retro_chunk_length
  int retro_encoder_num_layers = 2;
  double retro_encoder_hidden_dropout = 0.1;
  double retro_encoder_attention_dropout = 0.1;
  std::optional<int> retro_block_size;
  std::string retro_split_preprocessing;
  bool retro_verify_neighbor_count = true;
};

// validate_transformer_config, then RetroConfig.__post_init__: retro_split_preprocessing must be
// set; retro_retrieved_length = retro_num_retrieved_chunks * retro_chunk_length (a recorded value
// that disagrees is an error). twin: chunk length, neighbours, retrieved chunks and encoder layers
// must be >= 1, encoder dropouts in [0, 1] (Megatron fails later on these).
RetroConfig validate_retro_config(const TransformerConfig& config);

}  // namespace twin::reference
