#include "optimized/layer/rank_runner.h"

#include <cstdlib>
#include <stdexcept>
#include <vector>

#include "core/config.h"
#include "optimized/layer/rank_exchange.h"
#include "optimized/runtime/processes.h"

namespace twin::opt {

namespace {

thread_local bool rank_phase = false;

// Marks this thread as running a rank's phase while it lives.
struct RankPhase {
  RankPhase() { rank_phase = true; }
  ~RankPhase() { rank_phase = false; }
};

void fail_if_asked(int r) {
  const char* fail = std::getenv("TWIN_FAIL_RANK");
  if (fail && *fail && std::atoi(fail) == r)
    throw std::runtime_error("an injected failure (TWIN_FAIL_RANK=" + std::to_string(r) + ")");
}

// Rank r's phase on this thread, counting on from at_start: its failure (null: none), its count
// at the end into at_end.
std::exception_ptr run_rank(int r, const RoundingCount& at_start, const std::function<void(int)>& rank,
                            RoundingCount& at_end) {
  CountRoundings counting;
  RankPhase phase;
  rounding_set(at_start);
  std::exception_ptr failed;
  try {
    fail_if_asked(r);
    rank(r);
  } catch (...) {
    failed = std::current_exception();
  }
  at_end = rounding_now();
  return failed;
}

// With ranks as processes: this process's rank's phase, then every process learns every rank's
// outcome and rounding count (on the control channel, which a timed-out collective leaves free).
void run_my_rank(int nranks, const std::function<void(int)>& rank) {
  if (nranks != rt::process_count())
    throw std::logic_error("run_ranks_counted: " + std::to_string(nranks) + " ranks over " +
                           std::to_string(rt::process_count()) + " processes");
  const RoundingCount at_start = rounding_now();
  RoundingCount at_end;
  const std::exception_ptr failed = run_rank(rt::process_rank(), at_start, rank, at_end);
  RankOutcome mine = failed ? RankOutcome::of(failed) : RankOutcome{};
  mine.rounding = at_end;
  const std::vector<RankOutcome> all = exchange_outcomes(mine);
  RoundingCount joined = at_start;
  for (const RankOutcome& o : all) joined.join(o.rounding);
  rounding_set(joined);
  rethrow_first_failure(all);
}

}  // namespace

bool in_rank_phase() { return rank_phase; }

bool ranks_as_processes(int nranks) { return nranks > 1 && rt::process_count() > 1; }

bool runs_rank(int r, bool processes) { return !processes || r == rt::process_rank(); }

void run_ranks_counted(int nranks, const std::function<void(int)>& rank, bool processes) {
  if (processes) return run_my_rank(nranks, rank);
  if (nranks == 1) {  // on the caller's thread and count
    fail_if_asked(0);
    return rank(0);
  }
  const RoundingCount at_start = rounding_now();
  std::vector<RoundingCount> at_end(static_cast<std::size_t>(nranks));
  std::vector<std::exception_ptr> failed(static_cast<std::size_t>(nranks));
  rt::run_ranks(nranks, [&](int r) {
    failed[static_cast<std::size_t>(r)] = run_rank(r, at_start, rank, at_end[static_cast<std::size_t>(r)]);
  });
  RoundingCount joined = at_start;
  for (const RoundingCount& e : at_end) joined.join(e);
  rounding_set(joined);
  // As with processes: the first rank that failed other than by waiting in a collective, else the first.
  auto waited = [](const std::exception_ptr& e) { return RankOutcome::of(e).kind == RankOutcome::Kind::Collective; };
  std::exception_ptr first;
  for (const std::exception_ptr& e : failed)
    if (e && (!first || (waited(first) && !waited(e)))) first = e;
  if (first) std::rethrow_exception(first);
}

std::vector<std::unique_ptr<rt::Communicator>> make_rank_communicators(const std::string& who, int nranks,
                                                                       bool processes, rt::Backend backend) {
  std::vector<std::unique_ptr<rt::Communicator>> comms;
  if (!processes) {
    if (nranks > 1) comms = rt::make_threaded_group(nranks);
    return comms;
  }
  if (nranks != rt::process_count())
    throw ConfigError(who + ": the layer runs " + std::to_string(nranks) +
                      " rank(s), one per process, but the launch has " + std::to_string(rt::process_count()) +
                      " process(es) (mpirun -np " + std::to_string(nranks) + ")");
  comms.resize(static_cast<std::size_t>(nranks));
  comms[static_cast<std::size_t>(rt::process_rank())] = rt::make_process_communicator(backend);
  return comms;
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
