// Host tensor: a shape, a dtype and bytes that are either owned or borrowed from a mapping
// (a memory-mapped safetensors file), kept alive by a shared holder. Row-major, contiguous.
//
// Misuse (wrong dtype for data<T>(), wrong element count for reshape or a view) throws
// twin::ShapeError naming both shapes or dtypes: never undefined behaviour.
#pragma once

#include <Eigen/Core>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/dtype.h"

namespace twin {

using Shape = std::vector<std::int64_t>;
std::string shape_str(const Shape& s);  // "[16, 2, 64]"
std::int64_t shape_numel(const Shape& s);

struct ShapeError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

template <class T>
using RowMatrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <class T>
using MatrixMap = Eigen::Map<RowMatrix<T>>;
template <class T>
using ConstMatrixMap = Eigen::Map<const RowMatrix<T>>;

class Tensor {
 public:
  Tensor() = default;
  static Tensor empty(DType dt, Shape shape);
  static Tensor zeros(DType dt, Shape shape);
  // Borrowed bytes: `holder` keeps the memory alive (e.g. the mapping of a file).
  static Tensor borrow(DType dt, Shape shape, std::shared_ptr<const void> holder, const void* data);
  template <class T>
  static Tensor from_vector(Shape shape, const std::vector<T>& values);
  // Converts doubles to dt with round-to-nearest-even (the one rounding of each value).
  static Tensor from_doubles(DType dt, Shape shape, const std::vector<double>& values);

  bool defined() const { return static_cast<bool>(holder_); }
  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  int dim() const { return static_cast<int>(shape_.size()); }
  std::int64_t size(int d) const;  // negative d counts from the end
  std::int64_t numel() const { return shape_numel(shape_); }
  std::size_t nbytes() const { return static_cast<std::size_t>(numel()) * dtype_size(dtype_); }
  bool is_borrowed() const { return borrowed_; }

  const std::byte* raw() const { return data_; }
  std::byte* raw_mut();  // copies borrowed storage first, so a mapped file is never written

  template <class T>
  const T* data() const {
    check_dtype(dtype_of<T>::value);
    return reinterpret_cast<const T*>(data_);
  }
  template <class T>
  T* data_mut() {
    check_dtype(dtype_of<T>::value);
    return reinterpret_cast<T*>(raw_mut());
  }

  // Value at flat index as double (any dtype; bool -> 0/1).
  double at_f64(std::int64_t flat) const;
  std::vector<double> to_f64() const;
  // Elements [begin, begin + n) as doubles into out / from doubles (RNE for narrowing floats; a
  // borrowed tensor is copied first, as raw_mut does). ShapeError when the range is not inside.
  void read_f64(std::int64_t begin, std::int64_t n, double* out) const;
  void write_f64(std::int64_t begin, std::int64_t n, const double* values);
  Tensor to(DType dt) const;  // value conversion (RNE for narrowing floats)
  Tensor clone() const;
  Tensor reshape(Shape shape) const;  // shares storage; element counts must agree

  // Throws ShapeError "<what>: expected shape [..] (F32), got [..] (BF16)" unless equal.
  void expect(const Shape& shape, const std::string& what) const;
  void expect(const Shape& shape, DType dt, const std::string& what) const;

  // 2-D views over contiguous storage: rows x cols must equal numel.
  template <class T>
  ConstMatrixMap<T> matrix(std::int64_t rows, std::int64_t cols) const {
    check_view(rows, cols);
    return ConstMatrixMap<T>(data<T>(), rows, cols);
  }
  template <class T>
  MatrixMap<T> matrix_mut(std::int64_t rows, std::int64_t cols) {
    check_view(rows, cols);
    return MatrixMap<T>(data_mut<T>(), rows, cols);
  }
  // [..., last] viewed as (numel / last) x last.
  template <class T>
  ConstMatrixMap<T> rows_view() const {
    return matrix<T>(numel() / last_dim(), last_dim());
  }

  std::string describe() const;  // "[16, 2, 64] F32"

 private:
  void check_dtype(DType want) const;
  void check_view(std::int64_t rows, std::int64_t cols) const;
  void check_range(std::int64_t begin, std::int64_t n) const;
  std::int64_t last_dim() const { return shape_.empty() ? 1 : (shape_.back() == 0 ? 1 : shape_.back()); }

  DType dtype_ = DType::F32;
  Shape shape_;
  std::shared_ptr<const void> holder_;
  std::byte* data_ = nullptr;
  bool borrowed_ = false;
};

template <class T>
Tensor Tensor::from_vector(Shape shape, const std::vector<T>& values) {
  if (static_cast<std::int64_t>(values.size()) != shape_numel(shape))
    throw ShapeError("Tensor::from_vector: " + std::to_string(values.size()) + " values for shape " + shape_str(shape));
  Tensor t = empty(dtype_of<T>::value, std::move(shape));
  if (!values.empty()) std::memcpy(t.data_, values.data(), values.size() * sizeof(T));
  return t;
}
template <>
Tensor Tensor::from_vector<bool>(Shape shape, const std::vector<bool>& values);

}  // namespace twin
