// Tap-by-tap diff and the numerics-derived bounds.
#include <gtest/gtest.h>

#include "parity/bounds.h"
#include "parity/tap_diff.h"

using namespace twin;
using namespace twin::parity;

namespace {
Tensor vec(std::vector<float> v) { return Tensor::from_vector<float>({static_cast<std::int64_t>(v.size())}, v); }
Tolerance fp32(const std::string&, const Tensor&) { return Tolerance::for_dtype(DType::F32); }
}  // namespace

TEST(TapDiff, NamesTheFirstTapOutOfTolerance) {
  const TapList expected = {{"input_layernorm", vec({1, 2, 3})},
                            {"self_attention.linear_qkv.0", vec({4, 5, 6})},
                            {"self_attention.core_attention", vec({7, 8, 9})},
                            {"mlp.0", vec({1, 1, 1})}};
  TapList actual = expected;
  actual[1].second = vec({4, 5.01f, 6});  // diverges here ...
  actual[3].second = vec({1, 2, 1});      // ... and later
  const TapDiff d = diff_taps(actual, expected, fp32);
  ASSERT_EQ(d.rows.size(), 4u);
  EXPECT_EQ(d.first_divergence, 1);
  EXPECT_EQ(d.first_divergence_name(), "self_attention.linear_qkv.0");
  EXPECT_TRUE(d.rows[0].pass);
  EXPECT_TRUE(d.rows[2].pass);
  EXPECT_FALSE(d.rows[3].pass);
  EXPECT_EQ(d.rows[1].worst_index, 1);
  EXPECT_NE(d.format().find("self_attention.linear_qkv.0"), std::string::npos);
  EXPECT_NE(d.format().find("first divergence"), std::string::npos);
  EXPECT_EQ(first_divergence(expected, expected, fp32), "");
  EXPECT_TRUE(diff_taps(expected, expected, fp32).pass());
}

TEST(TapDiff, AMissingTapIsADivergenceAndExtraTapsAreListed) {
  const TapList expected = {{"a", vec({1})}, {"b", vec({2})}};
  const TapList actual = {{"a", vec({1})}, {"c", vec({2})}};
  const TapDiff d = diff_taps(actual, expected, fp32);
  EXPECT_EQ(d.first_divergence_name(), "b");
  EXPECT_EQ(d.rows[1].message, "missing in actual");
  ASSERT_EQ(d.extra.size(), 1u);
  EXPECT_EQ(d.extra[0], "c");
  EXPECT_FALSE(d.pass());
}

TEST(Bounds, GammaAndReductionBoundGrowWithLength) {
  const double u = unit_roundoff(DType::F32);
  EXPECT_NEAR(gamma_n(10, u), 10 * u / (1 - 10 * u), 1e-20);
  const Tolerance t64 = reduction_bound(DType::F32, 64, 1.0), t4096 = reduction_bound(DType::F32, 4096, 1.0);
  EXPECT_GT(t4096.atol, t64.atol);
  EXPECT_EQ(t64.rtol, Tolerance::for_dtype(DType::F32).rtol);
  EXPECT_NE(t64.reason.find("gamma_64"), std::string::npos);
  // A fp32 sum of 4096 unit terms in two orders can differ by far more than the default atol.
  EXPECT_GT(t4096.atol, 1e-4);
  const Tolerance r = reference_error_bound(DType::BF16, 0.25, 2.0);
  EXPECT_DOUBLE_EQ(r.atol, Tolerance::for_dtype(DType::BF16).atol + 0.5 + 2.0 * 2.0 * unit_roundoff(DType::BF16));
  EXPECT_EQ(max_abs(vec({-3, 2})), 3.0);
  EXPECT_EQ(max_abs_diff(vec({1, 2}), vec({1, 4})), 2.0);
  EXPECT_THROW(max_abs_diff(vec({1}), vec({1, 2})), ShapeError);
}
