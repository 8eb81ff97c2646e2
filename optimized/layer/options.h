// How an optimized layer is built: the parallel layout it shards for, the backend it runs on, its
// layer number and its self-attention's mask type. Shared by every layer kind.
#pragma once

#include <string>

#include "optimized/runtime/device.h"

namespace twin::opt {

struct LayerOptions {
  int tp = 1;
  bool sp = false;
  rt::Backend backend = rt::Backend::Sim;
  int layer_number = 1;
  // The self-attention's attn_mask_type: a spec parameter in Megatron (the local GPT spec fixes
  // "causal"), not the config's run description. "causal": causal mask when no attention_mask is
  // given; "no_mask" / "padding" / "arbitrary": only a given mask applies.
  std::string attn_mask_type = "causal";
};

}  // namespace twin::opt
