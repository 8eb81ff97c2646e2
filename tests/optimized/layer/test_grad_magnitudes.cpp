// optimized/layer/grad_magnitudes.h: weight_magnitude (a GEMM of |dy|^T |x| in blocks of 256 of its
// rows) is the naive triple sum's max within fp64 rounding, across the block boundary.
#include "optimized/layer/grad_magnitudes.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <random>
#include <vector>

namespace twin::opt {
namespace {

TEST(GradMagnitudes, WeightMagnitudeIsTheLargestSumOverRowsOfAbsoluteProducts) {
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (const auto [rows, out, in] : {std::array<std::int64_t, 3>{1, 1, 1}, {7, 300, 5}, {33, 257, 19}, {0, 4, 4}}) {
    std::vector<double> dy(std::size_t(rows * out)), x(std::size_t(rows * in));
    for (double& v : dy) v = u(rng);
    for (double& v : x) v = u(rng);
    if (!dy.empty()) dy[dy.size() - 1] = 50.0;  // the largest sum in the last block's last row
    double want = 0.0;
    for (std::int64_t o = 0; o < out; ++o)
      for (std::int64_t i = 0; i < in; ++i) {
        double s = 0.0;
        for (std::int64_t r = 0; r < rows; ++r) s += dy[std::size_t(r * out + o)] * x[std::size_t(r * in + i)];
        want = std::max(want, s);
      }
    const double got = weight_magnitude(dy, x, rows, out, in);
    EXPECT_NEAR(got, want, 1e-12 * std::max(1.0, want)) << rows << " x " << out << " x " << in;
  }
}

}  // namespace
}  // namespace twin::opt
