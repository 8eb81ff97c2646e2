// One rank runner for every optimized layer kind: runs a phase on every rank (one thread per rank
// past one, the threaded collectives pairing them) and joins the rounding counts the same way
// for every layer. Rounding points are counted per thread: each rank counts on from the caller's
// count, and the caller continues from the join of every rank's (each rank executes the same
// points; where ranks differ, the join keeps the larger count of each kind).
#pragma once

#include <functional>

namespace twin::opt {

void run_ranks_counted(int nranks, const std::function<void(int)>& rank);

}  // namespace twin::opt
