#include "optimized/layer/rank_runner.h"

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
    std::vector<const Tensor*> shards, block_shards;
    RoundingCount rounding = first.rounding;
    for (std::size_t r = 0; r < rank_taps.size(); ++r) {
      const RankTap& t = rank_taps[r].at(i);
      if (t.name != first.name)
        throw std::logic_error(who + ": rank " + std::to_string(r) + " recorded tap '" + t.name +
                               "' where rank 0 recorded '" + first.name + "'");
      shards.push_back(&t.value);
      if (t.block_magnitude.defined()) block_shards.push_back(&t.block_magnitude);
      rounding.join(t.rounding);
    }
    RecordEntry& e = record.add(Role::Tap, first.name, gather_shards(shards, first.layout));
    e.rounding = rounding;
    if (!block_shards.empty()) {
      if (block_shards.size() != shards.size())
        throw std::logic_error(who + ": tap '" + first.name + "' has block magnitudes on some ranks only");
      e.block_magnitude = gather_shards(block_shards, first.layout);
    }
  }
  return record;
}

}  // namespace twin::opt
