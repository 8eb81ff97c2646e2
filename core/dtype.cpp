#include "core/dtype.h"

#include <cmath>
#include <stdexcept>

namespace twin {

std::size_t dtype_size(DType dt) {
  switch (dt) {
    case DType::F64:
    case DType::I64:
      return 8;
    case DType::F32:
    case DType::I32:
      return 4;
    case DType::BF16:
    case DType::F16:
      return 2;
    case DType::BOOL:
      return 1;
  }
  throw std::logic_error("dtype_size: bad dtype");
}

const char* dtype_name(DType dt) {
  switch (dt) {
    case DType::F64:
      return "F64";
    case DType::F32:
      return "F32";
    case DType::BF16:
      return "BF16";
    case DType::F16:
      return "F16";
    case DType::I64:
      return "I64";
    case DType::I32:
      return "I32";
    case DType::BOOL:
      return "BOOL";
  }
  return "?";
}

std::optional<DType> dtype_from_name(std::string_view n) {
  for (DType d : {DType::F64, DType::F32, DType::BF16, DType::F16, DType::I64, DType::I32, DType::BOOL})
    if (n == dtype_name(d)) return d;
  return std::nullopt;
}

std::optional<DType> dtype_from_any_name(std::string_view n) {
  if (auto d = dtype_from_name(n)) return d;
  if (n == "float64" || n == "fp64" || n == "double" || n == "torch.float64") return DType::F64;
  if (n == "float32" || n == "fp32" || n == "float" || n == "torch.float32") return DType::F32;
  if (n == "bfloat16" || n == "bf16" || n == "torch.bfloat16") return DType::BF16;
  if (n == "float16" || n == "fp16" || n == "half" || n == "torch.float16") return DType::F16;
  return std::nullopt;
}

bool is_floating(DType dt) { return dt == DType::F64 || dt == DType::F32 || dt == DType::BF16 || dt == DType::F16; }

// IEEE binary16: 1 sign, 5 exponent (bias 15), 10 mantissa bits; subnormals below 2^-14.
std::uint16_t float_to_fp16_bits(float f) {
  const std::uint32_t u = float_bits(f);
  const std::uint16_t sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  const std::uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00u | static_cast<std::uint16_t>((a >> 13) & 0x3ffu);  // NaN
  if (a >= 0x477ff000u) return sign | 0x7c00u;  // >= 65520 rounds to Inf (and Inf stays Inf)
  if (a >= 0x38800000u) {                       // normal half: exponent >= -14
    std::uint32_t r = a - 0x38000000u;          // rebias 127 -> 15
    r += 0xfffu + ((r >> 13) & 1u);             // round to nearest even at bit 13
    return sign | static_cast<std::uint16_t>(r >> 13);
  }
  if (a < 0x33000000u) return sign;  // below half the smallest subnormal: +-0
  // Subnormal half: value = m * 2^-24. Shift the full 24-bit significand, round to nearest even.
  const std::uint32_t exp = a >> 23;
  const std::uint32_t mant = (a & 0x7fffffu) | 0x800000u;
  const std::uint32_t shift = 126u - exp;  // 14..24
  std::uint32_t q = mant >> shift;
  const std::uint32_t rem = mant & ((1u << shift) - 1u);
  const std::uint32_t half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (q & 1u))) ++q;  // may carry into the smallest normal: correct
  return sign | static_cast<std::uint16_t>(q);
}

float fp16_bits_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1fu;
  const std::uint32_t mant = h & 0x3ffu;
  if (exp == 0x1fu) return bits_float(sign | 0x7f800000u | (mant << 13));  // Inf / NaN (payload kept)
  if (exp == 0) {
    const float v = std::ldexp(static_cast<float>(mant), -24);  // exact
    return sign ? -v : v;
  }
  return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

double round_to(DType dt, double x) {
  switch (dt) {
    case DType::F64:
      return x;
    case DType::F32:
      return static_cast<double>(static_cast<float>(x));
    // Double -> float -> bf16 rounds twice; the float step is exact whenever x already came from
    // float arithmetic, which is every use in this project (values are fp32 before storing).
    case DType::BF16:
      return bf16_bits_to_float(float_to_bf16_bits(static_cast<float>(x)));
    case DType::F16:
      return fp16_bits_to_float(float_to_fp16_bits(static_cast<float>(x)));
    default:
      throw std::invalid_argument(std::string("round_to: not a floating dtype: ") + dtype_name(dt));
  }
}

double unit_roundoff(DType dt) {
  switch (dt) {
    case DType::F64:
      return std::ldexp(1.0, -53);
    case DType::F32:
      return std::ldexp(1.0, -24);
    case DType::BF16:
      return std::ldexp(1.0, -8);
    case DType::F16:
      return std::ldexp(1.0, -11);
    default:
      throw std::invalid_argument(std::string("unit_roundoff: not a floating dtype: ") + dtype_name(dt));
  }
}

}  // namespace twin
