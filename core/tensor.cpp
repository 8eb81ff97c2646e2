#include "core/tensor.h"

#include <cstdlib>
#include <cstring>

namespace twin {

std::string shape_str(const Shape& s) {
  std::string r = "[";
  for (std::size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

std::int64_t shape_numel(const Shape& s) {
  std::int64_t n = 1;
  for (auto d : s) {
    if (d < 0) throw ShapeError("negative dimension in shape " + shape_str(s));
    n *= d;
  }
  return n;
}

Tensor Tensor::empty(DType dt, Shape shape) {
  Tensor t;
  t.dtype_ = dt;
  t.shape_ = std::move(shape);
  const std::size_t bytes = std::max<std::size_t>(t.nbytes(), 1);
  auto buf = std::shared_ptr<std::byte[]>(new std::byte[bytes]);
  t.data_ = buf.get();
  t.holder_ = std::shared_ptr<const void>(buf, buf.get());
  return t;
}

Tensor Tensor::zeros(DType dt, Shape shape) {
  Tensor t = empty(dt, std::move(shape));
  std::memset(t.data_, 0, t.nbytes());
  return t;
}

Tensor Tensor::borrow(DType dt, Shape shape, std::shared_ptr<const void> holder, const void* data) {
  Tensor t;
  t.dtype_ = dt;
  t.shape_ = std::move(shape);
  shape_numel(t.shape_);
  t.holder_ = holder ? std::move(holder) : std::make_shared<int>(0);
  t.data_ = const_cast<std::byte*>(static_cast<const std::byte*>(data));
  t.borrowed_ = true;
  return t;
}

template <>
Tensor Tensor::from_vector<bool>(Shape shape, const std::vector<bool>& values) {
  if (static_cast<std::int64_t>(values.size()) != shape_numel(shape))
    throw ShapeError("Tensor::from_vector: " + std::to_string(values.size()) + " values for shape " + shape_str(shape));
  Tensor t = empty(DType::BOOL, std::move(shape));
  for (std::size_t i = 0; i < values.size(); ++i) t.data_[i] = std::byte(values[i] ? 1 : 0);
  return t;
}

namespace {
template <class T, class Convert>
void narrow(const double* v, std::int64_t n, std::byte* data, Convert convert) {
  T* dst = reinterpret_cast<T*>(data);
  for (std::int64_t i = 0; i < n; ++i) dst[i] = convert(v[i]);
}
}  // namespace

Tensor Tensor::from_doubles(DType dt, Shape shape, const std::vector<double>& v) {
  if (static_cast<std::int64_t>(v.size()) != shape_numel(shape))
    throw ShapeError("Tensor::from_doubles: " + std::to_string(v.size()) + " values for shape " + shape_str(shape));
  Tensor t = empty(dt, std::move(shape));
  t.write_f64(0, t.numel(), v.data());
  return t;
}

// The dtype's case is chosen once, outside the loop over the values.
void Tensor::write_f64(std::int64_t begin, std::int64_t n, const double* v) {
  check_range(begin, n);
  std::byte* at = raw_mut() + static_cast<std::size_t>(begin) * dtype_size(dtype_);
  switch (dtype_) {
    case DType::F64:
      narrow<double>(v, n, at, [](double x) { return x; });
      break;
    case DType::F32:
      narrow<float>(v, n, at, [](double x) { return static_cast<float>(x); });
      break;
    case DType::BF16:
      narrow<bf16_t>(v, n, at, [](double x) { return bf16_t(static_cast<float>(x)); });
      break;
    case DType::F16:
      narrow<fp16_t>(v, n, at, [](double x) { return fp16_t(static_cast<float>(x)); });
      break;
    case DType::I64:
      narrow<std::int64_t>(v, n, at, [](double x) { return static_cast<std::int64_t>(x); });
      break;
    case DType::I32:
      narrow<std::int32_t>(v, n, at, [](double x) { return static_cast<std::int32_t>(x); });
      break;
    case DType::BOOL:
      narrow<std::byte>(v, n, at, [](double x) { return std::byte(x != 0 ? 1 : 0); });
      break;
  }
}

void Tensor::check_range(std::int64_t begin, std::int64_t n) const {
  if (begin < 0 || n < 0 || begin + n > numel())
    throw ShapeError("elements [" + std::to_string(begin) + ", " + std::to_string(begin + n) + ") out of range for " +
                     describe());
}

std::int64_t Tensor::size(int d) const {
  const int n = dim();
  const int i = d < 0 ? d + n : d;
  if (i < 0 || i >= n)
    throw ShapeError("dimension " + std::to_string(d) + " out of range for shape " + shape_str(shape_));
  return shape_[i];
}

std::byte* Tensor::raw_mut() {
  if (borrowed_) *this = clone();
  return data_;
}

double Tensor::at_f64(std::int64_t i) const {
  if (i < 0 || i >= numel())
    throw ShapeError("index " + std::to_string(i) + " out of range for shape " + shape_str(shape_));
  switch (dtype_) {
    case DType::F64:
      return reinterpret_cast<const double*>(data_)[i];
    case DType::F32:
      return reinterpret_cast<const float*>(data_)[i];
    case DType::BF16:
      return static_cast<float>(reinterpret_cast<const bf16_t*>(data_)[i]);
    case DType::F16:
      return static_cast<float>(reinterpret_cast<const fp16_t*>(data_)[i]);
    case DType::I64:
      return static_cast<double>(reinterpret_cast<const std::int64_t*>(data_)[i]);
    case DType::I32:
      return reinterpret_cast<const std::int32_t*>(data_)[i];
    case DType::BOOL:
      return data_[i] != std::byte(0) ? 1.0 : 0.0;
  }
  return 0.0;
}

namespace {
template <class T>
void widen(const std::byte* data, std::int64_t n, double* out) {
  const T* src = reinterpret_cast<const T*>(data);
  for (std::int64_t i = 0; i < n; ++i) out[i] = static_cast<double>(static_cast<float>(src[i]));
}
}  // namespace

// at_f64 of every element, with the dtype's case chosen once (layers read every input through here).
std::vector<double> Tensor::to_f64() const {
  std::vector<double> r(static_cast<std::size_t>(numel()));
  read_f64(0, numel(), r.data());
  return r;
}

void Tensor::read_f64(std::int64_t begin, std::int64_t n, double* out) const {
  check_range(begin, n);
  const std::byte* at = data_ + static_cast<std::size_t>(begin) * dtype_size(dtype_);
  switch (dtype_) {
    case DType::BF16:
      widen<bf16_t>(at, n, out);
      break;
    case DType::F16:
      widen<fp16_t>(at, n, out);
      break;
    case DType::F32:
      widen<float>(at, n, out);
      break;
    default:
      for (std::int64_t i = 0; i < n; ++i) out[i] = at_f64(begin + i);
  }
}

Tensor Tensor::to(DType dt) const {
  if (dt == dtype_) return clone();
  return from_doubles(dt, shape_, to_f64());
}

Tensor Tensor::clone() const {
  Tensor t = empty(dtype_, shape_);
  if (nbytes()) std::memcpy(t.data_, data_, nbytes());
  return t;
}

Tensor Tensor::reshape(Shape shape) const {
  if (shape_numel(shape) != numel())
    throw ShapeError("reshape: cannot view " + shape_str(shape_) + " (" + std::to_string(numel()) + " elements) as " +
                     shape_str(shape));
  Tensor t = *this;
  t.shape_ = std::move(shape);
  return t;
}

void Tensor::expect(const Shape& shape, const std::string& what) const {
  if (!defined()) throw ShapeError(what + ": expected shape " + shape_str(shape) + ", got no tensor");
  if (shape != shape_) throw ShapeError(what + ": expected shape " + shape_str(shape) + ", got " + shape_str(shape_));
}

void Tensor::expect(const Shape& shape, DType dt, const std::string& what) const {
  expect(shape, what);
  if (dt != dtype_)
    throw ShapeError(what + ": expected dtype " + dtype_name(dt) + ", got " + dtype_name(dtype_) + " (shape " +
                     shape_str(shape_) + ")");
}

std::string Tensor::describe() const { return shape_str(shape_) + " " + dtype_name(dtype_); }

void Tensor::check_dtype(DType want) const {
  if (!defined()) throw ShapeError(std::string("access to an undefined tensor as ") + dtype_name(want));
  if (want != dtype_)
    throw ShapeError(std::string("tensor of dtype ") + dtype_name(dtype_) + " " + shape_str(shape_) + " accessed as " +
                     dtype_name(want));
}

void Tensor::check_view(std::int64_t rows, std::int64_t cols) const {
  if (rows < 0 || cols < 0 || rows * cols != numel())
    throw ShapeError("matrix view " + std::to_string(rows) + "x" + std::to_string(cols) + " of tensor " +
                     shape_str(shape_) + " (" + std::to_string(numel()) + " elements)");
}

}  // namespace twin
