// The one comparator of the project: every fixture check, parity test and `twin check` row goes
// through compare(). A tensor passes when every element satisfies
//     |actual - expected| <= atol + rtol * |expected|
// (torch.testing.assert_close's rule; NaN matches only NaN, Inf only the same Inf).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"

namespace twin {

struct Tolerance {
  Tolerance() = default;
  Tolerance(double atol_, double rtol_, std::string reason_ = {})
      : atol(atol_), rtol(rtol_), reason(std::move(reason_)) {}

  double atol = 0.0;
  double rtol = 0.0;
  std::string reason;  // where the bound comes from, printed with failures
  // Per block of `block` consecutive elements (element i: atol_blocks[i / block]) when not empty;
  // atol is then their largest (the one printed).
  std::vector<double> atol_blocks;
  std::int64_t block = 0;

  // torch.testing.assert_close defaults per dtype.
  static Tolerance for_dtype(DType dt);
};

struct Comparison {
  std::string name;
  Shape shape;
  double max_abs = 0.0;           // max |a - e|
  double max_rel = 0.0;           // max |a - e| / |e| over elements with e != 0
  double nmse = 0.0;              // sum (a - e)^2 / sum e^2 (0 when both are zero)
  double share_used = 0.0;        // max |a - e| / (atol + rtol |e|): <= 1 passes
  std::int64_t worst_index = -1;  // flat index of the element with the largest share used
  double worst_actual = 0.0;
  double worst_expected = 0.0;
  std::int64_t mismatches = 0;  // elements out of tolerance
  Tolerance tol;
  bool pass = true;
  std::string message;  // set when shapes differ or the tensor is missing

  std::string worst_index_str() const;  // "[3, 1, 17]"
};

Comparison compare(const std::string& name, const Tensor& actual, const Tensor& expected, const Tolerance& tol);

// Exact comparison (routing maps, token counts, integer tensors): any difference fails.
Comparison compare_exact(const std::string& name, const Tensor& actual, const Tensor& expected);

}  // namespace twin
