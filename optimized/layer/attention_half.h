// The attention half every optimized layer kind with a RankPlan runs before its MLP
// (input_layernorm -> self_attention -> self_attn_bda -> pre_mlp_layernorm, Megatron's
// TransformerLayer._forward_attention): its parameters' shapes, the config's numbers in the plan,
// a forward's input checks, dropout streams and mask, and its q/k-layernorm taps. The dense and
// the MoE layer fill their RankPlan here; Retro's layers take the same attention scaling.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "core/config.h"
#include "core/tensor.h"
#include "optimized/layer/buffer_arena.h"
#include "optimized/layer/options.h"
#include "optimized/layer/rank_runner.h"  // RankTap
#include "optimized/layer/rank_plan.h"

namespace twin::opt {

// Megatron's state-dict keys of the attention half for `c` (biases and norms included or not;
// with multi_latent_attention, MLASelfAttention's projections and latent norms in place of
// linear_qkv and the q/k layernorms).
std::vector<std::string> attention_half_param_keys(const TransformerConfig& c);
// The state-dict shapes of the attention half (input_layernorm through pre_mlp_layernorm) of `c`.
std::map<std::string, Shape> attention_half_param_shapes(const TransformerConfig& c);

// The attention half's weight slots in a RankPlan by state-dict key (a slot stays null where the
// config has no such parameter).
struct PlanWeight {
  const char* key;
  const void* RankPlan::*slot;
};
inline constexpr PlanWeight kAttentionHalfWeights[] = {
    {"input_layernorm.weight", &RankPlan::ln1_w},
    {"input_layernorm.bias", &RankPlan::ln1_b},
    {"self_attention.linear_qkv.weight", &RankPlan::qkv_w},
    {"self_attention.linear_qkv.bias", &RankPlan::qkv_b},
    {"self_attention.q_layernorm.weight", &RankPlan::qln_w},
    {"self_attention.q_layernorm.bias", &RankPlan::qln_b},
    {"self_attention.k_layernorm.weight", &RankPlan::kln_w},
    {"self_attention.k_layernorm.bias", &RankPlan::kln_b},
    {"self_attention.linear_q_down_proj.weight", &RankPlan::q_down_w},
    {"self_attention.linear_q_up_proj.weight", &RankPlan::q_up_w},
    {"self_attention.linear_q_proj.weight", &RankPlan::q_up_w},
    {"self_attention.linear_kv_down_proj.weight", &RankPlan::kv_down_w},
    {"self_attention.linear_kv_up_proj.weight", &RankPlan::kv_up_w},
    {"self_attention.kv_layernorm.weight", &RankPlan::kln_w},
    {"self_attention.kv_layernorm.bias", &RankPlan::kln_b},
    {"self_attention.linear_proj.weight", &RankPlan::proj_w},
    {"self_attention.linear_proj.bias", &RankPlan::proj_b},
    {"pre_mlp_layernorm.weight", &RankPlan::ln2_w},
    {"pre_mlp_layernorm.bias", &RankPlan::ln2_b},
};

// A parameter's gradient slot in RankGrads by its Megatron state-dict key, and how the
// tensor-parallel ranks hold it: shard_dim -1, the whole gradient on every rank (a replicated
// parameter, after the backward's sum over the ranks where each computed a part); 0 / 1, split by
// rows / columns as the weight is (linear_fc1 with GLU: rows in two blocks, [gate | linear]).
// MLA's down projections: each rank holds its rows' gradient (Megatron's column-parallel shard;
// the forward reads the whole weight, layer/mla_attention.cuh), its latent norms' gradients are
// whole on every rank.
struct GradSlot {
  const char* key;
  void* RankGrads::*slot;
  int shard_dim;
};
// The attention half's (the slot stays null where the config has no such parameter).
inline constexpr GradSlot kAttentionHalfGradSlots[] = {
    {"input_layernorm.weight", &RankGrads::ln1_w, -1},
    {"input_layernorm.bias", &RankGrads::ln1_b, -1},
    {"self_attention.linear_qkv.weight", &RankGrads::qkv_w, 0},
    {"self_attention.linear_qkv.bias", &RankGrads::qkv_b, 0},
    {"self_attention.linear_proj.weight", &RankGrads::proj_w, 1},
    {"self_attention.linear_proj.bias", &RankGrads::proj_b, -1},
    {"self_attention.q_layernorm.weight", &RankGrads::qln_w, -1},
    {"self_attention.q_layernorm.bias", &RankGrads::qln_b, -1},
    {"self_attention.k_layernorm.weight", &RankGrads::kln_w, -1},
    {"self_attention.k_layernorm.bias", &RankGrads::kln_b, -1},
    {"self_attention.linear_q_down_proj.weight", &RankGrads::q_down_w, 0},
    {"self_attention.linear_q_up_proj.weight", &RankGrads::q_up_w, 0},
    {"self_attention.linear_q_proj.weight", &RankGrads::q_up_w, 0},
    {"self_attention.linear_kv_down_proj.weight", &RankGrads::kv_down_w, 0},
    {"self_attention.linear_kv_up_proj.weight", &RankGrads::kv_up_w, 0},
    {"self_attention.kv_layernorm.weight", &RankGrads::kln_w, -1},
    {"self_attention.kv_layernorm.bias", &RankGrads::kln_b, -1},
    {"pre_mlp_layernorm.weight", &RankGrads::ln2_w, -1},
    {"pre_mlp_layernorm.bias", &RankGrads::ln2_b, -1},
};

// A core_attention's softmax scale, Megatron's query-key layer scaling coefficient and the
// softmax's dtype (DotProductAttention.__init__: scale 1 / sqrt(hn) or softmax_scale, divided by
// the layer number under apply_query_key_layer_scaling, which FusedScaleMaskSoftmax multiplies
// back in fp32; TransformerConfig.__post_init__: that scaling sets attention_softmax_in_fp32; MLA's
// scale is mla_softmax_scale, core/rotary_embedding.h).
struct AttentionScaling {
  float alpha = 1.0f;  // the scale q k^T is multiplied by
  float coeff = 0.0f;  // 0: no query-key layer scaling
  bool softmax_fp32 = true;
};
AttentionScaling attention_scaling(const TransformerConfig& c, int layer_number);

// The config's numbers in the attention half of `p`: heads, norms, activation, scaling, dropout
// rates. The rank's split (tp, rank, sp), the ffn size and the pointers are the caller's.
void plan_attention_half(RankPlan& p, const TransformerConfig& c, int layer_number);

// The attention half's activations of `p` (its shape, split and numbers set) as rows of `arena`:
// ln1 through out, with the tensor-parallel partials and SP's all-gathered norms where the split
// has them (else the local buffer). The input x and the MLP's buffers are the caller's.
void add_attention_half_buffers(BufferArena& arena, rt::Device& dev, RankPlan& p);

// The attention half's backward scratch of `p` (RankGrads), rows of `arena`: d ctx [n, ctx_width],
// then d qkv (and d qkv_pre with qk-layernorm) [n, qkv_width], or MLA's (MlaGradScratch).
void add_attention_half_grad_scratch(BufferArena& arena, rt::Device& dev, const RankPlan& p, RankGrads& g);

// A forward's inputs, checked before anything runs ("<who>: ..." ShapeErrors): hidden_states
// [s, b, h] in dt; attention_mask BOOL [b | 1, 1 | np, s, s] or null; rotary_pos_emb F32
// [s, 1, 1, rot_dim] with rot_dim even, > 0 and <= hn, or null.
struct AttentionInputs {
  int s = 0, b = 0;
  int mask_b = 1, mask_h = 1;  // the mask's broadcast dims
  int rot = 0;                 // rot_dim, 0 without RoPE
};
AttentionInputs check_attention_inputs(const std::string& who, const Tensor& hidden_states, DType dt, int h, int np,
                                       int hn, const Tensor* attention_mask, const Tensor* rotary_pos_emb);

// The same for a layer of config `c`, with the RoPE angles the attention half applies: the
// rotary_pos_emb input, or with multi_latent_attention MLA's own rotary embedding's
// (mla_rotary_pos_emb, as MLASelfAttention computes them; rotary_pos_emb must then be null, as
// Megatron asserts), in `angles` [s, rot] F32 (undefined without RoPE).
struct AttentionInputsWithAngles : AttentionInputs {
  Tensor angles;
};
AttentionInputsWithAngles check_attention_inputs(const std::string& who, const TransformerConfig& c,
                                                 const Tensor& hidden_states, const Tensor* attention_mask,
                                                 const Tensor* rotary_pos_emb);

// This forward's dropout streams (one per DropoutSite, from fo.offset), training flag, seed and
// self-attention mask in `p`. Returns whether a value a captured graph bakes in changed.
bool set_forward_streams(RankPlan& p, const ForwardOptions& fo, MaskMode mask_mode, int mask_b, int mask_h);

// A rank's taps of a layer with an attention half, recorded in the rank's thread: each tensor
// downloaded where the rank's forward produced it (RankPlan::on_tap), its part as Megatron shards
// it (layer/rank_runner.h gathers the ranks' parts):
//   input_layernorm, pre_mlp_layernorm, the row-parallel outputs after their reduction
//     [s_local, b, h]: with SP each rank's sequence slice, else the same tensor on every rank
//     (rank 0's is recorded, as a rank-0 hook in Megatron records it);
//   linear_qkv.0 [s, b, ng_l * (hpg + 2) * hn]: this rank's query groups, contiguous in the
//     grouped layout; q/k_layernorm [s, b, np_l | ng_l, hn] and core_attention [s, b, np_l * hn]:
//     this rank's heads;
//   biases (skip_bias_add outputs): the full parameter, no rounding point;
//   MLA's: rotary_pos_emb (.0 for YaRN) [s, 1, 1, pe] (the host's angles), the down projections'
//     outputs and the latent norms [s, b, width] whole on every rank, the up projections' outputs
//     [s, b, np_l * width] this rank's heads.
struct RankTapRecorder {
  const RankPlan& p;
  const std::map<std::string, Tensor>& full;  // the layer's full params (the biases)
  std::function<Tensor(const void* ptr, DType dtype, Shape shape)> download;
  std::vector<RankTap>& taps;

