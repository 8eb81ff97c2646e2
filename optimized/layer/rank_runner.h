// One rank runner for every optimized layer kind: runs a phase on every rank (one thread per rank
// past one, the threaded collectives pairing them; or, with ranks as processes, this process's
// rank on this thread) and joins the rounding counts the same way for every layer. Rounding
// points are counted per thread: each rank counts on from the caller's count, and the caller
// continues from the join of every rank's (each rank executes the same points; where ranks differ,
// the join keeps the larger count of each kind).
//
// Ranks as processes (LayerOptions::processes, an MPI launch: runtime/processes.h): every process
// holds the layer's host side for every rank, runs its own rank's phases alone, and meets the
// others after each phase: if a rank threw, every process throws the same error (the failing
// rank's, named; a rank left waiting in a collective by it fails at the collective deadline), and
// the rounding counts are joined over the processes as over the threads. What the host then reads
// of another rank's work comes from its process: its device buffers (download_tensor on the rank's
// stream, outside a phase: a collective) and the host values it recorded (share_ranks).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/record.h"
#include "core/rounding.h"
#include "optimized/layer/sharding.h"  // ShardLayout
#include "optimized/runtime/collectives.h"

namespace twin::opt {

// Runs rank(r) for every rank r (processes: this process's rank only). TWIN_FAIL_RANK=r makes rank
// r throw at the start of each phase (the test of a failing rank).
void run_ranks_counted(int nranks, const std::function<void(int)>& rank, bool processes = false);
// True on a thread running a rank's phase (what it downloads is its own rank's).
bool in_rank_phase();
// Whether a layer of nranks runs them as processes: in an MPI launch of several processes, a layer
// of several ranks (one rank runs whole on every process alike).
bool ranks_as_processes(int nranks);
// Whether this process runs rank r's work: every rank with threads, its own with processes.
bool runs_rank(int r, bool processes);
// One communicator per rank of a group of nranks: the threaded group, or (processes) this
// process's rank's alone (the others null); ConfigError naming `who` when the launch's process
// count is not nranks.
std::vector<std::unique_ptr<rt::Communicator>> make_rank_communicators(const std::string& who, int nranks,
                                                                       bool processes, rt::Backend backend);

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
