#include "parity/bounds.h"

#include <algorithm>
#include <cmath>
#include <fmt/format.h>
#include <limits>

namespace twin::parity {

double gamma_n(std::int64_t n, double u) {
  const double nu = static_cast<double>(n) * u;
  return nu < 1.0 ? nu / (1.0 - nu) : std::numeric_limits<double>::infinity();
}

Tolerance reduction_bound(DType out, std::int64_t k, double magnitude) {
  Tolerance t = Tolerance::for_dtype(out);
  const double g = 2.0 * gamma_n(k, unit_roundoff(DType::F32));
  t.atol += g * magnitude;
  t.reason = fmt::format("{} + 2*gamma_{}(fp32)={:.3g} x magnitude {:.3g}", t.reason, k, g, magnitude);
  return t;
}

Tolerance op_bound(DType out, int stores, std::int64_t k, double magnitude) {
  Tolerance t = Tolerance::for_dtype(out);
  const double per = 2.0 * stores * unit_roundoff(out) + 2.0 * gamma_n(k, unit_roundoff(DType::F32));
  t.atol += per * magnitude;
  t.reason = fmt::format("{} + ({} stores x 2u + 2 gamma_{}(fp32)) x magnitude {:.3g}", t.reason, stores, k, magnitude);
  return t;
}

Tolerance reference_error_bound(DType dt, double ref_err, double magnitude) {
  Tolerance t = Tolerance::for_dtype(dt);
  const double ulp = 2.0 * unit_roundoff(dt) * magnitude;
  t.atol += 2.0 * ref_err + ulp;
  t.reason = fmt::format("{} + 2 x reference's own max error vs fp64 ({:.3g}) + one output ulp 2u x {:.3g}", t.reason,
                         ref_err, magnitude);
  return t;
}

Tolerance golden_bound(const RecordEntry& e, const Tensor& expected) {
  const RoundingCount& r = e.rounding;
  if (r.none()) return {0.0, 0.0, "no rounding point before this tensor (a parameter or a copy): exact"};
  const double u32 = unit_roundoff(DType::F32);
  const double eps = r.bf16 * unit_roundoff(DType::BF16) + r.fp16 * unit_roundoff(DType::F16) + r.fp32 * u32 +
                     (r.reduction ? 2.0 * gamma_n(r.reduction, u32) : 0.0);
  const std::string counted = fmt::format("{} before this tensor: eps = sum n u{} = {:.3g}", r.describe(),
                                          r.reduction ? fmt::format(" + 2 gamma_{}(fp32)", r.reduction) : "", eps);
  if (e.block_magnitude.defined()) {
    const std::int64_t blocks = e.block_magnitude.numel();
    if (blocks == 0 || expected.numel() % blocks != 0)
      throw ShapeError("golden_bound: " + e.key() + ": " + e.block_magnitude.describe() + " block magnitudes for " +
                       expected.describe());
    Tolerance t{0.0, eps, ""};
    t.block = expected.numel() / blocks;
    t.atol_blocks = e.block_magnitude.to_f64();
    for (double& a : t.atol_blocks) a *= eps;
    const double largest = *std::max_element(t.atol_blocks.begin(), t.atol_blocks.end());
    t.atol = largest;
    t.reason =
        fmt::format("{}; atol = eps x the magnitude its error follows per block of {} (largest {:.3g}), rtol = eps",
                    counted, t.block, largest / eps);
    return t;
  }
  const bool own = e.magnitude < 0;
  const double magnitude = own ? max_abs(expected) : e.magnitude;
  return {eps * magnitude, eps,
          fmt::format("{}; atol = eps x {} {:.3g}, rtol = eps", counted,
                      own ? "max|e|" : "the magnitude its error follows", magnitude)};
}

double max_abs(const Tensor& t) {
  double m = 0.0;
  for (std::int64_t i = 0; i < t.numel(); ++i) m = std::max(m, std::fabs(t.at_f64(i)));
  return m;
}

double max_abs_diff(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape())
    throw ShapeError("max_abs_diff: shapes " + shape_str(a.shape()) + " and " + shape_str(b.shape()));
  double m = 0.0;
  for (std::int64_t i = 0; i < a.numel(); ++i) m = std::max(m, std::fabs(a.at_f64(i) - b.at_f64(i)));
  return m;
}

}  // namespace twin::parity
