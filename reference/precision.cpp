#include "reference/precision.h"

#include <string>
#include <vector>

namespace twin::reference {

Precision Precision::from_config(const TransformerConfig& c, ComputeMode mode) {
  Precision p;
  p.mode = mode;
  p.params_dtype = twin::params_dtype(c);
  return p;
}

void Precision::act_inplace(Mat& m) const {
  if (exact()) return;
  for (Eigen::Index i = 0; i < m.size(); ++i) m.data()[i] = act(m.data()[i]);
}
void Precision::act_inplace(RowVec& v) const {
  if (exact()) return;
  for (Eigen::Index i = 0; i < v.size(); ++i) v[i] = act(v[i]);
}
void Precision::f32_inplace(Mat& m) const {
  if (exact()) return;
  for (Eigen::Index i = 0; i < m.size(); ++i) m.data()[i] = f32(m.data()[i]);
}

static Tensor make_tensor(DType dt, Shape shape, const double* data, std::int64_t n) {
  if (shape_numel(shape) != n)
    throw ShapeError("to_tensor: " + std::to_string(n) + " values for shape " + shape_str(shape));
  return Tensor::from_doubles(dt, std::move(shape), std::vector<double>(data, data + n));
}

Tensor Precision::to_tensor(const Mat& m, Shape shape) const {
  return make_tensor(storage_dtype(), std::move(shape), m.data(), m.size());
}
Tensor Precision::to_tensor(const RowVec& v, Shape shape) const {
  return make_tensor(storage_dtype(), std::move(shape), v.data(), v.size());
}
Tensor Precision::to_tensor_f32(const Mat& m, Shape shape) const {
  return make_tensor(fp32_storage_dtype(), std::move(shape), m.data(), m.size());
}

Mat to_mat(const Tensor& t, std::int64_t rows, std::int64_t cols, const std::string& what) {
  if (!t.defined()) throw ShapeError(what + ": tensor is undefined");
  if (!is_floating(t.dtype())) throw ShapeError(what + ": expected a floating tensor, got " + t.describe());
  if (t.numel() != rows * cols)
    throw ShapeError(what + ": expected " + std::to_string(rows) + " x " + std::to_string(cols) + " elements, got " +
                     t.describe());
  Mat m(rows, cols);
  const std::vector<double> v = t.to_f64();
  std::copy(v.begin(), v.end(), m.data());
  return m;
}

RowVec to_rowvec(const Tensor& t, const std::string& what) {
  Mat m = to_mat(t, 1, t.numel(), what);
  return m.row(0);
}

}  // namespace twin::reference
