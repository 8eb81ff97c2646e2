#include "optimized/layer/rank_runner.h"

#include <vector>

#include "core/rounding.h"
#include "optimized/runtime/collectives.h"

namespace twin::opt {

void run_ranks_counted(int nranks, const std::function<void(int)>& rank) {
  if (nranks == 1) return rank(0);  // on the caller's thread and count
  const RoundingCount at_start = rounding_now();
  std::vector<RoundingCount> at_end(static_cast<std::size_t>(nranks));
  rt::run_ranks(nranks, [&](int r) {
    CountRoundings counting;
    rounding_set(at_start);
    rank(r);
    at_end[static_cast<std::size_t>(r)] = rounding_now();
  });
  RoundingCount joined = at_start;
  for (const RoundingCount& e : at_end) joined.join(e);
  rounding_set(joined);
}

}  // namespace twin::opt
