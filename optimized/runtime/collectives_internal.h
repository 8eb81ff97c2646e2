// collectives_internal.h: what every simulated group of ranks shares (threaded ranks and ranks as
// processes alike): the one summation, so both give the same bits, and the one deadline.
#pragma once

#include <cstddef>

#include "core/dtype.h"

namespace twin::rt {

// acc (count elements of dt) += x, one rounding to dt per element (as NCCL rounds per hop). A sum
// over ranks is this, rank by rank in rank order, from rank 0's values.
void add_rounded(DType dt, void* acc, const void* x, std::size_t count);

// How long a rank waits in a collective for the others: TWIN_COLLECTIVE_TIMEOUT_S, default 60 s.
double collective_timeout_seconds();

}  // namespace twin::rt
