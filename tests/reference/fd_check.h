// The finite-difference properties of the reference's backward (dense, MoE, Retro): ggml's
// test-backend-ops gradient mode, run in fp64 exact mode. What the three share: the case ids, the
// fp64 draws, the coordinates probed and one probe with its verdict.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace twin::test {

// Case ids 0 .. TWIN_FD_CASES - 1 (default 100), or TWIN_FD_CASE alone (a failure prints it).
inline std::vector<std::uint64_t> fd_case_ids() {
  if (const char* one = std::getenv("TWIN_FD_CASE")) return {std::strtoull(one, nullptr, 10)};
  std::uint64_t n = 100;
  if (const char* count = std::getenv("TWIN_FD_CASES")) n = std::strtoull(count, nullptr, 10);
  std::vector<std::uint64_t> ids(n);
  for (std::uint64_t i = 0; i < n; ++i) ids[i] = i;
  return ids;
}

// The losses at theta +- d and theta +- d/2.
struct CentralDifference {
  double plus, minus, plus2, minus2, d;
  double at_d() const { return (plus - minus) / (2 * d); }
  double at_half_d() const { return (plus2 - minus2) / d; }
};

// The analytic derivative against the central difference at step d/2. Tolerance: the two steps'
// difference (the truncation error, O(d^2), shrinks 4x from d to d/2, so it bounds the rest) plus
// `depth` fp64 roundings on the loss's magnitude over the step and on the analytic value.
// `what` names the probe ("case 3 (...): d L / d param.x[i]"); `id` reruns it.
inline ::testing::AssertionResult central_difference_agrees(double analytic, const CentralDifference& c,
                                                            double magnitude, double depth, const std::string& what,
                                                            std::uint64_t id) {
  const double fd = c.at_d(), fd2 = c.at_half_d();
  const double u64 = std::numeric_limits<double>::epsilon() / 2;
  const double tol = std::fabs(fd - fd2) + depth * u64 * (magnitude / (c.d / 2) + std::fabs(analytic));
  if (std::fabs(analytic - fd2) <= tol) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": analytic " << analytic << ", central difference " << fd2
                                       << " (at d: " << fd << "), |diff| " << std::fabs(analytic - fd2)
                                       << " > tolerance " << tol << "; rerun: TWIN_FD_CASE=" << id;
}

// An fp64 tensor of N(0, scale^2) draws.
inline Tensor f64_tensor(std::mt19937_64& g, Shape shape, double scale) {
  std::normal_distribution<double> n(0.0, scale);
  std::vector<double> v(static_cast<std::size_t>(shape_numel(shape)));
  for (double& x : v) x = n(g);
  return Tensor::from_doubles(DType::F64, std::move(shape), v);
}

// t (fp64) with element i set to v.
inline Tensor with_element(const Tensor& t, std::int64_t i, double v) {
  std::vector<double> d = t.to_f64();
  d[static_cast<std::size_t>(i)] = v;
  return Tensor::from_doubles(DType::F64, t.shape(), d);
}

// The coordinates of one gradient that are probed: the one with the largest |analytic| (where a
// wrong scale shows most), then `random` uniform draws from g.
inline std::vector<std::int64_t> probe_coords(const std::vector<double>& analytic, std::mt19937_64& g, int random) {
  std::int64_t largest = 0;
  for (std::size_t i = 0; i < analytic.size(); ++i)
    if (std::fabs(analytic[i]) > std::fabs(analytic[static_cast<std::size_t>(largest)]))
      largest = static_cast<std::int64_t>(i);
  std::vector<std::int64_t> coords{largest};
  std::uniform_int_distribution<std::int64_t> u(0, static_cast<std::int64_t>(analytic.size()) - 1);
  for (int j = 0; j < random; ++j) coords.push_back(u(g));
  return coords;
}

struct FdTally {
  int compared = 0, excluded = 0;
};

// One probe of the coordinate whose value is theta: run(v) is the forward with it set to v (a
// result with .loss and .magnitude = sum |output * G|), at theta +- d and theta +- d/2 with
// d = 1e-4 max(1, |theta|). excluded(plus, minus, plus2, minus2) says L is not differentiable
// within the step (a kink crossed, the routing changed): then the probe counts as excluded and
// passes; otherwise central_difference_agrees with `depth` judges it.
template <class Run, class Excluded>
::testing::AssertionResult probe_coordinate(double theta, double analytic, const Run& run, const Excluded& excluded,
                                            double depth, const std::string& what, std::uint64_t id, FdTally& tally) {
  const double d = 1e-4 * std::max(1.0, std::fabs(theta));
  const auto plus = run(theta + d), minus = run(theta - d);
  const auto plus2 = run(theta + d / 2), minus2 = run(theta - d / 2);
  if (excluded(plus, minus, plus2, minus2)) {
    ++tally.excluded;
    return ::testing::AssertionSuccess();
  }
  ++tally.compared;
  return central_difference_agrees(analytic, {plus.loss, minus.loss, plus2.loss, minus2.loss, d}, plus.magnitude, depth,
                                   what, id);
}

}  // namespace twin::test
