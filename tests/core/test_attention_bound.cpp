// core/attention_bound.h: the softmax's amplification of score errors that the core attention
// output's magnitude carries, checked on the math it derives from (a softmax row and v), with no twin.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "core/attention_bound.h"
#include "core/dtype.h"

namespace twin {
namespace {

// context = softmax(x) . v for one row, in double.
double context(const std::vector<double>& x, const std::vector<double>& v) {
  const double m = *std::max_element(x.begin(), x.end());
  double z = 0.0, c = 0.0;
  for (std::size_t j = 0; j < x.size(); ++j) z += std::exp(x[j] - m);
  for (std::size_t j = 0; j < x.size(); ++j) c += std::exp(x[j] - m) / z * v[j];
  return c;
}

// Each score moved by at most u |x_j| (one rounding of a store), in the direction that moves the
// context most (towards v_j above the context, away below it): the change stays within
// u * magnitude - max|v| (the magnitude's part for the score's rounding), over rows from flat to
// sharply peaked (largest score up to 64, the range a bf16 layer at s 1024 reaches).
TEST(AttentionBound, ScoreRoundingMovesTheContextWithinTheMagnitude) {
  std::mt19937_64 gen(7);
  const double u = unit_roundoff(DType::BF16);
  double worst_share = 0.0, worst_vs_context = 0.0;
  for (int trial = 0; trial < 2000; ++trial) {
    const int n = 1 + int(gen() % 64);
    const double spread = std::ldexp(1.0, int(gen() % 7));  // scores of size up to 64
    std::uniform_real_distribution<double> score(-spread, spread), value(-4.0, 4.0);
    std::vector<double> x(static_cast<std::size_t>(n)), v(static_cast<std::size_t>(n));
    for (int j = 0; j < n; ++j) x[std::size_t(j)] = score(gen), v[std::size_t(j)] = value(gen);
    const double c = context(x, v);
    std::vector<double> moved = x;
    for (int j = 0; j < n; ++j)
      moved[std::size_t(j)] += (v[std::size_t(j)] > c ? 1.0 : -1.0) * u * std::fabs(x[std::size_t(j)]);
    const double change = std::fabs(context(moved, v) - c);
    double max_v = 0.0;
    for (double vj : v) max_v = std::max(max_v, std::fabs(vj));
    const double m = *std::max_element(x.begin(), x.end());
    const double allowed = u * (core_attention_error_magnitude(max_v, softmax_row_amplification(m, n)) - max_v);
    EXPECT_LE(change, allowed * (1.0 + 1e-9)) << "trial " << trial << " n " << n << " spread " << spread;
    worst_share = std::max(worst_share, change / allowed);
    worst_vs_context = std::max(worst_vs_context, change / (u * std::max(max_v, 1e-300)));
  }
  // The bound is not vacuous, and the amplification is real: some rows move their context by
  // several roundings of max |v|, which a magnitude of max |context| (<= max |v|) misses.
  EXPECT_GT(worst_share, 0.1);
  EXPECT_GT(worst_vs_context, 4.0);
}

TEST(AttentionBound, RowsOfFillsOnlyAndEmptyRowsAddNothing) {
  EXPECT_EQ(softmax_row_amplification(-10000.0, 8), 0.0);
  EXPECT_EQ(softmax_row_amplification(-9984.0, 8), 0.0);  // -10000 stored in bf16
  EXPECT_EQ(softmax_row_amplification(3.0, 0), 0.0);
  EXPECT_DOUBLE_EQ(softmax_row_amplification(-3.0, 8), 3.0 + std::log(8.0));
  EXPECT_DOUBLE_EQ(core_attention_error_magnitude(2.0, 0.0), 2.0);
  EXPECT_DOUBLE_EQ(core_attention_error_magnitude(2.0, 1.5, 0.5), 2.0 * 4.0 / 0.5);
}

// The statistics form gives each query row its own term (the first of its row's pair) with its
// head's group's max |v|, in the context's order [sq, b, heads].
TEST(AttentionBound, StatisticsFormPairsEachRowWithItsHeadsValues) {
  // b 1, 2 heads, 2 query rows: head 0's rows |m| = 5 and fills only, head 1's 1 and 0.5
  const Tensor stats = Tensor::from_doubles(DType::F32, {1, 2, 2, 2}, {-5.0, 9, -10000.0, 9, 1.0, 9, 0.5, 9});
  // sk 1, b 1, 2 groups of [k k | v v]: group 0's max |v| 3, group 1's 4 (the k columns hold more)
  const Tensor values = Tensor::from_doubles(DType::F32, {1, 1, 2, 4}, {50, -60, 1, -3, 70, 80, 4, 0.5});
  const double ln4 = std::log(4.0);
  const Tensor m = core_attention_error_magnitudes(stats, 4, values, 2, 0.0);
  ASSERT_EQ(m.shape(), (Shape{2, 1, 2}));
  EXPECT_DOUBLE_EQ(m.at_f64(0), core_attention_error_magnitude(3.0, 5.0 + ln4));  // row 0, head 0
  EXPECT_DOUBLE_EQ(m.at_f64(1), core_attention_error_magnitude(4.0, 1.0 + ln4));  // row 0, head 1
  EXPECT_DOUBLE_EQ(m.at_f64(2), 3.0);                                             // row 1, head 0: fills only
  EXPECT_DOUBLE_EQ(m.at_f64(3), core_attention_error_magnitude(4.0, 0.5 + ln4));  // row 1, head 1
  // one group for both heads, and dropout
  const Tensor shared = Tensor::from_doubles(DType::F32, {1, 1, 1, 4}, {50, -60, 1, -4});
  EXPECT_DOUBLE_EQ(core_attention_error_magnitudes(stats, 4, shared, 2, 0.5).at_f64(1),
                   core_attention_error_magnitude(4.0, 1.0 + ln4, 0.5));
  EXPECT_THROW(core_attention_error_magnitudes(stats, 4, values, 5, 0.0), ShapeError);
  EXPECT_THROW(core_attention_error_magnitudes(stats.reshape({2, 2, 2}), 4, values, 2, 0.0), ShapeError);
}

}  // namespace
}  // namespace twin
