#include <gtest/gtest.h>

#include <cmath>

#include "core/dtype.h"

using namespace twin;

// Every bf16 / fp16 bit pattern survives a round trip through float (NaN stays NaN).
TEST(DType, Bf16RoundTripAll65536) {
  for (std::uint32_t b = 0; b < 65536; ++b) {
    const float f = bf16_bits_to_float(static_cast<std::uint16_t>(b));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(bf16_bits_to_float(float_to_bf16_bits(f)))) << b;
      continue;
    }
    ASSERT_EQ(float_to_bf16_bits(f), b) << "bits " << b;
  }
}

TEST(DType, Fp16RoundTripAll65536) {
  for (std::uint32_t b = 0; b < 65536; ++b) {
    const float f = fp16_bits_to_float(static_cast<std::uint16_t>(b));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(fp16_bits_to_float(float_to_fp16_bits(f)))) << b;
      continue;
    }
    ASSERT_EQ(float_to_fp16_bits(f), b) << "bits " << b;
  }
}
