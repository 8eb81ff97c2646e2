// processes.h: ranks as processes, one per rank, started by MPI (`mpirun -np N`, or a cluster's
// launcher such as `srun` through MPI's PMI).
//
// Design: MPI starts the processes and carries the host's control traffic (the outcome of each
// rank's phase, the results gathered for the report); the layers' collectives run on a
// Communicator per process: NCCL on GPUs (its unique id broadcast over MPI), or on the simulator
// MPI itself with the threaded group's fixed reduction order (every rank's buffer gathered, then
// summed rank 0 + rank 1 + ... with one rounding per addition), so a run over processes is bitwise
// the run over threads. Every call here is collective: each process makes it, in the same order.
// Every wait has a deadline (TWIN_COLLECTIVE_TIMEOUT_S, default 60 s): a process that never
// arrives turns into a CollectiveError, never a hang. Without MPI in the build, or outside an MPI
// launch, there is one process and every call is the identity.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "optimized/runtime/collectives.h"

namespace twin::rt {

// True when this build can run ranks as processes (it was compiled against MPI).
bool processes_built();
// True when an MPI launcher started this process (its environment says so).
bool launched_by_mpi();
// Starts MPI when launched_by_mpi() (a no-op otherwise, and on a second call); CollectiveError
// when launched by MPI but built without it. Stops it at exit.
void init_processes(int* argc, char*** argv);
// This process's rank in the launch and the number of processes (0 and 1 without a launch).
int process_rank();
int process_count();

using Bytes = std::vector<char>;
// Every process's `mine`, in rank order.
std::vector<Bytes> process_allgather(const Bytes& mine);
// The root's `bytes` bytes at `data` into every process's `data` (every process says the same size).
void process_broadcast(void* data, std::size_t bytes, int root);
// Every process's `mine`, in rank order, on the channel of each phase's outcome (apart from the
// results': a process that failed in a phase still meets the others here, each waiting up to twice
// the collective deadline, the time a process left waiting by a failed one takes to arrive).
std::vector<Bytes> process_allgather_control(const Bytes& mine);
// The exit status every process returns: the largest of every process's `code` (at least 1 when
// the processes cannot agree). Called once, last.
int finish_processes(int code);

// This process's handle to the group of every process: MPI on the simulator (the threaded group's
// reduction order), NCCL on a GPU (its device: the process's rank on its node).
std::unique_ptr<Communicator> make_process_communicator(Backend backend);

}  // namespace twin::rt
