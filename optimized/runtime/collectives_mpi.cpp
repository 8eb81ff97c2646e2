// collectives_mpi.cpp: the simulator's collectives between processes, on MPI (MPI builds only).
//
// Design: the threaded group's results, bit for bit. A sum gathers every rank's operand, then adds
// them rank 0 + rank 1 + ... with one rounding to the dtype per addition (add_rounded, the threaded
// group's own); nothing is reduced inside MPI, whose order is its own. Each collective is enqueued
// on the simulated stream as the threaded group's are (a captured graph replays it), posted
// nonblocking and waited for up to the collective deadline. Buffers may alias: every result is
// made in a private buffer and copied to recv last. Each call checks in first (processes_mpi.h), so
// processes calling different collectives, roots or sizes fail with both calls named. On a GPU the process's
// communicator is NCCL's, its unique id broadcast over MPI, its GPU the process's rank on its node.
#include <cstdlib>
#include <cstring>

#include "optimized/runtime/collectives_internal.h"
#include "optimized/runtime/processes_mpi.h"
#include "optimized/runtime/sim_stream.h"

namespace twin::rt {
namespace {

using detail::as_int;
using detail::check_in;
using detail::mpi_check;
using detail::Op;
using detail::wait;
using detail::world;

class MpiComm final : public Communicator {
 public:
  int rank() const override { return world().rank; }
  int size() const override { return world().size; }
  Backend backend() const override { return Backend::Sim; }

  void all_reduce(const void* send, void* recv, std::size_t count, DType dt, cudaStream_t s) override {
    cudasim::detail::enqueue(s, [=] {
      const std::size_t bytes = count * dtype_size(dt);
      check_in(world().data, Op::AllReduce, 0, bytes, true, "all_reduce");
      const Bytes all = gather(send, bytes, "all_reduce");
      finish(recv, sum(all.data(), bytes, bytes, count, dt));
    });
  }
  void all_gather(const void* send, void* recv, std::size_t count, DType dt, cudaStream_t s) override {
    cudasim::detail::enqueue(s, [=] {
      check_in(world().data, Op::AllGather, 0, count * dtype_size(dt), true, "all_gather");
      finish(recv, gather(send, count * dtype_size(dt), "all_gather"));
    });
  }
  // Each rank's part for rank q to rank q (an all-to-all of equal parts), then its parts summed.
  void reduce_scatter(const void* send, void* recv, std::size_t count, DType dt, cudaStream_t s) override {
    cudasim::detail::enqueue(s, [=] {
      const std::size_t bytes = count * dtype_size(dt);
      check_in(world().data, Op::ReduceScatter, 0, bytes, true, "reduce_scatter");
      const std::vector<std::size_t> parts(std::size_t(size()), count);
      const Bytes mine = exchange(send, parts, parts, dt, "reduce_scatter");
      finish(recv, sum(mine.data(), bytes, bytes, count, dt));
    });
  }
  void all_to_all(const void* send, const std::vector<std::size_t>& send_counts, void* recv,
                  const std::vector<std::size_t>& recv_counts, DType dt, cudaStream_t s) override {
    const std::size_t n = std::size_t(size());
    if (send_counts.size() != n || recv_counts.size() != n)
      throw CollectiveError("MPI all_to_all (rank " + std::to_string(rank()) + "): send_counts has " +
                            std::to_string(send_counts.size()) + " and recv_counts " +
                            std::to_string(recv_counts.size()) + " entries; the group has " + std::to_string(n) +
                            " ranks");
    // The counts are copied: the call may be recorded into a graph and replayed later.
    cudasim::detail::enqueue(s, [=] {
      check_in(world().data, Op::AllToAll, 0, 0, true, "all_to_all");
      finish(recv, exchange(send, send_counts, recv_counts, dt, "all_to_all"));
    });
  }
  void broadcast(const void* send, void* recv, std::size_t count, DType dt, int root, cudaStream_t s) override {
    if (root < 0 || root >= size())
      throw CollectiveError("MPI broadcast: root " + std::to_string(root) + " is not a rank of a group of " +
                            std::to_string(size()));
    cudasim::detail::enqueue(s, [=] {
      const std::size_t bytes = count * dtype_size(dt);
      check_in(world().data, Op::Broadcast, root, bytes, true, "broadcast");
      Bytes out(bytes);
      if (rank() == root && bytes) std::memcpy(out.data(), send, bytes);
      MPI_Request req;
      mpi_check(MPI_Ibcast(out.data(), as_int(bytes, "broadcast"), MPI_BYTE, root, world().data, &req), "broadcast");
      wait(req, "broadcast");
      finish(recv, out);
    });
  }

 private:
  // Every rank's `bytes` from `send`, in rank order.
  Bytes gather(const void* send, std::size_t bytes, const char* what) const {
    Bytes all(std::max<std::size_t>(bytes * std::size_t(size()), 1));
    const int n = as_int(bytes, what);
    MPI_Request req;
    mpi_check(MPI_Iallgather(send, n, MPI_BYTE, all.data(), n, MPI_BYTE, world().data, &req), what);
    wait(req, what);
    all.resize(bytes * std::size_t(size()));
    return all;
  }
  // Part p of `send` (send_counts[p] elements) to rank p; the parts from every rank, in rank order.
  Bytes exchange(const void* send, const std::vector<std::size_t>& send_counts,
                 const std::vector<std::size_t>& recv_counts, DType dt, const char* what) const {
    const std::size_t es = dtype_size(dt);
    std::vector<int> sc, sd, rc, rd;
    std::size_t soff = 0, roff = 0;
    for (std::size_t p = 0; p < send_counts.size(); ++p) {
      sc.push_back(as_int(send_counts[p] * es, what));
      sd.push_back(as_int(soff, what));
      rc.push_back(as_int(recv_counts[p] * es, what));
      rd.push_back(as_int(roff, what));
      soff += send_counts[p] * es;
      roff += recv_counts[p] * es;
    }
    Bytes out(std::max<std::size_t>(roff, 1));
    MPI_Request req;
    mpi_check(MPI_Ialltoallv(send, sc.data(), sd.data(), MPI_BYTE, out.data(), rc.data(), rd.data(), MPI_BYTE,
                             world().data, &req),
              what);
    wait(req, what);
    out.resize(roff);
    return out;
  }
  // The ranks' operands (rank r's at parts + r * stride) summed in rank order.
  Bytes sum(const char* parts, std::size_t stride, std::size_t bytes, std::size_t count, DType dt) const {
    Bytes out(parts, parts + bytes);
    for (int r = 1; r < size(); ++r) add_rounded(dt, out.data(), parts + std::size_t(r) * stride, count);
    return out;
  }
  static void finish(void* recv, const Bytes& out) {
    if (!out.empty()) std::memcpy(recv, out.data(), out.size());
  }
};

}  // namespace

std::unique_ptr<Communicator> make_process_communicator(Backend backend) {
  if (!world().up) throw CollectiveError("ranks as processes: this process was not started by an MPI launcher");
  if (backend == Backend::Sim) return std::make_unique<MpiComm>();
  // NCCL: rank 0 makes the unique id, MPI hands it to every rank; one GPU per process on its node.
  NcclId nid{};
  if (world().rank == 0) nid = nccl_unique_id();
  process_broadcast(nid.data(), nid.size(), 0);
  const char* local = std::getenv("OMPI_COMM_WORLD_LOCAL_RANK");
  if (!local) local = std::getenv("SLURM_LOCALID");
  return make_nccl_communicator(world().size, world().rank, nid, local ? std::atoi(local) : world().rank);
}

}  // namespace twin::rt
