// processes_mpi.h: the MPI side of processes.cpp that collectives_mpi.cpp shares (MPI builds only).
#pragma once

#include <mpi.h>

#include <string>
#include <vector>

#include "optimized/runtime/collectives_internal.h"
#include "optimized/runtime/processes.h"

namespace twin::rt::detail {

struct World {
  bool up = false;
  int rank = 0, size = 1;
  // MPI_COMM_WORLD duplicated per kind of traffic (processes.cpp says why), and each one's calls so far
  MPI_Comm control = MPI_COMM_NULL, results = MPI_COMM_NULL, data = MPI_COMM_NULL;
  long long calls[3] = {0, 0, 0};
};
World& world();

// What every call on a channel begins with: which call, its root, this process's bytes, and whether
// it fell out of step before. The processes compare them before any payload moves, so processes
// that disagree (a bug: MPI leaves a mismatched collective undefined) get a CollectiveError naming
// both calls instead; a process out of step (a timed-out collective is still posted and would
// match a later call) makes every process stop using the data and results channels.
struct CheckIn {
  long long call = 0, op = 0, root = 0, bytes = 0, broken = 0;
};
enum class Op : long long { AllReduce, AllGather, ReduceScatter, AllToAll, Broadcast, Gather, Exit };
// Every process's check-in on `comm` (in rank order), after checking that they agree on the call,
// the op and the root, and (same_bytes) the bytes.
std::vector<CheckIn> check_in(MPI_Comm comm, Op op, int root, std::size_t bytes, bool same_bytes,
                              const std::string& what, double seconds = collective_timeout_seconds());

// CollectiveError naming `what` unless `code` is MPI_SUCCESS.
void mpi_check(int code, const std::string& what);
// Waits for `req` up to `seconds` (the collective deadline unless said); CollectiveError naming
// `what` after it.
void wait(MPI_Request& req, const std::string& what, double seconds = collective_timeout_seconds());
// `n` as an MPI count; CollectiveError past INT_MAX.
int as_int(std::size_t n, const std::string& what);

}  // namespace twin::rt::detail
