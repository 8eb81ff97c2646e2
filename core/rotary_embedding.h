// The rotary embeddings' angles, which both twins compute on the host as Megatron does in fp32:
// megatron/core/models/common/embeddings/rotary_pos_embedding.py (RotaryEmbedding) and
// yarn_rotary_pos_embedding.py (YarnRotaryEmbedding and its helpers, the rotary embedding
// multi-latent attention builds with rope_type "yarn"), and what MLASelfAttention takes from them.
//
// RotaryEmbedding: inv_freq = 1 / base^(arange(0, dim, 2) / dim) (fp32 pow and reciprocal),
//   freqs = outer(arange(s) + offset, inv_freq), emb = cat(freqs, freqs) (interleaved:
//   [f0, f0, f1, f1, ...]) -> [s, 1, 1, dim] angles (fp32).
// YarnRotaryEmbedding:
//   inv_freq_extra = 1 / base^(arange(0, dim, 2) / dim)                     (fp32)
//   inv_freq_inter = 1 / (scaling_factor * base^(arange(0, dim, 2) / dim))  (fp32)
//   low, high = _yarn_find_correction_range(beta_fast, beta_slow, dim, base, original_max_pos)
//     (correction dim d(r) = dim * ln(original_max_pos / (2 pi r)) / (2 ln base); low = floor(d(beta_fast)),
//      high = ceil(d(beta_slow)), clamped to [0, dim - 1])
//   inv_freq_mask = 1 - clamp((arange(dim / 2) - low) / (high - low), 0, 1)  (high += 0.001 when equal)
//   inv_freq = inv_freq_inter * (1 - inv_freq_mask) + inv_freq_extra * inv_freq_mask
//   emb = cat(outer(arange(s) + offset, inv_freq)) x2 -> [s, 1, 1, dim] angles (fp32)
//   mscale = _yarn_get_mscale(scaling_factor, mscale) / _yarn_get_mscale(scaling_factor, mscale_all_dim),
//     _yarn_get_mscale(scale, m) = 1 if scale <= 1 else 0.1 m ln(scale) + 1
// Every tensor op above is an fp32 op in torch; this computes each in double and rounds it to fp32
// where torch stores: the same values, but where torch's fp32 pow is not correctly rounded (as
// RotaryEmbedding's angles).
#pragma once

#include <utility>

#include "core/config.h"
#include "core/tensor.h"

namespace twin {

class RotaryEmbedding {
 public:
  // dim = kv_channels, or int(kv_channels * rotary_percent) when rotary_percent < 1.
  RotaryEmbedding(int kv_channels, double rotary_percent, bool rotary_interleaved = false,
                  double rotary_base = 10000.0);
  // get_emb(max_seq_len, offset): [max_seq_len, 1, 1, dim] F32 angles, as Megatron computes them
  // in fp32 (inv_freq = 1 / base^(arange(0, dim, 2) / dim), freqs = outer(seq, inv_freq)).
  Tensor forward(int max_seq_len, int offset = 0) const;
  int dim() const { return dim_; }

 private:
  int dim_;
  bool rotary_interleaved_;
  double rotary_base_;
};

double yarn_get_mscale(double scale, double mscale);
double yarn_get_concentration_factor(double scaling_factor, double mscale, double mscale_all_dim);

class YarnRotaryEmbedding {
 public:
  YarnRotaryEmbedding(int kv_channels, double rotary_base, double scaling_factor, int original_max_position_embeddings,
                      double beta_fast, double beta_slow, double mscale, double mscale_all_dim);
  // forward(max_seq_len, offset): the angles [max_seq_len, 1, 1, dim] F32 and the concentration factor.
  std::pair<Tensor, double> forward(int max_seq_len, int offset = 0) const;
  int dim() const { return dim_; }

 private:
  int dim_;
  double base_, scaling_factor_, beta_fast_, beta_slow_, mscale_, mscale_all_dim_;
  int original_max_position_embeddings_;
};

// Multi-latent attention's rotary embedding (MLASelfAttention.__init__ and forward): the angles
// [s, 1, 1, qk_pos_emb_head_dim] of RotaryEmbedding(qk_pos_emb_head_dim) for rope_type "rope"
// (concentration factor 1) or of YarnRotaryEmbedding for "yarn", with its concentration factor.
struct MlaRotaryEmbedding {
  Tensor emb;
  double mscale = 1.0;
};
MlaRotaryEmbedding mla_rotary_pos_emb(const TransformerConfig& c, int s);
// That concentration factor alone (mla_rotary_pos_emb's mscale).
double mla_rope_mscale(const TransformerConfig& c);
// Its core attention's softmax scale: mscale_all^2 / sqrt(qk_head_dim + qk_pos_emb_head_dim), with
// mscale_all = _yarn_get_mscale(rotary_scaling_factor, mscale_all_dim) (for both rope types, as
// Megatron computes it).
double mla_softmax_scale(const TransformerConfig& c);

}  // namespace twin
