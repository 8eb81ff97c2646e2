// Tap-by-tap diff and the numerics-derived bounds.
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "tests/case_id.h"
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

namespace {

// fp32 dot product accumulated in order (what an fp32 reduction does), and the exact value: each
// product of two floats is exact in double, so the double sum is exact up to gamma_n(2^-53).
struct Dot {
  double fp32, exact, abs_sum;
};
Dot dot(const std::vector<float>& a, const std::vector<float>& b) {
  float acc = 0.0f;
  double exact = 0.0, abs_sum = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const float prod = a[i] * b[i];
    acc = acc + prod;
    exact += static_cast<double>(a[i]) * b[i];
    abs_sum += std::abs(static_cast<double>(a[i]) * b[i]);
  }
  return {acc, exact, abs_sum};
}

double stored_in(DType dt, double v) { return Tensor::from_doubles(dt, {1}, {v}).at_f64(0); }

}  // namespace

namespace {
// One bound case: a length n (the dot product's), a dtype (the stores'), the seed of the values.
struct BoundCase : twin::proptest::PropertyCase {
  static constexpr const char* kKind = "bound";
  int n = 1;
  DType dtype = DType::F32;
  std::uint64_t seed = 0;
  template <class V>
  void fields(V& v) {
    v("n", n);
    v("dtype", dtype);
    v("seed", seed);
  }
};
// dtypes: fp32 | bf16 | fp16 drawn, n = 1; else fp32 and n in [1, 5000).
rc::Gen<BoundCase> gen_bound_case(bool dtypes) {
  return twin::proptest::rerunnable<BoundCase>(rc::gen::exec([dtypes] {
    BoundCase c;
    if (dtypes)
      c.dtype = *twin::proptest::gen_case_dtype();
    else
      c.n = *rc::gen::inRange(1, 5000);
    c.seed = *rc::gen::arbitrary<std::uint32_t>();
    return c;
  }));
}
}  // namespace

// gamma_n is the bound of recursive summation (Higham, Accuracy and Stability of Numerical
// Algorithms, 2nd ed., section 3.1): an fp32 dot product of length n is within
// gamma_n(2^-24) sum |a_i b_i| of the exact value, here on random vectors of mixed sign and
// magnitude, against the exact sum (plus the double sum's own gamma_n(2^-53)).
RC_GTEST_PROP(Bounds, GammaBoundsAnFp32DotProduct, ()) {
  const BoundCase bc = *gen_bound_case(false);
  const int n = bc.n;
  std::mt19937_64 g(bc.seed);
  std::normal_distribution<double> nd(0.0, 1.0);
  std::uniform_int_distribution<int> ex(-6, 6);
  std::vector<float> a(n), b(n);
  for (int i = 0; i < n; ++i) {
    a[i] = static_cast<float>(std::ldexp(nd(g), ex(g)));
    b[i] = static_cast<float>(nd(g));
  }
  const Dot d = dot(a, b);
  const double u32 = std::ldexp(1.0, -24), u64 = std::ldexp(1.0, -53);
  RC_ASSERT(std::abs(d.fp32 - d.exact) <= (gamma_n(n, u32) + gamma_n(n, u64)) * d.abs_sum);
}

// The bound is attained to within a factor of two, so it is not vacuous: 1 followed by n - 1 terms
// of 0.75 u each. In order, every add rounds back to 1 (the term is below half an ulp of 1, which
// is 2u = 2^-23); the exact sum is 1 + 0.75 (n - 1) u, an error of 0.75 (n - 1) u of a sum ~1.
// Reversed, the small terms add up exactly first. So two orders of one fp32 reduction differ by
// that much: more than the default fp32 atol at n = 4096, and within reduction_bound's 2 gamma_n.
TEST(Bounds, GammaIsAttainedAndTwoSummationOrdersStayWithinTheReductionBound) {
  const double u32 = std::ldexp(1.0, -24);
  for (int n : {64, 1024, 4096}) {
    std::vector<float> a(n, static_cast<float>(0.75 * u32)), ones(n, 1.0f);
    a[0] = 1.0f;
    const Dot forward = dot(a, ones);
    std::vector<float> rev(a.rbegin(), a.rend());
    const Dot backward = dot(rev, ones);
    EXPECT_EQ(forward.fp32, 1.0) << n;
    const double err = std::abs(forward.fp32 - forward.exact);
    EXPECT_LE(err, gamma_n(n, u32) * forward.abs_sum) << n;
    EXPECT_GE(err, 0.5 * gamma_n(n, u32) * forward.abs_sum) << n;
    const double orders = std::abs(forward.fp32 - backward.fp32);
    const Tolerance t = reduction_bound(DType::F32, n, forward.abs_sum);
    EXPECT_LE(orders, t.atol + t.rtol * std::abs(backward.fp32)) << n << ": " << t.reason;
    EXPECT_NE(t.reason.find("gamma_" + std::to_string(n)), std::string::npos) << t.reason;
    if (n == 4096) {  // the default fp32 tolerance alone would call these two correct sums different
      const Tolerance def = Tolerance::for_dtype(DType::F32);
      EXPECT_GT(orders, def.atol + def.rtol * std::abs(backward.fp32));
    }
  }
  EXPECT_EQ(max_abs(vec({-3, 2})), 3.0);
  EXPECT_EQ(max_abs_diff(vec({1, 2}), vec({1, 4})), 2.0);
  EXPECT_THROW(max_abs_diff(vec({1}), vec({1, 2})), ShapeError);
}

