#include "reference/retro/base_attention.h"

namespace twin::reference::retro {

BaseRetroCrossAttention::BaseRetroCrossAttention(const TransformerConfig& config, int layer_number,
                                                 AttnMaskType attn_mask_type, Precision p)
    : retro_config(validate_retro_config(config)),
      attn(config, layer_number, attn_mask_type, p),
      retro_num_neighbors(retro_config.retro_num_neighbors),
      retro_chunk_length(retro_config.retro_chunk_length),
      retro_retrieved_length(retro_config.retro_retrieved_length),
      config_(config),
      p_(p) {}

void BaseRetroCrossAttention::load_state_dict(const StateDict& sd, const std::string& prefix) {
  attn.load_state_dict(sd, prefix + "attn.");
}

}  // namespace twin::reference::retro