  Tensor get(const void* ptr, Shape shape) const {
    return download(ptr, p.dt, std::move(shape));
  }  // in the plan's dtype
  // block_magnitude: RecordEntry::block_magnitude of this rank's part (undefined: none).
  void add(std::string name, Tensor value, ShardLayout layout, Tensor block_magnitude = Tensor());
  void bias(const std::string& name, const std::string& key);
  // A row-parallel linear's output [s_local, b, h] (after the reduction) and bias as
  // <module>.<linear>.0 / .1, which are also its module's (<module>.0 / .1): the bias is added
  // later, in the bias-dropout-add.
  void row_parallel(const void* y, const std::string& module, const std::string& linear);
  // The attention half's taps at `t`; false when `t` is not the attention half's.
  bool attention_half(TapPoint t);
  // MLA's (attention_half's for its points).
  bool mla(TapPoint t);
  // The core attention output's error magnitudes on this rank, [s, b, np_local] (core/
  // attention_bound.h): its heads' max |v| and each row's term from the forward's row maxima
  // (RankPlan::softmax_stats, which a forward recording taps keeps).
  Tensor core_attention_magnitudes() const;
};

// The q/k-layernorm taps out of the grouped linear_qkv output [S * B, ng * (hpg + 2) * hn] of
// ng query groups (after the norms, which work in place): q [S, B, ng * hpg, hn] and
// k [S, B, ng, hn].
std::pair<Tensor, Tensor> qk_layernorm_taps(const Tensor& qkv, std::int64_t S, std::int64_t B, int ng, int hpg, int hn);

}  // namespace twin::opt
