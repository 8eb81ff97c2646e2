// Helpers for the dense reference tests: small configs, random parameters and inputs, and a
// straightforward (naive) attention used as an independent oracle.
#pragma once

#include <gtest/gtest.h>
#include <rapidcheck.h>

#include <cmath>
#include <cstdint>
#include <map>
#include <random>
#include <string>

#include "core/config.h"
#include "core/tensor.h"
#include "reference/precision.h"

namespace twin::reference::testing {

inline TransformerConfig small_config(int hidden = 16, int heads = 2, int groups = 2, int ffn = 32) {
  TransformerConfig c;
  c.num_layers = 2;
  c.hidden_size = hidden;
  c.num_attention_heads = heads;
  c.num_query_groups = groups;
  c.kv_channels = hidden / heads;
  c.ffn_hidden_size = ffn;
  c.hidden_dropout = 0.0;
  c.attention_dropout = 0.0;
  c.seq_length = 6;
  c.micro_batch_size = 2;
  return c;
}

// An attention config of np heads in ng groups of hn channels in dtype dt, with the softmax
// knobs the attention tests vary (fp32 softmax, query-key layer scaling, a learnable sink).
inline TransformerConfig attention_config(int np, int ng, int hn, DType dt, bool softmax_in_fp32, bool layer_scaling,
                                          bool learnable_sink) {
  TransformerConfig c = small_config(np * hn, np, ng, 32);
  c.kv_channels = hn;
  c.bf16 = dt == DType::BF16;
  c.fp16 = dt == DType::F16;
  c.attention_softmax_in_fp32 = softmax_in_fp32;
  c.apply_query_key_layer_scaling = layer_scaling;
  if (learnable_sink) c.softmax_type = "learnable";
  return c;
}

// Values exactly representable in fp32 (so Exact and FP32 modes read the same parameters).
inline Mat random_mat(std::mt19937_64& g, std::int64_t rows, std::int64_t cols, double scale = 1.0) {
  std::normal_distribution<double> n(0.0, scale);
  Mat m(rows, cols);
  for (Eigen::Index i = 0; i < m.size(); ++i) m.data()[i] = static_cast<float>(n(g));
  return m;
}

inline Tensor mat_tensor(const Mat& m, Shape shape, DType dt = DType::F32) {
  return Tensor::from_doubles(dt, std::move(shape), std::vector<double>(m.data(), m.data() + m.size()));
}

inline Tensor random_tensor(std::mt19937_64& g, Shape shape, double scale = 1.0) {
  const std::int64_t n = shape_numel(shape);
  return mat_tensor(random_mat(g, 1, n, scale), std::move(shape));
}

inline double max_abs_diff(const Tensor& a, const Tensor& b) {
  const auto x = a.to_f64(), y = b.to_f64();
  if (x.size() != y.size()) return INFINITY;
  double m = 0.0;
  for (std::size_t i = 0; i < x.size(); ++i) m = std::max(m, std::abs(x[i] - y[i]));
  return m;
}

inline double max_abs_diff(const Mat& a, const Mat& b) {
  if (a.rows() != b.rows() || a.cols() != b.cols()) return INFINITY;
  if (a.size() == 0) return 0.0;
  return (a - b).cwiseAbs().maxCoeff();
}

// Exact-mode policy: comparisons of two formulations of the same math differ only by double
// rounding (~1e-15 relative), so tests of equalities use a 1e-10 bound.
inline Precision exact() { return Precision{ComputeMode::Exact, DType::F32}; }
constexpr double kExactTol = 1e-10;

// Expects `fn` to throw E whose message contains every needle.
template <class E, class Fn>
::testing::AssertionResult throws_with(Fn&& fn, std::initializer_list<std::string> needles) {
  try {
    fn();
  } catch (const E& e) {
    const std::string msg = e.what();
    for (const auto& n : needles)
      if (msg.find(n) == std::string::npos)
        return ::testing::AssertionFailure() << "message '" << msg << "' lacks '" << n << "'";
    return ::testing::AssertionSuccess();
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "threw a different exception: " << e.what();
  }
  return ::testing::AssertionFailure() << "did not throw";
}

}  // namespace twin::reference::testing
