// A module run at a stored dtype (Precision{FP32, fp32 | bf16 | fp16}) against its Exact run on the
// same dtype-representable inputs, within the bound of the rounding points the run counted: the
// golden comparison's own bound (parity::golden_bound), never a tolerance written for the test.
#pragma once

#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>
#include <utility>

#include "core/record.h"
#include "core/rounding.h"
#include "parity/bounds.h"
#include "reference/precision.h"

namespace twin::reference::testing {

// Each element of m rounded to dt (through fp32, as the twins store): inputs and parameters as
// Megatron holds them in that dtype.
inline Mat round_mat(Mat m, DType dt) {
  for (Eigen::Index i = 0; i < m.size(); ++i) m.data()[i] = round_to(dt, round_to(DType::F32, m.data()[i]));
  return m;
}
inline RowVec round_vec(RowVec v, DType dt) {
  for (Eigen::Index i = 0; i < v.size(); ++i) v[i] = round_to(dt, round_to(DType::F32, v[i]));
  return v;
}

// The value `f` returns and the rounding points executed while computing it.
template <class F>
std::pair<Mat, RoundingCount> run_counted(F&& f) {
  CountRoundings counting;
  Mat y = f();
  return {std::move(y), rounding_now()};
}

// Empty when every |y - exact| <= atol + rtol |exact| of golden_bound for the count `r`, with the
// error scaling with `magnitude` (< 0: max |exact|, as RecordEntry::magnitude); else what failed.
inline std::string outside_counted_bound(const Mat& y, const Mat& exact, const RoundingCount& r,
                                         double magnitude = -1.0) {
  if (y.rows() != exact.rows() || y.cols() != exact.cols()) return "shapes differ";
  RecordEntry e;
  e.rounding = r;
  e.magnitude = magnitude;
  const Tensor expected = Tensor::from_doubles(DType::F64, {exact.rows(), exact.cols()},
                                               std::vector<double>(exact.data(), exact.data() + exact.size()));
  const Tolerance tol = parity::golden_bound(e, expected);
  for (Eigen::Index i = 0; i < y.size(); ++i) {
    const double err = std::fabs(y.data()[i] - exact.data()[i]);
    if (!(err <= tol.atol + tol.rtol * std::fabs(exact.data()[i]))) {
      std::ostringstream os;
      os << "element " << i << ": " << y.data()[i] << " vs exact " << exact.data()[i] << ", error " << err << " > atol "
         << tol.atol << " + rtol " << tol.rtol << " |exact| (" << tol.reason << ")";
      return os.str();
    }
  }
  return "";
}

// Every element of y is a value of dtype dt (the run stored its outputs in dt).
inline bool all_in_dtype(const Mat& y, DType dt) {
  for (Eigen::Index i = 0; i < y.size(); ++i)
    if (y.data()[i] != round_to(dt, y.data()[i])) return false;
  return true;
}

}  // namespace twin::reference::testing
