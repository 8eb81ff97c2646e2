#include "reference/retro/base_attention.h"

namespace twin::reference::retro {

namespace {
RetroConfig checked(const TransformerConfig& config) { return validate_retro_config(config); }
}  // namespace

BaseRetroCrossAttention::BaseRetroCrossAttention(const TransformerConfig& config, int layer_number,
                                                 AttnMaskType attn_mask_type, Precision p)
    : attn((checked(config), config), layer_number, attn_mask_type, p),
      config_(config),
      p_(p) {
  const RetroConfig retro = validate_retro_config(config);
  retro_num_neighbors = retro.retro_num_neighbors;
  retro_chunk_length = retro.retro_chunk_length;
  retro_retrieved_length = retro.retro_retrieved_length;
}

void BaseRetroCrossAttention::load_state_dict(const StateDict& sd, const std::string& prefix) {
  attn.load_state_dict(sd, prefix + "attn.");
}

}  // namespace twin::reference::retro
