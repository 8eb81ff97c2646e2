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

namespace {
// round_to(F32) then round_to(BF16) of each of n values, written as loops without calls or
// branches so the compiler vectorises them (the reference rounds every activation element).
TWIN_VECTOR_CLONES void round_f32_inplace(double* v, Eigen::Index n) {
  for (Eigen::Index i = 0; i < n; ++i) v[i] = static_cast<float>(v[i]);
}
TWIN_VECTOR_CLONES void round_bf16_inplace(double* v, Eigen::Index n) {
  for (Eigen::Index i = 0; i < n; ++i) v[i] = Precision::round_bf16(v[i]);
}
void act_inplace_n(const Precision& p, double* v, Eigen::Index n) {
  if (p.exact()) return;
  if (p.params_dtype == DType::F32) return round_f32_inplace(v, n);
  if (p.params_dtype == DType::BF16) return round_bf16_inplace(v, n);
  for (Eigen::Index i = 0; i < n; ++i) v[i] = p.act(v[i]);
}
}  // namespace

void Precision::act_inplace(Mat& m) const { act_inplace_n(*this, m.data(), m.size()); }
namespace {
// round_bf16 of fp32 values, without the trip through double.
TWIN_VECTOR_CLONES void round_bf16_floats(float* v, Eigen::Index n) {
  for (Eigen::Index i = 0; i < n; ++i) v[i] = Precision::round_bf16(v[i]);
}
}  // namespace

void Precision::act_inplace(float* v, Eigen::Index n) const {
  if (exact() || params_dtype == DType::F32) return;
  if (params_dtype == DType::BF16) return round_bf16_floats(v, n);
  for (Eigen::Index i = 0; i < n; ++i) v[i] = static_cast<float>(act(v[i]));
}
void Precision::act_inplace(RowVec& v) const { act_inplace_n(*this, v.data(), v.size()); }
void Precision::f32_inplace(Mat& m) const {
  if (!exact()) round_f32_inplace(m.data(), m.size());
}

static Tensor make_tensor(DType dt, Shape shape, const double* data, std::int64_t n) {
  if (shape_numel(shape) != n)
    throw ShapeError("to_tensor: " + std::to_string(n) + " values for shape " + shape_str(shape));
  Tensor t = Tensor::empty(dt, std::move(shape));
  t.write_f64(0, n, data);
  return t;
}

Tensor to_tensor(DType dt, const Mat& m, Shape shape) { return make_tensor(dt, std::move(shape), m.data(), m.size()); }

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
