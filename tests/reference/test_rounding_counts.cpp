// The reference counts the rounding points it executes (reference/precision.h count_*), once per
// tensor, where each `rounds:` mark stores: each module's count is written out here from the
// torch ops Megatron runs, so a rounding point added to or dropped from a module without its count
// fails here.
#include <gtest/gtest.h>

#include <functional>
#include <random>

#include "reference/linear.h"
#include "reference/torch_norm.h"
#include "tests/reference/dense_test_util.h"

namespace twin::reference {
namespace {

using testing::random_mat;

Precision bf16() { return Precision{ComputeMode::FP32, DType::BF16}; }

RoundingCount count_of(const std::function<void()>& run) {
  CountRoundings counting;
  run();
  return rounding_now();
}

TEST(RoundingCounts, LinearWithBiasStoresTheGemmAndTheSum) {
  std::mt19937_64 g(1);
  Linear lin(8, 4, /*bias=*/true, /*skip_bias_add=*/false, bf16());
  const RoundingCount r = count_of([&] { lin.forward(random_mat(g, 3, 8)); });
  EXPECT_EQ(r.bf16, 2);       // x @ w^T, then + bias
  EXPECT_EQ(r.reduction, 8);  // one fp32-accumulated dot product of length in_features
  EXPECT_EQ(r.fp32, 0);
  Linear skip(8, 4, true, /*skip_bias_add=*/true, bf16());
  EXPECT_EQ(count_of([&] { skip.forward(random_mat(g, 3, 8)); }).bf16, 1);  // the bias is returned, not added
}

TEST(RoundingCounts, NormsCountTheStoresOfTorchsCpuKernels) {
  std::mt19937_64 g(2);
  LayerNorm ln(16, 1e-5, false, bf16());
  RoundingCount r = count_of([&] { ln.forward(random_mat(g, 3, 16)); });
  EXPECT_EQ(r.fp32, 0);        // torch 1.13 CPU keeps the statistics in bf16, not fp32:
  EXPECT_EQ(r.bf16, 5);        // mean, variance, rstd, the shift -rstd * mean, the output
  EXPECT_EQ(r.reduction, 32);  // mean and variance over 16
  RMSNorm rms(16, 1e-5, false, bf16());
  r = count_of([&] { rms.forward(random_mat(g, 3, 16)); });
  EXPECT_EQ(r.fp32, 1);  // rstd
  EXPECT_EQ(r.bf16, 2);  // x * rstd (torch's rms_norm casts back), then * weight
  EXPECT_EQ(r.reduction, 16);
}

TEST(RoundingCounts, ExactModeCountsNothing) {
  std::mt19937_64 g(3);
  Linear lin(8, 4, true, false, testing::exact());
  EXPECT_TRUE(count_of([&] { lin.forward(random_mat(g, 3, 8)); }).none());
}

}  // namespace
}  // namespace twin::reference
