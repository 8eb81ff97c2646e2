#include "core/rotary_embedding.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace twin {

namespace {

float f32(double x) { return static_cast<float>(x); }

// _yarn_find_correction_dim: the dimension index at which a frequency makes num_rotations turns
// over max_position_embeddings positions.
double correction_dim(double num_rotations, int dim, double base, int max_position_embeddings) {
  return (dim * std::log(max_position_embeddings / (num_rotations * 2 * M_PI))) / (2 * std::log(base));
}

}  // namespace

double yarn_get_mscale(double scale, double mscale) {
  if (scale <= 1) return 1.0;
  return 0.1 * mscale * std::log(scale) + 1.0;
}

double yarn_get_concentration_factor(double scaling_factor, double mscale, double mscale_all_dim) {
  return yarn_get_mscale(scaling_factor, mscale) / yarn_get_mscale(scaling_factor, mscale_all_dim);
}

YarnRotaryEmbedding::YarnRotaryEmbedding(int kv_channels, double rotary_base, double scaling_factor,
                                         int original_max_position_embeddings, double beta_fast, double beta_slow,
                                         double mscale, double mscale_all_dim)
    : dim_(kv_channels),
      base_(rotary_base),
      scaling_factor_(scaling_factor),
      beta_fast_(beta_fast),
      beta_slow_(beta_slow),
      mscale_(mscale),
      mscale_all_dim_(mscale_all_dim),
      original_max_position_embeddings_(original_max_position_embeddings) {
  if (dim_ <= 0 || dim_ % 2 != 0)
    throw ConfigError("YaRN rotary embedding: qk_pos_emb_head_dim must be positive and even, got " +
                      std::to_string(dim_));
  if (original_max_position_embeddings_ <= 0 || base_ <= 1.0 || scaling_factor_ <= 0.0)
    throw ConfigError(
        "YaRN rotary embedding: original_max_position_embeddings, rotary_base > 1 and "
        "rotary_scaling_factor must be positive");
}

std::pair<Tensor, double> YarnRotaryEmbedding::forward(int max_seq_len, int offset) const {
  const int half = dim_ / 2;
  // _yarn_find_correction_range (round_to_int), clamped.
  const double low =
      std::max(std::floor(correction_dim(beta_fast_, dim_, base_, original_max_position_embeddings_)), 0.0);
  double high = std::min(std::ceil(correction_dim(beta_slow_, dim_, base_, original_max_position_embeddings_)),
                         static_cast<double>(dim_ - 1));
  if (low == high) high += 0.001;  // _yarn_linear_ramp_mask: prevent the singularity
  std::vector<float> inv_freq(half);
  for (int i = 0; i < half; ++i) {
    const float power = f32(std::pow(base_, static_cast<double>(f32(2.0 * i) / f32(dim_))));  // fp32 pow
    const float extra = f32(1.0 / power);                                                     // 1 / (base ** x)
    const float inter = f32(1.0 / f32(scaling_factor_ * power));  // 1 / (scaling_factor * base ** x)
    const float ramp = std::clamp(f32((f32(i) - f32(low)) / f32(high - low)), 0.0f, 1.0f);
    const float mask = f32(1.0 - ramp);  // inv_freq_mask
    inv_freq[i] = f32(f32(inter * f32(1.0 - mask)) + f32(extra * mask));
  }
  std::vector<float> emb(static_cast<std::size_t>(max_seq_len) * dim_);
  for (int s = 0; s < max_seq_len; ++s)
    for (int i = 0; i < half; ++i) {
      const float f = f32(static_cast<float>(s + offset) * inv_freq[i]);  // torch.outer in fp32
      emb[static_cast<std::size_t>(s) * dim_ + i] = f;                    // cat((freqs, freqs))
      emb[static_cast<std::size_t>(s) * dim_ + half + i] = f;
    }
  return {Tensor::from_vector<float>({max_seq_len, 1, 1, dim_}, emb),
          yarn_get_concentration_factor(scaling_factor_, mscale_, mscale_all_dim_)};
}

RotaryEmbedding::RotaryEmbedding(int kv_channels, double rotary_percent, bool rotary_interleaved, double rotary_base)
    : dim_(rotary_percent < 1.0 ? static_cast<int>(kv_channels * rotary_percent) : kv_channels),
      rotary_interleaved_(rotary_interleaved),
      rotary_base_(rotary_base) {}

Tensor RotaryEmbedding::forward(int max_seq_len, int offset) const {
  const int half = (dim_ + 1) / 2;  // arange(0, dim, 2)
  std::vector<float> inv_freq(half);
  for (int i = 0; i < half; ++i) {
    const float e = static_cast<float>(2 * i) / static_cast<float>(dim_);                     // fp32 arange / dim
    inv_freq[i] = 1.0f / static_cast<float>(std::pow(rotary_base_, static_cast<double>(e)));  // fp32 pow, reciprocal
  }
  std::vector<float> emb(static_cast<std::size_t>(max_seq_len) * 2 * half);
  for (int s = 0; s < max_seq_len; ++s) {
    const float pos = static_cast<float>(s + offset);
    for (int i = 0; i < half; ++i) {
      const float f = pos * inv_freq[i];  // torch.outer in fp32
      if (!rotary_interleaved_) {
        emb[s * 2 * half + i] = f;  // cat((freqs, freqs))
        emb[s * 2 * half + half + i] = f;
      } else {
        emb[s * 2 * half + 2 * i] = f;  // stack((f, f), -1).view
        emb[s * 2 * half + 2 * i + 1] = f;
      }
    }
  }
  return Tensor::from_vector<float>({max_seq_len, 1, 1, 2 * half}, emb);
}

MlaRotaryEmbedding mla_rotary_pos_emb(const TransformerConfig& c, int s) {
  const int pe = c.qk_pos_emb_head_dim;
  if (c.rope_type == "rope") return {RotaryEmbedding(pe, c.rotary_percent, false, c.rotary_base).forward(s), 1.0};
  const YarnRotaryEmbedding yarn(pe, c.rotary_base, c.rotary_scaling_factor, c.original_max_position_embeddings,
                                 c.beta_fast, c.beta_slow, c.mscale, c.mscale_all_dim);
  auto [emb, mscale] = yarn.forward(s);
  return {std::move(emb), mscale};
}

double mla_rope_mscale(const TransformerConfig& c) {
  if (c.rope_type == "rope") return 1.0;
  return yarn_get_concentration_factor(c.rotary_scaling_factor, c.mscale, c.mscale_all_dim);
}

double mla_softmax_scale(const TransformerConfig& c) {
  const double mscale = yarn_get_mscale(c.rotary_scaling_factor, c.mscale_all_dim);
  return mscale * mscale / std::sqrt(static_cast<double>(c.qk_head_dim + c.qk_pos_emb_head_dim));
}

}  // namespace twin
