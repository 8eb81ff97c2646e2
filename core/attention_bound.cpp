#include "core/attention_bound.h"

#include <algorithm>
#include <vector>

namespace twin {

Tensor core_attention_error_magnitudes(const Tensor& stats, int n_terms, const Tensor& values, std::int64_t v0,
                                       double dropout) {
  const bool ok = stats.dim() == 4 && stats.size(3) == 2 && values.dim() == 4 && values.size(1) == stats.size(0) &&
                  values.size(2) > 0 && stats.size(1) % values.size(2) == 0 && v0 >= 0 && v0 <= values.size(3);
  if (!ok)
    throw ShapeError(
        "core_attention_error_magnitudes: stats expected [b, heads, sq, 2], values [sk, b, groups, width] "
        "with groups dividing heads and v0 <= width; got " +
        stats.describe() + ", " + values.describe() + ", v0 " + std::to_string(v0));
  const std::int64_t B = stats.size(0), heads = stats.size(1), sq = stats.size(2);
  const std::int64_t sk = values.size(0), groups = values.size(2), width = values.size(3);
  std::vector<double> max_v(std::size_t(B * groups), 0.0);  // [b, groups]
  for (std::int64_t j = 0; j < sk; ++j)
    for (std::int64_t bg = 0; bg < B * groups; ++bg)
      for (std::int64_t c = v0; c < width; ++c)
        max_v[std::size_t(bg)] =
            std::max(max_v[std::size_t(bg)], std::fabs(values.at_f64((j * B * groups + bg) * width + c)));
  std::vector<double> out(std::size_t(sq * B * heads));  // [sq, b, heads]
  for (std::int64_t bi = 0; bi < B; ++bi)
    for (std::int64_t h = 0; h < heads; ++h) {
      const double v = max_v[std::size_t(bi * groups + h / (heads / groups))];
      for (std::int64_t i = 0; i < sq; ++i) {
        const double term = softmax_row_amplification(stats.at_f64(((bi * heads + h) * sq + i) * 2), n_terms);
        out[std::size_t((i * B + bi) * heads + h)] = core_attention_error_magnitude(v, term, dropout);
      }
    }
  return Tensor::from_doubles(DType::F64, {sq, B, heads}, out);
}

}  // namespace twin
