// Element types of tensors, named as safetensors names them, and the bf16/fp16 conversions.
//
// Conversions round to nearest, ties to even, exactly as the hardware (and torch) do, and keep
// NaN a NaN (quiet, sign kept) and Inf an Inf. They are the rounding points of the reference:
// "store in bf16" means round_to(DType::BF16, x).
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>

namespace twin {

enum class DType { F64, F32, BF16, F16, I64, I32, BOOL };

std::size_t dtype_size(DType dt);
const char* dtype_name(DType dt);  // "F32", "BF16", ... (safetensors)
std::optional<DType> dtype_from_name(std::string_view name);
bool is_floating(DType dt);
// Parses "float32"/"fp32"/"F32"/"bfloat16"/"bf16"/... (Megatron's params_dtype spellings too).
std::optional<DType> dtype_from_any_name(std::string_view name);

// ---- bf16 / fp16 bit conversions -------------------------------------------------------------
inline std::uint32_t float_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_float(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline std::uint16_t float_to_bf16_bits(float f) {
  std::uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x0040u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even; overflow carries into Inf as it must
  return static_cast<std::uint16_t>(u >> 16);
}
inline float bf16_bits_to_float(std::uint16_t h) { return bits_float(static_cast<std::uint32_t>(h) << 16); }

std::uint16_t float_to_fp16_bits(float f);
float fp16_bits_to_float(std::uint16_t h);

// Storage types for 16-bit floats in host tensors (plain bits; arithmetic goes through float).
template <std::uint16_t (*ToBits)(float), float (*FromBits)(std::uint16_t)>
struct half_storage {
  std::uint16_t bits = 0;
  half_storage() = default;
  explicit half_storage(float f) : bits(ToBits(f)) {}
  static half_storage from_bits(std::uint16_t b) {
    half_storage r;
    r.bits = b;
    return r;
  }
  explicit operator float() const { return FromBits(bits); }
};
using bf16_t = half_storage<float_to_bf16_bits, bf16_bits_to_float>;
using fp16_t = half_storage<float_to_fp16_bits, fp16_bits_to_float>;

// Rounds a value to the nearest value representable in dt (identity for F64; F32 rounds once).
double round_to(DType dt, double x);

// Unit roundoff u = 2^-p of a floating dtype: the relative error bound of one rounding.
double unit_roundoff(DType dt);

// The DType of a host element type (dtype_of<T>::value); other types do not compile.
template <class T>
struct dtype_of {
  static constexpr DType value = [] {
    if constexpr (std::is_same_v<T, double>)
      return DType::F64;
    else if constexpr (std::is_same_v<T, float>)
      return DType::F32;
    else if constexpr (std::is_same_v<T, bf16_t>)
      return DType::BF16;
    else if constexpr (std::is_same_v<T, fp16_t>)
      return DType::F16;
    else if constexpr (std::is_same_v<T, std::int64_t>)
      return DType::I64;
    else if constexpr (std::is_same_v<T, std::int32_t>)
      return DType::I32;
    else {
      static_assert(std::is_same_v<T, bool>, "dtype_of: no DType for this type");
      return DType::BOOL;
    }
  }();
};

}  // namespace twin
