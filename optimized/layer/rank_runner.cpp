#include "optimized/layer/rank_runner.h"

#include <algorithm>
#include <stdexcept>
#include <vector>

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

Record gather_rank_taps(const std::vector<std::vector<RankTap>>& rank_taps, const std::string& who) {
  Record record;
  for (std::size_t i = 0; i < rank_taps.at(0).size(); ++i) {
    const RankTap& first = rank_taps[0][i];
    std::vector<const Tensor*> shards;
    RoundingCount rounding = first.rounding;
    double magnitude = first.magnitude;
    for (std::size_t r = 0; r < rank_taps.size(); ++r) {
      const RankTap& t = rank_taps[r].at(i);
      if (t.name != first.name)
        throw std::logic_error(who + ": rank " + std::to_string(r) + " recorded tap '" + t.name +
                               "' where rank 0 recorded '" + first.name + "'");
      shards.push_back(&t.value);
      rounding.join(t.rounding);
      magnitude = std::max(magnitude, t.magnitude);
    }
    RecordEntry& e = record.add(Role::Tap, first.name, gather_shards(shards, first.layout));
    e.rounding = rounding;
    e.magnitude = magnitude;
  }
  return record;
}

}  // namespace twin::opt
