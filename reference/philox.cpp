#include "reference/philox.h"

#include <cmath>
#include <stdexcept>
#include <string>

namespace twin::reference {

namespace {
constexpr std::uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
constexpr std::uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;

inline void mulhilo(std::uint32_t a, std::uint32_t b, std::uint32_t& hi, std::uint32_t& lo) {
  const std::uint64_t prod = static_cast<std::uint64_t>(a) * b;
  hi = static_cast<std::uint32_t>(prod >> 32);
  lo = static_cast<std::uint32_t>(prod);
}
}  // namespace

std::array<std::uint32_t, 4> philox4x32_10(std::array<std::uint32_t, 4> c, std::array<std::uint32_t, 2> k) {
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {  // bump the key between rounds
      k[0] += kWeyl0;
      k[1] += kWeyl1;
    }
    std::uint32_t hi0, lo0, hi1, lo1;
    mulhilo(kMul0, c[0], hi0, lo0);
    mulhilo(kMul1, c[2], hi1, lo1);
    c = {hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0};
  }
  return c;
}

std::uint32_t philox_word(std::uint64_t seed, std::uint64_t offset, std::uint64_t element) {
  const std::uint64_t block = element / 4;
  const auto r = philox4x32_10({static_cast<std::uint32_t>(block), static_cast<std::uint32_t>(block >> 32),
                                static_cast<std::uint32_t>(offset), static_cast<std::uint32_t>(offset >> 32)},
                               {static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32)});
  return r[element % 4];
}

double philox_uniform(std::uint64_t seed, std::uint64_t offset, std::uint64_t element) {
  return std::ldexp(static_cast<double>(philox_word(seed, offset, element) >> 8), -24);
}

std::uint32_t dropout_keep_threshold(double p) {
  if (!(p >= 0.0 && p <= 1.0))
    throw std::invalid_argument("dropout probability must be in [0, 1], got " + std::to_string(p));
  return static_cast<std::uint32_t>(std::ceil((1.0 - p) * 16777216.0));
}

bool dropout_keep(std::uint64_t seed, std::uint64_t offset, std::uint64_t element, double p) {
  return (philox_word(seed, offset, element) >> 8) < dropout_keep_threshold(p);
}

}  // namespace twin::reference
