#include "reference/yarn_rotary_pos_embedding.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/config.h"

namespace twin::reference {

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

}  // namespace twin::reference
