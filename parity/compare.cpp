#include "parity/compare.h"

#include <cmath>

namespace twin {

Tolerance Tolerance::for_dtype(DType dt) {
  switch (dt) {
    case DType::F64:
      return {1e-7, 1e-7, "torch.testing default for float64"};
    case DType::F32:
      return {1e-5, 1.3e-6, "torch.testing default for float32"};
    case DType::BF16:
      return {1e-5, 1.6e-2, "torch.testing default for bfloat16"};
    case DType::F16:
      return {1e-5, 1e-3, "torch.testing default for float16"};
    default:
      return {0.0, 0.0, "exact for integer and bool tensors"};
  }
}

std::string Comparison::worst_index_str() const {
  if (worst_index < 0) return "-";
  std::vector<std::int64_t> idx(shape.size());
  std::int64_t r = worst_index;
  for (int d = static_cast<int>(shape.size()) - 1; d >= 0; --d) {
    idx[d] = shape[d] ? r % shape[d] : 0;
    r = shape[d] ? r / shape[d] : 0;
  }
  return shape_str(idx);
}

Comparison compare(const std::string& name, const Tensor& actual, const Tensor& expected, const Tolerance& tol) {
  Comparison c;
  c.name = name;
  c.tol = tol;
  c.shape = expected.defined() ? expected.shape() : Shape{};
  if (!actual.defined() || !expected.defined()) {
    c.pass = false;
    c.message = !actual.defined() ? "no actual tensor" : "no expected tensor";
    return c;
  }
  if (actual.shape() != expected.shape()) {
    c.pass = false;
    c.message = "shape " + shape_str(actual.shape()) + " != expected " + shape_str(expected.shape());
    return c;
  }
  double se = 0.0, ss = 0.0;
  const std::int64_t n = expected.numel();
  const bool blocks = !tol.atol_blocks.empty();
  if (blocks && (tol.block <= 0 || std::int64_t(tol.atol_blocks.size()) * tol.block != n)) {
    c.pass = false;
    c.message = "tolerance of " + std::to_string(tol.atol_blocks.size()) + " blocks of " + std::to_string(tol.block) +
                " for " + std::to_string(n) + " elements";
    return c;
  }
  for (std::int64_t i = 0; i < n; ++i) {
    const double a = actual.at_f64(i), e = expected.at_f64(i);
    double diff, share;
    if (std::isnan(e) || std::isnan(a)) {
      diff = (std::isnan(e) && std::isnan(a)) ? 0.0 : INFINITY;
      share = diff;
    } else if (std::isinf(e) || std::isinf(a)) {
      diff = (a == e) ? 0.0 : INFINITY;
      share = diff;
    } else {
      diff = std::fabs(a - e);
      const double bound = (blocks ? tol.atol_blocks[std::size_t(i / tol.block)] : tol.atol) + tol.rtol * std::fabs(e);
      share = bound > 0 ? diff / bound : (diff > 0 ? INFINITY : 0.0);
      se += diff * diff;
      ss += e * e;
      if (e != 0.0) c.max_rel = std::max(c.max_rel, diff / std::fabs(e));
    }
    c.max_abs = std::max(c.max_abs, diff);
    if (share > 1.0) ++c.mismatches;
    if (share > c.share_used || c.worst_index < 0) {
      c.share_used = std::max(c.share_used, share);
      c.worst_index = i;
      c.worst_actual = a;
      c.worst_expected = e;
    }
  }
  c.nmse = ss > 0 ? se / ss : (se > 0 ? INFINITY : 0.0);
  c.pass = c.mismatches == 0;
  return c;
}

Comparison compare_exact(const std::string& name, const Tensor& actual, const Tensor& expected) {
  return compare(name, actual, expected, Tolerance{0.0, 0.0, "exact"});
}

}  // namespace twin
