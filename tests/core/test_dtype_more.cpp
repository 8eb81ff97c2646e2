// Properties of the conversions that need no oracle, and the dtype tables.
#include <gtest/gtest.h>

#include <cmath>

#include "core/dtype.h"

using namespace twin;

TEST(DType, NamesRoundTripAndSizes) {
  for (DType d : {DType::F64, DType::F32, DType::BF16, DType::F16, DType::I64, DType::I32, DType::BOOL}) {
    EXPECT_EQ(dtype_from_name(dtype_name(d)), d);
    EXPECT_EQ(dtype_from_any_name(dtype_name(d)), d);
  }
  EXPECT_EQ(dtype_size(DType::BF16), 2u);
  EXPECT_EQ(dtype_size(DType::BOOL), 1u);
  EXPECT_EQ(dtype_size(DType::I64), 8u);
  EXPECT_EQ(dtype_from_any_name("torch.bfloat16"), DType::BF16);
  EXPECT_EQ(dtype_from_any_name("fp16"), DType::F16);
  EXPECT_FALSE(dtype_from_name("F8_E4M3").has_value());
  EXPECT_FALSE(dtype_from_name("f32").has_value());  // safetensors names are upper case
}

// A decoded value is never farther than half an ulp from the float that produced it: checked on
// a grid of floats spanning both formats' normal ranges, against the unit roundoff.
TEST(DType, RoundingErrorWithinUnitRoundoff) {
  for (DType dt : {DType::BF16, DType::F16}) {
    const double u = unit_roundoff(dt);
    const double lo = dt == DType::BF16 ? 1e-30 : 6.2e-5, hi = dt == DType::BF16 ? 1e30 : 6.5e4;
    for (double x = lo; x < hi; x *= 1.0009765) {
      const double r = round_to(dt, static_cast<float>(x));
      ASSERT_LE(std::fabs(r - static_cast<float>(x)), u * std::fabs(static_cast<float>(x)))
          << dtype_name(dt) << " " << x;
    }
  }
}

TEST(DType, OverflowAndUnderflowThresholds) {
  EXPECT_EQ(round_to(DType::F16, 65504.0), 65504.0);
  EXPECT_EQ(round_to(DType::F16, 65519.99), 65504.0);
  EXPECT_TRUE(std::isinf(round_to(DType::F16, 65520.0)));      // the tie above max rounds to even: Inf
  EXPECT_EQ(round_to(DType::F16, std::ldexp(1.0, -25)), 0.0);  // half the smallest subnormal: tie to 0
  EXPECT_EQ(round_to(DType::F16, std::ldexp(1.5, -25)), std::ldexp(1.0, -24));
  EXPECT_EQ(round_to(DType::BF16, -0.0), 0.0);
  EXPECT_TRUE(std::signbit(round_to(DType::BF16, -0.0)));
  EXPECT_TRUE(std::isinf(round_to(DType::BF16, 3.4e38)));
  EXPECT_THROW(round_to(DType::I32, 1.0), std::invalid_argument);
  EXPECT_THROW(unit_roundoff(DType::BOOL), std::invalid_argument);
}