// reference_error_bound's claim: two implementations, each within the reference's error e of the
// exact value and each storing its result in dt, agree within the bound (triangle inequality, plus
// a rounding of each store). Checked on values whose errors point opposite ways, the worst case,
// where the two differ by about 2 e: with e far above the dtype's default tolerance, the default
// alone rejects them, the bound accepts them.
RC_GTEST_PROP(Bounds, ReferenceErrorBoundCoversTwoImplementationsWithinTheReferenceError, ()) {
  const BoundCase bc = *gen_bound_case(true);
  const DType dt = bc.dtype;
  std::mt19937_64 g(bc.seed);
  std::uniform_real_distribution<double> unit(-1.0, 1.0);
  const double magnitude = 4.0;
  const double exact = magnitude * 0.9 * unit(g);
  const double e = 0.1 * std::abs(unit(g));  // the reference's max error vs fp64
  const Tolerance t = reference_error_bound(dt, e, magnitude);
  const double d1 = e * unit(g), d2 = e * unit(g);
  const double a = stored_in(dt, exact + d1), b = stored_in(dt, exact + d2);
  RC_ASSERT(std::abs(a - b) <= t.atol + t.rtol * std::abs(b));
  // Opposite extremes: |a - b| ~ 2 e.
  const double hi = stored_in(dt, exact + e), lo = stored_in(dt, exact - e);
  RC_ASSERT(std::abs(hi - lo) <= t.atol + t.rtol * std::abs(lo));
  const Tolerance def = Tolerance::for_dtype(dt);
  // 2 e minus the two stores' rounding (<= 2 u 3.7, 0.029 in bf16) exceeds the largest default
  // (bf16: 1e-5 + 0.016 x 3.7) once e > 0.05.
  if (e > 0.05) RC_ASSERT(std::abs(hi - lo) > def.atol + def.rtol * std::abs(lo));
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

// Block magnitudes (one per block of the last dim: a core attention output's per (token, head))
// give each element its own block's atol, eps x its magnitude: an error within one block's bound
// fails in a block of smaller magnitude.
TEST(Bounds, BlockMagnitudesGiveEachBlockItsOwnAtol) {
  RecordEntry e;
  e.rounding.bf16 = 1;
  const double eps = std::ldexp(1.0, -8);
  const Tensor expected = Tensor::from_doubles(DType::F32, {2, 4}, {0, 0, 0, 0, 0, 0, 0, 0});
  e.block_magnitude = Tensor::from_doubles(DType::F64, {2, 2}, {100, 1, 1, 1});  // blocks of 2
  const Tolerance t = golden_bound(e, expected);
  ASSERT_EQ(t.block, 2);
  ASSERT_EQ(t.atol_blocks.size(), 4u);
  EXPECT_DOUBLE_EQ(t.atol_blocks[0], 100 * eps);
  EXPECT_DOUBLE_EQ(t.atol_blocks[3], eps);
  EXPECT_DOUBLE_EQ(t.atol, 100 * eps);  // the largest, printed
  EXPECT_NE(t.reason.find("per block of 2"), std::string::npos) << t.reason;
  const double err = 50 * eps;
  for (std::int64_t at : {0, 1, 2, 7}) {
    std::vector<double> a(8, 0.0);
    a[std::size_t(at)] = err;
    const Comparison c = compare("x", Tensor::from_doubles(DType::F32, {2, 4}, a), expected, t);
    EXPECT_EQ(c.pass, at < 2) << "error at " << at << ": share " << c.share_used;
  }
  e.block_magnitude = Tensor::from_doubles(DType::F64, {3}, {1, 1, 1});  // 8 elements do not split in 3
  EXPECT_THROW(golden_bound(e, expected), ShapeError);
}
