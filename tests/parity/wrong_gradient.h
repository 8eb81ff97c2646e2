// A fixture test's check that each gradient's counted bound is tight enough to catch a 1% error in
// that gradient alone: one grad.* tensor of the golden scaled by 1.01 fails its row and no other.
// Meant for fp32 goldens, whose bounds are a few 2^-24 per rounding point, far below 1e-2.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "parity/fixture_kinds.h"
#include "parity/golden.h"

namespace twin::test {

inline void expect_each_wrong_gradient_fails_alone(const Fixture& f, const TwinRun& run, const std::string& twin) {
  ASSERT_TRUE(run.backward) << run.no_backward_reason;
  ASSERT_FALSE(parity::grads_of(f).empty()) << "the golden has no grad.* tensors";
  for (const auto& [name, grad] : parity::grads_of(f)) {
    SCOPED_TRACE(name);
    const std::vector<double> values = grad.to_f64();
    if (std::all_of(values.begin(), values.end(), [](double v) { return v == 0.0; }))
      continue;  // e.g. an expert that got no token: a zero gradient is unchanged by scaling
    parity::Expected expected = parity::expected_of(f);
    for (auto [n, t] : parity::grads_of(f)) {
      if (n == name) {
        std::vector<double> v = t.to_f64();
        for (double& x : v) x *= 1.01;
        t = Tensor::from_doubles(t.dtype(), t.shape(), v);
      }
      expected.emplace_back(n, t);
    }
    for (const auto& c : parity::compare_record(run.record, expected, twin))
      EXPECT_EQ(c.pass, c.name != name) << c.name << ": " << c.tol.reason;
  }
}

}  // namespace twin::test
