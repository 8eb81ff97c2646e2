// A tiny strided n-d array of doubles with torch's reshape / permute / pad / cat / slicing
// semantics, used as an independent oracle: the tests write Retro's Python steps literally with
// it and compare against the reference's index arithmetic.
#pragma once

#include <cstdint>
#include <numeric>
#include <stdexcept>
#include <vector>

#include "core/tensor.h"

namespace twin::test {

struct Nd {
  std::vector<std::int64_t> shape;
  std::vector<double> v;  // contiguous, row-major

  static Nd from(const Tensor& t) { return Nd{t.shape(), t.to_f64()}; }
  std::int64_t numel() const {
    return std::accumulate(shape.begin(), shape.end(), std::int64_t{1}, std::multiplies<>());
  }
  Tensor to_tensor(DType dt = DType::F64) const { return Tensor::from_doubles(dt, shape, v); }

  Nd reshape(std::vector<std::int64_t> s) const {
    std::int64_t neg = -1, prod = 1;
    for (std::size_t i = 0; i < s.size(); ++i) {
      if (s[i] == -1)
        neg = static_cast<std::int64_t>(i);
      else
        prod *= s[i];
    }
    if (neg >= 0) s[static_cast<std::size_t>(neg)] = numel() / prod;
    Nd r{s, v};
    if (r.numel() != numel()) throw std::invalid_argument("Nd::reshape: element count");
    return r;
  }
  // torch.permute(...).contiguous()
  Nd permute(const std::vector<int>& p) const {
    const std::size_t n = shape.size();
    std::vector<std::int64_t> stride(n, 1), ns(n), nstride(n);
    for (std::size_t i = n - 1; i-- > 0;) stride[i] = stride[i + 1] * shape[i + 1];
    for (std::size_t i = 0; i < n; ++i) {
      ns[i] = shape[static_cast<std::size_t>(p[i])];
      nstride[i] = stride[static_cast<std::size_t>(p[i])];
    }
    Nd r{ns, std::vector<double>(v.size())};
    std::vector<std::int64_t> idx(n, 0);
    for (std::int64_t flat = 0; flat < r.numel(); ++flat) {
      std::int64_t src = 0;
      for (std::size_t i = 0; i < n; ++i) src += idx[i] * nstride[i];
      r.v[static_cast<std::size_t>(flat)] = v[static_cast<std::size_t>(src)];
      for (std::size_t i = n; i-- > 0;) {
        if (++idx[i] < ns[i]) break;
        idx[i] = 0;
      }
    }
    return r;
  }
  // x[a:b] along dim 0
  Nd slice0(std::int64_t a, std::int64_t b) const {
    const std::int64_t inner = shape.empty() ? 1 : numel() / shape[0];
    Nd r{shape, {}};
    r.shape[0] = b - a;
    r.v.assign(v.begin() + a * inner, v.begin() + b * inner);
    return r;
  }
  // torch.nn.functional.pad along dim 0: `before` zeros in front, `after` behind.
  Nd pad0(std::int64_t before, std::int64_t after) const {
    const std::int64_t inner = numel() / shape[0];
    Nd r{shape, std::vector<double>(static_cast<std::size_t>(before * inner), 0.0)};
    r.shape[0] += before + after;
    r.v.insert(r.v.end(), v.begin(), v.end());
    r.v.resize(static_cast<std::size_t>(r.numel()), 0.0);
    return r;
  }
  static Nd cat0(const Nd& a, const Nd& b) {
    Nd r = a;
    r.shape[0] += b.shape[0];
    r.v.insert(r.v.end(), b.v.begin(), b.v.end());
    return r;
  }
  // x[:, :, k] of a rank-4 array -> rank 3
  Nd select2(std::int64_t k) const {
    Nd r{{shape[0], shape[1], shape[3]}, {}};
    for (std::int64_t a = 0; a < shape[0]; ++a)
      for (std::int64_t b = 0; b < shape[1]; ++b)
        for (std::int64_t c = 0; c < shape[3]; ++c)
          r.v.push_back(v[static_cast<std::size_t>(((a * shape[1] + b) * shape[2] + k) * shape[3] + c)]);
    return r;
  }
  // torch.stack(xs, dim=1) of rank-3 arrays
  static Nd stack1(const std::vector<Nd>& xs) {
    const auto& s = xs[0].shape;
    Nd r{{s[0], static_cast<std::int64_t>(xs.size()), s[1], s[2]}, {}};
    for (std::int64_t a = 0; a < s[0]; ++a)
      for (const Nd& x : xs)
        for (std::int64_t j = 0; j < s[1] * s[2]; ++j)
          r.v.push_back(x.v[static_cast<std::size_t>(a * s[1] * s[2] + j)]);
    return r;
  }
};

}  // namespace twin::test
