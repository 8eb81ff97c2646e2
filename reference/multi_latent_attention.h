// megatron/core/transformer/multi_latent_attention.py: MultiLatentAttention and MLASelfAttention
// (tensor parallel 1, the unfused RoPE path), the self attention of a layer with
// config.multi_latent_attention (MLATransformerConfig).
//
// With np heads, q_head_dim = qk_head_dim + qk_pos_emb_head_dim (the "no-pe" and the rotary part):
//   rotary_pos_emb = RotaryEmbedding(qk_pos_emb_head_dim) (rope_type "rope", mscale 1) or
//                    YarnRotaryEmbedding (rope_type "yarn": angles and its concentration factor mscale)
//   q_compressed = linear_q_down_proj(x)        [s, b, q_lora_rank]   (without q_lora_rank: x itself)
//   kv_combined = linear_kv_down_proj(x)        [s, b, kv_lora_rank + qk_pos_emb_head_dim]
//   kv_compressed, k_pos_emb = split(kv_combined, [kv_lora_rank, qk_pos_emb_head_dim])
//   q_compressed = q_layernorm(q_compressed); kv_compressed = kv_layernorm(kv_compressed)
//   q = linear_q_up_proj(q_compressed)          [s, b, np, q_head_dim]   (or linear_q_proj(x))
//   kv = linear_kv_up_proj(kv_compressed)       [s, b, np, qk_head_dim + v_head_dim]
//   q_no_pe, q_pos_emb = split(q); k_no_pe, value = split(kv)
//   q_pos_emb, k_pos_emb = RoPE with multi_latent_attention: the rotated part's even then odd
//     channels (t[..., 0::2] | t[..., 1::2]) rotated by halves, cos / sin times mscale
//   query = cat(q_no_pe, q_pos_emb); key = cat(k_no_pe, k_pos_emb expanded to the np heads)
//   core_attention(query, key, value): k_channels q_head_dim, v_channels v_head_dim, softmax_scale
//     mscale_all^2 / sqrt(q_head_dim) with mscale_all = _yarn_get_mscale(rotary_scaling_factor,
//     mscale_all_dim) (for both rope types, as Megatron computes it)
//   output, bias = linear_proj(core_attn_out)   [s, b, h]
// The q/k layernorms are the spec's (qk_layernorm; IdentityOp otherwise). The q and kv paths are
// parallel branches from x: neither inherits the other's roundings until the core attention.
//
// Taps (relative to "self_attention."): rotary_pos_emb (.0 for YaRN, whose output is a tuple),
// linear_q_down_proj.0, q_layernorm, linear_q_up_proj.0 (or linear_q_proj.0), linear_kv_down_proj.0,
// kv_layernorm, linear_kv_up_proj.0, core_attention, linear_proj.0 / .1, then 0 / 1.
//
// Backward, the forward's steps in reverse: linear_proj, core attention, the RoPE on each rotary
// part (its channel permutation's transpose after it), the expand of k_pos_emb (a sum over the
// heads), the splits' transposes, the up projections, the norms, the down projections, and the two
// paths' input gradients summed.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "reference/attention.h"
#include "reference/rotary_pos_embedding.h"

namespace twin::reference {

// _apply_rotary_pos_emb_bshd with multi_latent_attention on t [s*b*heads, qk_pos_emb_head_dim]
// (rows_per_position = b * heads): the rotated part t[..., :rot_dim] (rot_dim = the tables'
// width) reordered to its even then its odd channels before the (non-interleaved) rotation, the
// rest passing; and its backward (the rotation's, then the reorder's transpose).
Mat mla_rope(const Mat& t, const RopeTables& tables, int rows_per_position, const Precision& p);
Mat mla_rope_backward(const Mat& d, const Mat& freqs, double mscale, int rows_per_position, const Precision& p);

struct MLASelfAttentionSubmodules {
  QKNormBuilder q_layernorm;   // empty: IdentityOp
  QKNormBuilder kv_layernorm;  // empty: IdentityOp
};

// What MLASelfAttention's backward needs from its forward.
struct MLASelfAttentionSaved {
  LinearSaved linear_q_down_proj, linear_q_up_proj, linear_kv_down_proj, linear_kv_up_proj, linear_proj;
  Mat q_compressed, kv_compressed;  // [s*b, q_lora_rank], [s*b, kv_lora_rank]: the norms' inputs
  Mat query, key, value;            // the core attention's inputs [s*b*np, q_head_dim] x2, [s*b*np, v_head_dim]
  Mat freqs;                        // the RoPE angles [s, rot_dim]
  double mscale = 1.0;              // the RoPE's concentration factor
};

class MLASelfAttention : public AttentionModule {
 public:
  MLASelfAttention(const TransformerConfig& config, const MLASelfAttentionSubmodules& submodules, int layer_number,
                   AttnMaskType attn_mask_type, Precision p);

  AttentionOutput forward(const Mat& hidden_states, const AttentionArgs& args, const Taps& taps) override;
  // The same, filling `saved` (when given) for backward. args.rotary_pos_emb must be null: MLA
  // computes its own (ConfigError otherwise, as Megatron asserts).
  AttentionOutput forward(const Mat& hidden_states, const AttentionArgs& args, const Taps& taps,
                          MLASelfAttentionSaved* saved);
  // doutput [s*b, h]: the gradient of linear_proj's output. `args` as in the forward.
  AttentionGrads backward(const Mat& doutput, const MLASelfAttentionSaved& saved, const AttentionArgs& args) const;
  void load_state_dict(const StateDict& sd, const std::string& prefix) override;

  std::optional<Linear> linear_q_proj;              // [np * q_head_dim, h]           (no q_lora_rank)
  std::optional<Linear> linear_q_down_proj;         // [q_lora_rank, h]
  std::optional<Linear> linear_q_up_proj;           // [np * q_head_dim, q_lora_rank]
  Linear linear_kv_down_proj;                       // [kv_lora_rank + qk_pos_emb_head_dim, h]
  Linear linear_kv_up_proj;                         // [np * (qk_head_dim + v_head_dim), kv_lora_rank]
  std::unique_ptr<Norm> q_layernorm, kv_layernorm;  // null: IdentityOp
  DotProductAttention core_attention;
  Linear linear_proj;  // [h, np * v_head_dim]

 private:
  // The q path: q_compressed, its norm, the up projection -> q [s*b*np, q_head_dim] (before RoPE).
  Mat query_path(const Mat& x, const AttentionArgs& a, const Taps& taps, MLASelfAttentionSaved* saved) const;
  struct KV {
    Mat kv;         // [s*b*np, qk_head_dim + v_head_dim]
    Mat k_pos_emb;  // [s*b, qk_pos_emb_head_dim] (before RoPE)
  };
  KV key_value_path(const Mat& x, const AttentionArgs& a, const Taps& taps, MLASelfAttentionSaved* saved) const;

  const TransformerConfig config_;
  int np_, hidden_, qk_, pe_, v_;
  Precision p_;
};

}  // namespace twin::reference
