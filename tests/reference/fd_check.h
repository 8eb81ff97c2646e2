// The finite-difference properties of the reference's backward (dense, MoE, Retro): ggml's
// test-backend-ops gradient mode, run in fp64 exact mode. What the three share: the case ids and
// the verdict of one probe.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

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

}  // namespace twin::test
