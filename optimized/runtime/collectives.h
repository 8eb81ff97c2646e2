// collectives.h: collective communication for tensor, sequence and expert parallelism.
//
// Design: a Communicator is one rank's handle to a group; every rank calls the same collectives
// in the same order (NCCL's contract). Two implementations: NCCL (one rank per GPU, ranks made in
// one process with ncclCommInitAll, or across processes from a unique id), and an in-process
// threaded one for simulated ranks (each rank a thread, buffers are host memory), the role
// PyTorch's threaded process group plays in its tests. The threaded group reduces in a FIXED order,
// rank 0 + rank 1 + ... + rank n-1, rounding to the dtype after each addition (as NCCL rounds per
// hop; NCCL's own order differs), so its results are reproducible bit for bit. It checks that the
// ranks agree (same collective, counts, dtype, root) and turns a rank that never arrives into an
// error after a timeout (TWIN_COLLECTIVE_TIMEOUT_S, default 60) instead of a hang.
// Counts are in elements. Buffers may alias (in place) as NCCL allows.
#pragma once

#include "core/dtype.h"
#include "optimized/runtime/device.h"

#include <array>
#include <cstddef>
#include <functional>
#include <memory>
#include <stdexcept>
#include <vector>

namespace twin::rt {

struct CollectiveError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual Backend backend() const = 0;

  // recv[i] = send_0[i] + send_1[i] + ... + send_{n-1}[i] (sum), count elements on every rank.
  virtual void all_reduce(const void* send, void* recv, std::size_t count, DType dt, cudaStream_t s) = 0;
  // recv[r * count + i] = send_r[i]; recv holds size() * count elements.
  virtual void all_gather(const void* send, void* recv, std::size_t count, DType dt, cudaStream_t s) = 0;
  // send holds size() * count elements; recv[i] = sum over r of send_r[rank() * count + i].
  virtual void reduce_scatter(const void* send, void* recv, std::size_t count, DType dt, cudaStream_t s) = 0;
  // send is size() consecutive parts, part p (send_counts[p] elements) goes to rank p; recv is
  // size() consecutive parts, part q (recv_counts[q] elements) comes from rank q. Rank q's
  // send_counts[rank()] must equal recv_counts[q]. Zero-size parts are allowed.
  virtual void all_to_all(const void* send, const std::vector<std::size_t>& send_counts, void* recv,
                          const std::vector<std::size_t>& recv_counts, DType dt, cudaStream_t s) = 0;
  // recv = root's send (count elements); send is read on the root only.
  virtual void broadcast(const void* send, void* recv, std::size_t count, DType dt, int root, cudaStream_t s) = 0;
};

// An in-process group of nranks simulated ranks; communicator r must be driven by one thread.
std::vector<std::unique_ptr<Communicator>> make_threaded_group(int nranks);

// NCCL (CUDA builds with NCCL only; throws CudaError otherwise): one communicator per GPU in
// `devices`, created together with ncclCommInitAll.
std::vector<std::unique_ptr<Communicator>> make_nccl_group(const std::vector<int>& devices);
// NCCL across processes: rank 0 makes the id, the launcher hands it to every rank.
using NcclId = std::array<char, 128>;
NcclId nccl_unique_id();
std::unique_ptr<Communicator> make_nccl_communicator(int nranks, int rank, const NcclId& id, int device);

// Runs f(rank) on one thread per rank and rethrows the first exception (by rank order).
void run_ranks(int nranks, const std::function<void(int)>& f);

}  // namespace twin::rt
