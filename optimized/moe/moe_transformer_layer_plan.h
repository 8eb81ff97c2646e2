// The work of the optimized MoETransformerLayer at one rank as plain numbers and device pointers,
// crossing from the host side (moe_transformer_layer.cpp) into the per-backend kernel sequence
// (moe_layer.cuh, compiled once for the simulator and once by nvcc; its three phases are called
// through layer/kernels.h): the attention half's RankPlan and MoELayer's fields.
#pragma once

#include "optimized/layer/rank_plan.h"
#include "optimized/moe/moe_layer_plan.h"

namespace twin::opt {

struct MoEPlan : MoELayerPlan {
  RankPlan attn;  // the attention half; attn.ln2 is the MoE's input, attn.h1 the residual, attn.out the output
};

// The layer's backward at one rank: the attention half's gradients (attn: dout, dx, its params',
// pre_mlp_layernorm's and their scratch) and MoELayer's (d_output = attn.d_mlp, d_input =
// attn.d_ln2).
struct MoEGrads : MoELayerGrads {
  RankGrads attn;
};

}  // namespace twin::opt
