// Philox 4x32-10 and dropout / bias-dropout-add (reference/philox.h, fused_bias_dropout.h).
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include "tests/case_id.h"
#include "dense_test_util.h"
#include "reference/fused_bias_dropout.h"
#include "reference/philox.h"

using namespace twin;
using namespace twin::reference;
using namespace twin::reference::testing;

// Known-answer vectors of Random123 (kat_vectors: philox4x32 10 rounds).
TEST(Philox, Random123KnownAnswers) {
  using A4 = std::array<std::uint32_t, 4>;
  EXPECT_EQ(philox4x32_10({0, 0, 0, 0}, {0, 0}), (A4{0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}));
  EXPECT_EQ(philox4x32_10({0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}, {0xffffffffu, 0xffffffffu}),
            (A4{0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}));
  EXPECT_EQ(philox4x32_10({0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}, {0xa4093822u, 0x299f31d0u}),
            (A4{0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}));
}

TEST(Philox, ElementMappingAndThresholds) {
  // element e uses block e / 4 and word e % 4
  const auto r = philox4x32_10({1, 0, 7, 0}, {42, 0});
  for (int i = 0; i < 4; ++i) EXPECT_EQ(philox_word(42, 7, 4 + i), r[i]);
  EXPECT_EQ(dropout_keep_threshold(0.0), 1u << 24);
  EXPECT_EQ(dropout_keep_threshold(1.0), 0u);
  EXPECT_EQ(dropout_keep_threshold(0.5), 1u << 23);
  EXPECT_THROW(dropout_keep_threshold(1.5), std::invalid_argument);
  // keep rate near 1 - p over many elements (binomial: 5 sigma)
  int kept = 0;
  const int n = 40000;
  for (int e = 0; e < n; ++e) kept += dropout_keep(123, 0, e, 0.3);
  EXPECT_NEAR(kept / double(n), 0.7, 5 * std::sqrt(0.21 / n));
}

namespace {
// One dropout-stream case: probability p (tenths), Megatron's stream (rng_seed, offset) and the
// seed of the data. Exact / fp32 modes: what is checked is the mask and the scale.
struct PhiloxCase : proptest::PropertyCase {
  static constexpr const char* kKind = "philox";
  double p = 0.0;
  std::uint64_t rng_seed = 0, offset = 0, seed = 0;
  template <class V>
  void fields(V& v) {
    v("p", p);
    v("rng_seed", rng_seed);
    v("offset", offset);
    v("seed", seed);
  }
};
// p from lo / 10 to hi / 10 (lo = hi = 0: p = 0); offsets below max_offset (0: any).
rc::Gen<PhiloxCase> gen_philox_case(int lo, int hi, std::uint64_t max_offset) {
  return proptest::rerunnable<PhiloxCase>(rc::gen::exec([=] {
    PhiloxCase c;
    c.seed = *rc::gen::arbitrary<std::uint32_t>();
    c.p = *rc::gen::inRange(lo, hi + 1) / 10.0;
    c.rng_seed = *rc::gen::arbitrary<std::uint64_t>();
    c.offset = max_offset ? *rc::gen::inRange<std::uint64_t>(0, max_offset) : *rc::gen::arbitrary<std::uint64_t>();
    return c;
  }));
}
}  // namespace

RC_GTEST_PROP(Dropout, ProbabilityZeroIsTheIdentity, ()) {
  const PhiloxCase pc = *gen_philox_case(0, 0, 0);
  std::mt19937_64 g(pc.seed);
  const Mat x = random_mat(g, 4, 6);
  const DropoutRng rng{pc.rng_seed, pc.offset};
  RC_ASSERT(max_abs_diff(dropout(x, 0.0, true, rng, Precision{}), x) == 0.0);
  RC_ASSERT(max_abs_diff(dropout(x, 0.7, false, rng, Precision{}), x) == 0.0);  // eval mode: none
  // bias-dropout-add with p = 0: residual + (x + bias) exactly
  const RowVec bias = random_mat(g, 1, 6).row(0);
  const Mat r = random_mat(g, 4, 6);
  Mat expect = x;
  expect.rowwise() += bias;
  expect += r;
  RC_ASSERT(max_abs_diff(bias_dropout_add(x, bias, r, 0.0, true, rng, exact()), expect) < kExactTol);
}

RC_GTEST_PROP(Dropout, SameSeedReproducesDifferentOffsetDiffers, ()) {
  const PhiloxCase pc = *gen_philox_case(1, 8, 1000);
  std::mt19937_64 g(pc.seed);
  const Mat x = random_mat(g, 8, 16).array() + 3.0;  // no zeros
  const double p = pc.p;
  const DropoutRng rng{pc.rng_seed, pc.offset};
  const Mat a = dropout(x, p, true, rng, exact()), b = dropout(x, p, true, rng, exact());
  RC_ASSERT(max_abs_diff(a, b) == 0.0);
  for (Eigen::Index i = 0; i < x.size(); ++i)  // kept values are scaled by 1 / (1 - p)
    RC_ASSERT(a.data()[i] == 0.0 || std::abs(a.data()[i] - x.data()[i] / (1 - p)) < 1e-12);
  const Mat c = dropout(x, p, true, rng.with_offset(rng.offset + 1), exact());
  RC_ASSERT(max_abs_diff(a, c) > 0.0);  // 128 elements: equal masks have probability < 2^-40
}

TEST(Dropout, ResidualShapeMismatchIsAnError) {
  EXPECT_TRUE(throws_with<ShapeError>(
      [] { bias_dropout_add(Mat::Zero(4, 6), std::nullopt, Mat::Zero(4, 5), 0.0, false, DropoutRng{}, exact()); },
      {"residual", "[4, 5]", "[4, 6]"}));
}
