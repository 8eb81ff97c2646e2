// megatron/core/models/retro/base_attention.py: BaseRetroCrossAttention, the common part of the
// Retro decoder and encoder cross attention: a CrossAttention `attn` (padding mask type; Retro
// passes no mask: utils.get_all_true_mask returns None at this commit) and the Retro sizes of
// the RetroConfig.
#pragma once

#include <string>

#include "reference/attention.h"
#include "reference/precision.h"
#include "reference/state_dict.h"
#include "reference/transformer_config.h"

namespace twin::reference::retro {

class BaseRetroCrossAttention : public AttentionModule {
 public:
  // Validates the config as RetroConfig.__post_init__ does (ConfigError: retro_chunk_length < 1,
  // retro_retrieved_length != retro_num_retrieved_chunks * retro_chunk_length, ...).
  BaseRetroCrossAttention(const TransformerConfig& config, int layer_number, AttnMaskType attn_mask_type, Precision p);

  void load_state_dict(const StateDict& sd, const std::string& prefix) override;  // prefix + "attn."

  const RetroConfig retro_config;  // validated first, before attn is built
  CrossAttention attn;
  const int retro_num_neighbors;     // k
  const int retro_chunk_length;      // m
  const int retro_retrieved_length;  // r = retro_num_retrieved_chunks * m

 protected:
  TransformerConfig config_;
  Precision p_;
};

}  // namespace twin::reference::retro
