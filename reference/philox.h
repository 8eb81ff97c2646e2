// Counter-based random numbers for dropout: Philox 4x32-10 (Salmon et al., "Parallel random
// numbers: as easy as 1, 2, 3", SC'11; the generator of curand and of torch's CUDA dropout).
// The CUDA twin reproduces every mask bit for bit from this exact mapping:
//
//   key     = (k0, k1)          = (lo32(seed), hi32(seed))
//   counter = (c0, c1, c2, c3)  = (lo32(e / 4), hi32(e / 4), lo32(offset), hi32(offset))
//   (r0, r1, r2, r3) = philox4x32_10(counter, key)
//   word    = r[e % 4]                       (element e of the tensor, flat row-major index)
//   uniform = (word >> 8) * 2^-24            (24 random bits; exact in fp32 and double; in [0, 1))
//   keep    = (word >> 8) < keep_threshold(p), keep_threshold(p) = ceil((1 - p) * 2^24)
//             (computed in double on the host; equivalent to uniform < 1 - p; p = 0 keeps all,
//              p = 1 drops all)
//   dropout(x)[e] = keep ? x[e] * (1 / (1 - p)) : 0  (product stored in the activation dtype)
//
// Rounds: 10 rounds of the Philox 4x32 S-box with multipliers 0xD2511F53, 0xCD9E8D57 and key
// increments 0x9E3779B9, 0xBB67AE85 (the Random123 constants).
//
// `offset` names one dropout call: a layer gives each call its own offset (see DropoutRng), so
// two calls never share counters.
#pragma once

#include <array>
#include <cstdint>

#include "core/dropout_site.h"

namespace twin::reference {

std::array<std::uint32_t, 4> philox4x32_10(std::array<std::uint32_t, 4> counter, std::array<std::uint32_t, 2> key);

// The 32-bit word for element e (mapping above).
std::uint32_t philox_word(std::uint64_t seed, std::uint64_t offset, std::uint64_t element);
// (word >> 8) * 2^-24.
double philox_uniform(std::uint64_t seed, std::uint64_t offset, std::uint64_t element);
// ceil((1 - p) * 2^24); p must be in [0, 1].
std::uint32_t dropout_keep_threshold(double p);
bool dropout_keep(std::uint64_t seed, std::uint64_t offset, std::uint64_t element, double p);

// A dropout stream: seed plus the offset of one call. A layer derives the offsets of its calls
// from a base offset by their DropoutSite (core/dropout_site.h).
struct DropoutRng {
  std::uint64_t seed = 0;
  std::uint64_t offset = 0;
  DropoutRng with_offset(std::uint64_t o) const { return DropoutRng{seed, o}; }
  // The stream of `site` in the layer whose base stream this is.
  DropoutRng at(DropoutSite site) const { return with_offset(dropout_offset(offset, site)); }
};

}  // namespace twin::reference
