// bf16 / fp16 conversions checked against the CUDA toolkit's own host-side conversions
// (cuda_bf16.h / cuda_fp16.h compiled by the host compiler: header functions, nothing linked).
// The kernels of the optimized twin round with these same functions, so the two twins must agree
// bit for bit. NaN is only required to stay a NaN (CUDA returns a canonical NaN, we keep payload).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <sstream>

#include "core/dtype.h"

using namespace twin;

namespace {

float cuda_bf16_to_float(std::uint16_t b) {
  __nv_bfloat16_raw r;
  r.x = b;
  return __bfloat162float(__nv_bfloat16(r));
}
std::uint16_t cuda_float_to_bf16(float f) { return static_cast<__nv_bfloat16_raw>(__float2bfloat16_rn(f)).x; }
float cuda_fp16_to_float(std::uint16_t b) {
  __half_raw r;
  r.x = b;
  return __half2float(__half(r));
}
std::uint16_t cuda_float_to_fp16(float f) { return static_cast<__half_raw>(__float2half_rn(f)).x; }

struct Format {
  const char* name;
  float (*ours_to_float)(std::uint16_t);
  std::uint16_t (*ours_from_float)(float);
  float (*cuda_to_float)(std::uint16_t);
  std::uint16_t (*cuda_from_float)(float);
};

const Format kFormats[] = {
    {"bf16", bf16_bits_to_float, float_to_bf16_bits, cuda_bf16_to_float, cuda_float_to_bf16},
    {"fp16", fp16_bits_to_float, float_to_fp16_bits, cuda_fp16_to_float, cuda_float_to_fp16},
};

// Our conversion of f agrees with CUDA's: the same bits, or both NaN.
::testing::AssertionResult same_rounding(const Format& fmt, float f) {
  const std::uint16_t ours = fmt.ours_from_float(f), cuda = fmt.cuda_from_float(f);
  if (ours == cuda) return ::testing::AssertionSuccess();
  if (std::isnan(fmt.ours_to_float(ours)) && std::isnan(fmt.cuda_to_float(cuda))) return ::testing::AssertionSuccess();
  std::ostringstream m;  // one stream: AssertionResult would drop the manipulators between pieces
  m << fmt.name << "(" << std::hexfloat << f << ", bits 0x" << std::hex << float_bits(f) << "): ours 0x" << ours
    << ", CUDA 0x" << cuda;
  return ::testing::AssertionFailure() << m.str();
}

bool is_finite_bits(const Format& fmt, std::uint16_t b) { return std::isfinite(fmt.ours_to_float(b)); }

}  // namespace

// All 65,536 patterns decode to the float CUDA decodes them to, bit for bit (NaN stays NaN).
TEST(DTypeVsCuda, DecodeAll65536Patterns) {
  for (const Format& fmt : kFormats) {
    for (std::uint32_t b = 0; b < 65536; ++b) {
      const float ours = fmt.ours_to_float(static_cast<std::uint16_t>(b));
      const float cuda = fmt.cuda_to_float(static_cast<std::uint16_t>(b));
      if (std::isnan(cuda)) {
        ASSERT_TRUE(std::isnan(ours)) << fmt.name << " bits " << b;
      } else {
        ASSERT_EQ(float_bits(ours), float_bits(cuda)) << fmt.name << " bits " << b;
      }
    }
  }
}

// Every representable value (and NaN, +-Inf, +-0) encodes as CUDA encodes it.
TEST(DTypeVsCuda, EncodeEveryPatternsValue) {
  for (const Format& fmt : kFormats)
    for (std::uint32_t b = 0; b < 65536; ++b)
      ASSERT_TRUE(same_rounding(fmt, fmt.cuda_to_float(static_cast<std::uint16_t>(b))));
}

