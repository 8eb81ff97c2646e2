#include "optimized/layer/grad_magnitudes.h"

#include <algorithm>
#include <cmath>

namespace twin::opt {

std::vector<double> abs_values(const Tensor& t) {
  std::vector<double> v(static_cast<std::size_t>(t.numel()));
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = std::fabs(t.at_f64(static_cast<std::int64_t>(i)));
  return v;
}

double weight_magnitude(const std::vector<double>& dy, const std::vector<double>& x, std::int64_t rows,
                        std::int64_t out, std::int64_t in) {
  double m = 0.0;
  std::vector<double> acc(static_cast<std::size_t>(in));
  for (std::int64_t o = 0; o < out; ++o) {
    std::fill(acc.begin(), acc.end(), 0.0);
    for (std::int64_t r = 0; r < rows; ++r) {
      const double a = dy[r * out + o];
      if (a == 0.0) continue;
      const double* xr = x.data() + r * in;
      for (std::int64_t i = 0; i < in; ++i) acc[i] += a * xr[i];
    }
    m = std::max(m, *std::max_element(acc.begin(), acc.end()));
  }
  return m;
}

double column_magnitude(const std::vector<double>& dy, std::int64_t rows, std::int64_t cols) {
  std::vector<double> acc(static_cast<std::size_t>(cols), 0.0);
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) acc[c] += dy[r * cols + c];
  return cols ? *std::max_element(acc.begin(), acc.end()) : 0.0;
}

double norm_weight_magnitude(const std::vector<double>& dy, const Tensor& x, std::int64_t rows, std::int64_t cols,
                             bool rms, double eps) {
  std::vector<double> acc(static_cast<std::size_t>(cols), 0.0);
  for (std::int64_t r = 0; r < rows; ++r) {
    double mean = 0.0, sq = 0.0;
    for (std::int64_t c = 0; c < cols; ++c) mean += x.at_f64(r * cols + c);
    mean = rms ? 0.0 : mean / cols;
    for (std::int64_t c = 0; c < cols; ++c) sq += std::pow(x.at_f64(r * cols + c) - mean, 2);
    const double rstd = 1.0 / std::sqrt(sq / cols + eps);
    for (std::int64_t c = 0; c < cols; ++c)
      acc[c] += dy[r * cols + c] * std::fabs((x.at_f64(r * cols + c) - mean) * rstd);
  }
  return cols ? *std::max_element(acc.begin(), acc.end()) : 0.0;
}

std::vector<double> gather_heads(const std::vector<double>& full, std::int64_t n, const RankPlan& p, bool keys) {
  const int hpg = p.hpg(), ng = p.ng_local();
  const std::int64_t qw = p.qkv_width(), gs = std::int64_t(hpg + 2) * p.hn;
  std::vector<double> out;
  out.reserve(static_cast<std::size_t>(n * ng * (keys ? 1 : hpg) * p.hn));
  for (std::int64_t t = 0; t < n; ++t)
    for (int g = 0; g < ng; ++g)
      for (int j = keys ? hpg : 0; j < (keys ? hpg + 1 : hpg); ++j) {
        const double* head = full.data() + t * qw + g * gs + std::int64_t(j) * p.hn;
        out.insert(out.end(), head, head + p.hn);
      }
  return out;
}

}  // namespace twin::opt
