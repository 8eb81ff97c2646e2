/* Philox 4x32-10 on the device: the very mapping of reference/philox.h, so a dropout mask of the
 * optimized twin equals the reference's bit for bit for one (seed, offset, element).
 *
 * Design: counter-based, so every thread computes the word of its own element with no state and
 * no ordering; 64-bit products give mulhi/mullo identically on the GPU and the host. */
#pragma once

#include "kernel_common.cuh"

namespace twin::opt::TWIN_BACKEND {

__host__ __device__ inline std::uint32_t philox_word(std::uint64_t seed, std::uint64_t offset, std::uint64_t element) {
  const std::uint64_t block = element / 4;
  std::uint32_t c0 = static_cast<std::uint32_t>(block), c1 = static_cast<std::uint32_t>(block >> 32);
  std::uint32_t c2 = static_cast<std::uint32_t>(offset), c3 = static_cast<std::uint32_t>(offset >> 32);
  std::uint32_t k0 = static_cast<std::uint32_t>(seed), k1 = static_cast<std::uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    const std::uint64_t p0 = static_cast<std::uint64_t>(0xD2511F53u) * c0;
    const std::uint64_t p1 = static_cast<std::uint64_t>(0xCD9E8D57u) * c2;
    const std::uint32_t hi0 = static_cast<std::uint32_t>(p0 >> 32), lo0 = static_cast<std::uint32_t>(p0);
    const std::uint32_t hi1 = static_cast<std::uint32_t>(p1 >> 32), lo1 = static_cast<std::uint32_t>(p1);
    const std::uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
  }
  switch (element % 4) {
    case 0:
      return c0;
    case 1:
      return c1;
    case 2:
      return c2;
    default:
      return c3;
  }
}

// keep iff (word >> 8) < threshold, threshold = ceil((1 - p) 2^24) computed on the host in double.
__host__ __device__ inline bool philox_keep(std::uint64_t seed, std::uint64_t offset, std::uint64_t element,
                                            std::uint32_t threshold) {
  return (philox_word(seed, offset, element) >> 8) < threshold;
}

// The kept value x * scale stored in T: the product in double, then fp32, then T, as the reference rounds it.
template <class T>
__host__ __device__ inline float dropout_scaled(float x, double scale) {
  return round_to<T>(static_cast<float>(static_cast<double>(x) * scale));
}

}  // namespace twin::opt::TWIN_BACKEND