// Exact midpoints between adjacent representable values (including max finite to the overflow
// threshold) are ties: both round to the even neighbour. One float ulp either side of a midpoint
// must go to the nearer neighbour. The midpoints are exact in float (16-bit formats have at most
// 11 significand bits; float has 24).
TEST(DTypeVsCuda, MidpointsRoundToEvenAndNeighboursToNearest) {
  for (const Format& fmt : kFormats) {
    int ties = 0;
    for (std::uint32_t b = 0; b < 65536; ++b) {
      const std::uint16_t lo = static_cast<std::uint16_t>(b);
      if ((lo & 0x7fff) == 0x7fff || !is_finite_bits(fmt, lo)) continue;
      const std::uint16_t hi = static_cast<std::uint16_t>(lo + 1);  // next magnitude, same sign
      const double vlo = fmt.ours_to_float(lo);
      // The value one step past max finite is 2^128 (bf16) or 2^16 (fp16): the format's Inf pattern.
      const double vhi = std::isinf(fmt.ours_to_float(hi))
                             ? std::copysign(fmt.name[0] == 'b' ? std::ldexp(1.0, 128) : 65536.0, vlo)
                             : fmt.ours_to_float(hi);
      const double mid = 0.5 * (vlo + vhi);
      const float m = static_cast<float>(mid);
      ASSERT_EQ(static_cast<double>(m), mid) << fmt.name << ": midpoint not exact in float";
      ASSERT_TRUE(same_rounding(fmt, m));
      const std::uint16_t r = fmt.ours_from_float(m);
      ASSERT_TRUE(r == lo || r == hi) << fmt.name << " midpoint of " << lo;
      ASSERT_EQ(r & 1u, 0u) << fmt.name << ": tie at midpoint of 0x" << std::hex << lo << " not rounded to even";
      const float below = std::nextafter(m, static_cast<float>(vlo));
      const float above = std::nextafter(m, std::copysign(INFINITY, m));
      ASSERT_TRUE(same_rounding(fmt, below));
      ASSERT_TRUE(same_rounding(fmt, above));
      if (m != 0.0f) {  // the midpoint between +0 and the smallest subnormal has no float neighbour issue
        ASSERT_EQ(fmt.ours_from_float(below), lo) << fmt.name << " just inside the midpoint of 0x" << std::hex << lo;
        ASSERT_EQ(fmt.ours_from_float(above), hi) << fmt.name << " just past the midpoint of 0x" << std::hex << lo;
      }
      ++ties;
    }
    EXPECT_GT(ties, 60000) << fmt.name;  // every finite pattern but the two max-magnitude ones
  }
}

// Random floats: uniform over all 2^32 bit patterns (every exponent, NaN payloads), and uniform
// in magnitude over the 16-bit formats' own ranges, where the rounding decisions happen.
TEST(DTypeVsCuda, RandomFloats) {
  std::mt19937 rng(20260112);
  std::uniform_int_distribution<std::uint32_t> bits;
  for (int i = 0; i < 4'000'000; ++i) {
    const float f = bits_float(bits(rng));
    for (const Format& fmt : kFormats) ASSERT_TRUE(same_rounding(fmt, f));
  }
  std::uniform_real_distribution<double> exponent(-30.0, 17.0), unit(0.0, 1.0);
  for (int i = 0; i < 2'000'000; ++i) {
    const float f = static_cast<float>((unit(rng) < 0.5 ? -1 : 1) * std::exp2(exponent(rng)));
    for (const Format& fmt : kFormats) ASSERT_TRUE(same_rounding(fmt, f));
  }
}

TEST(DTypeVsCuda, NanStaysNanAndInfStaysInf) {
  for (const Format& fmt : kFormats) {
    for (float nan : {NAN, -NAN, bits_float(0x7f800001u), bits_float(0xffc00000u), bits_float(0x7fbfffffu)}) {
      EXPECT_TRUE(std::isnan(fmt.ours_to_float(fmt.ours_from_float(nan)))) << fmt.name;
      EXPECT_TRUE(std::isnan(fmt.cuda_to_float(fmt.cuda_from_float(nan)))) << fmt.name;
    }
    EXPECT_EQ(fmt.ours_to_float(fmt.ours_from_float(INFINITY)), INFINITY) << fmt.name;
    EXPECT_EQ(fmt.ours_to_float(fmt.ours_from_float(-INFINITY)), -INFINITY) << fmt.name;
    EXPECT_EQ(fmt.ours_from_float(INFINITY), fmt.cuda_from_float(INFINITY)) << fmt.name;
    EXPECT_EQ(fmt.ours_from_float(-INFINITY), fmt.cuda_from_float(-INFINITY)) << fmt.name;
    EXPECT_EQ(fmt.ours_from_float(FLT_MAX), fmt.cuda_from_float(FLT_MAX)) << fmt.name;
  }
  // A NaN whose payload lives only in the low bits must not truncate to Inf.
  EXPECT_TRUE(std::isnan(bf16_bits_to_float(float_to_bf16_bits(bits_float(0x7f800001u)))));
  EXPECT_TRUE(std::isnan(fp16_bits_to_float(float_to_fp16_bits(bits_float(0x7f800001u)))));
}
