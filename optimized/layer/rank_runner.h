// One rank runner for every optimized layer kind: runs a phase on every rank (one thread per rank
// past one, the threaded collectives pairing them) and joins the rounding counts the same way
// for every layer. Rounding points are counted per thread: each rank counts on from the caller's
// count, and the caller continues from the join of every rank's (each rank executes the same
// points; where ranks differ, the join keeps the larger count of each kind).
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "core/record.h"
#include "core/rounding.h"
#include "optimized/layer/sharding.h"  // ShardLayout

namespace twin::opt {

void run_ranks_counted(int nranks, const std::function<void(int)>& rank);

// One rank's part of a tap, recorded in the rank's thread with the rounding count of that thread
// when it was produced, and how the ranks' parts make the full tensor.
struct RankTap {
  std::string name;
  Tensor value;
  RoundingCount rounding;
  ShardLayout layout;
  Tensor block_magnitude;  // RecordEntry::block_magnitude of this rank's part (same layout), or undefined
};

// Every rank's taps put back together after the ranks ran: each rank recorded the same taps in the
// same order; each becomes one full tensor in the reference's logical shape (gather_shards), its
// rounding count the join of the ranks' and its block magnitudes put together as the values are,
// so the one comparison applies at any split. logic_error naming `who` when the ranks' taps differ.
Record gather_rank_taps(const std::vector<std::vector<RankTap>>& rank_taps, const std::string& who);

}  // namespace twin::opt
