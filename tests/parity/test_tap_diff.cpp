// Tap-by-tap diff and the numerics-derived bounds.
#include <gtest/gtest.h>

#include <cmath>

#include "parity/bounds.h"
#include "parity/tap_diff.h"

using namespace twin;
using namespace twin::parity;

namespace {
Tensor vec(std::vector<float> v) { return Tensor::from_vector<float>({static_cast<std::int64_t>(v.size())}, v); }
Tolerance fp32(const RecordEntry&, const Tensor&) { return Tolerance::for_dtype(DType::F32); }
Record taps(const std::vector<std::pair<std::string, Tensor>>& list) {
  Record r;
  for (const auto& [n, t] : list) r.add(Role::Tap, n, t);
  return r;
}
}  // namespace

TEST(TapDiff, NamesTheFirstTapOutOfTolerance) {
  const Record expected = taps({{"input_layernorm", vec({1, 2, 3})},
                                {"self_attention.linear_qkv.0", vec({4, 5, 6})},
                                {"self_attention.core_attention", vec({7, 8, 9})},
                                {"mlp.0", vec({1, 1, 1})}});
  Record actual = expected;
  actual.entries[1].value = vec({4, 5.01f, 6});  // diverges here ...
  actual.entries[3].value = vec({1, 2, 1});      // ... and later
  const TapDiff d = diff_taps(actual, expected, fp32);
  ASSERT_EQ(d.rows.size(), 4u);
  EXPECT_EQ(d.first_divergence, 1);
  EXPECT_EQ(d.first_divergence_name(), "tap.self_attention.linear_qkv.0");
  EXPECT_TRUE(d.rows[0].pass);
  EXPECT_TRUE(d.rows[2].pass);
  EXPECT_FALSE(d.rows[3].pass);
  EXPECT_EQ(d.rows[1].worst_index, 1);
  EXPECT_NE(d.format().find("self_attention.linear_qkv.0"), std::string::npos);
  EXPECT_NE(d.format().find("first divergence"), std::string::npos);
  EXPECT_TRUE(diff_taps(expected, expected, fp32).pass());
}

TEST(TapDiff, AMissingTapIsADivergenceAndAnExtraTapIsNotCompared) {
  const Record expected = taps({{"a", vec({1})}, {"b", vec({2})}});
  const Record actual = taps({{"a", vec({1})}, {"c", vec({2})}});
  const TapDiff d = diff_taps(actual, expected, fp32);
  ASSERT_EQ(d.rows.size(), 2u);  // a, then b (missing); c is a tap the expected run did not record
  EXPECT_EQ(d.first_divergence_name(), "tap.b");
  EXPECT_NE(d.rows[1].message.find("produces no tensor"), std::string::npos) << d.rows[1].message;
  EXPECT_FALSE(d.pass());
}

// An output (or aux value) only the actual run has is a failure: it claims what nothing confirms.
TEST(TapDiff, AnExtraOutputFails) {
  Record expected = taps({{"a", vec({1})}});
  Record actual = expected;
  actual.add(Role::Output, "hidden_states", vec({1}));
  const TapDiff d = diff_taps(actual, expected, fp32);
  ASSERT_EQ(d.rows.size(), 2u);
  EXPECT_EQ(d.first_divergence_name(), "output.hidden_states");
  EXPECT_NE(d.rows[1].message.find("golden has none"), std::string::npos) << d.rows[1].message;
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

// The golden bound from a count, written out from its definition: eps = sum n u + 2 gamma_R(fp32)
// with gamma_R = R u / (1 - R u); atol = eps max|e| (or the entry's magnitude), rtol = eps.
TEST(Bounds, GoldenBoundFollowsTheCount) {
  RecordEntry e;
  e.rounding.bf16 = 3;
  e.rounding.fp32 = 2;
  e.rounding.reduction = 100;
  const double u8 = std::ldexp(1.0, -8), u24 = std::ldexp(1.0, -24);
  const double eps = 3 * u8 + 2 * u24 + 2 * (100 * u24 / (1 - 100 * u24));
  const Tolerance t = golden_bound(e, vec({-4, 1}));
  EXPECT_DOUBLE_EQ(t.rtol, eps);
  EXPECT_DOUBLE_EQ(t.atol, 4 * eps);
  EXPECT_NE(t.reason.find("3 bf16 + 2 fp32 stores"), std::string::npos) << t.reason;
  EXPECT_NE(t.reason.find("gamma_100"), std::string::npos) << t.reason;
  e.magnitude = 10.0;  // the magnitude its error follows, when not its own
  EXPECT_DOUBLE_EQ(golden_bound(e, vec({-4, 1})).atol, 10 * eps);
  // No rounding point before it (a parameter): exact.
  const Tolerance exact = golden_bound(RecordEntry{}, vec({1}));
  EXPECT_EQ(exact.atol, 0.0);
  EXPECT_EQ(exact.rtol, 0.0);
}
