// collectives_nccl.cpp: collectives on GPUs with NCCL (CUDA builds with NCCL only; needs GPUs).
//
// Design: one ncclComm_t per rank and GPU. make_nccl_group creates all ranks of one process with
// ncclCommInitAll; make_nccl_communicator joins a multi-process group from a unique id. Each call
// selects the rank's device, then enqueues the NCCL collective on the given stream;
// all_to_all is a group of ncclSend/ncclRecv pairs (zero-size parts are skipped on both sides,
// which stay consistent because rank q's send_counts[p] equals rank p's recv_counts[q]).
#include "optimized/runtime/collectives.h"
#include "optimized/runtime/cuda_check.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstring>
#include <string>

namespace twin::rt {
namespace {

void nccl_check(ncclResult_t r, const std::string& call) {
  if (r != ncclSuccess) throw CudaError(call + ": " + ncclGetErrorString(r));
}

ncclDataType_t to_nccl(DType dt) {
  switch (dt) {
    case DType::F32: return ncclFloat32;
    case DType::F64: return ncclFloat64;
    case DType::BF16: return ncclBfloat16;
    case DType::F16: return ncclFloat16;
    case DType::I32: return ncclInt32;
    case DType::I64: return ncclInt64;
    default: throw CollectiveError(std::string("NCCL: unsupported dtype ") + dtype_name(dt));
  }
}

class NcclComm final : public Communicator {
 public:
  NcclComm(ncclComm_t c, int rank, int size, int device) : c_(c), rank_(rank), size_(size), dev_(device) {}
  ~NcclComm() override { if (c_) ncclCommDestroy(c_); }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Backend backend() const override { return Backend::Cuda; }

  void all_reduce(const void* send, void* recv, std::size_t count, DType dt, cudaStream_t s) override {
    use_device();
    nccl_check(ncclAllReduce(send, recv, count, to_nccl(dt), ncclSum, c_, s), "ncclAllReduce");
  }
  void all_gather(const void* send, void* recv, std::size_t count, DType dt, cudaStream_t s) override {
    use_device();
    nccl_check(ncclAllGather(send, recv, count, to_nccl(dt), c_, s), "ncclAllGather");
  }
  void reduce_scatter(const void* send, void* recv, std::size_t count, DType dt, cudaStream_t s) override {
    use_device();
    nccl_check(ncclReduceScatter(send, recv, count, to_nccl(dt), ncclSum, c_, s), "ncclReduceScatter");
  }
  void all_to_all(const void* send, const std::vector<std::size_t>& send_counts, void* recv,
                  const std::vector<std::size_t>& recv_counts, DType dt, cudaStream_t s) override {
    if (send_counts.size() != static_cast<std::size_t>(size_) || recv_counts.size() != static_cast<std::size_t>(size_))
      throw CollectiveError("NCCL all_to_all: counts must have one entry per rank (" + std::to_string(size_) + ")");
    use_device();
    const std::size_t es = dtype_size(dt);
    std::size_t soff = 0, roff = 0;
    nccl_check(ncclGroupStart(), "ncclGroupStart");
    for (int p = 0; p < size_; ++p) {
      if (send_counts[p])
        nccl_check(ncclSend(static_cast<const char*>(send) + soff, send_counts[p], to_nccl(dt), p, c_, s), "ncclSend");
      if (recv_counts[p])
        nccl_check(ncclRecv(static_cast<char*>(recv) + roff, recv_counts[p], to_nccl(dt), p, c_, s), "ncclRecv");
      soff += send_counts[p] * es;
      roff += recv_counts[p] * es;
    }
    nccl_check(ncclGroupEnd(), "ncclGroupEnd");
  }
  void broadcast(const void* send, void* recv, std::size_t count, DType dt, int root, cudaStream_t s) override {
    use_device();
    nccl_check(ncclBroadcast(send, recv, count, to_nccl(dt), root, c_, s), "ncclBroadcast");
  }

 private:
  void use_device() { cuda_check(cudaSetDevice(dev_), "cudaSetDevice(" + std::to_string(dev_) + ")"); }
  ncclComm_t c_;
  int rank_, size_, dev_;
};

}  // namespace

std::vector<std::unique_ptr<Communicator>> make_nccl_group(const std::vector<int>& devices) {
  std::vector<ncclComm_t> comms(devices.size());
  nccl_check(ncclCommInitAll(comms.data(), static_cast<int>(devices.size()), devices.data()), "ncclCommInitAll");
  std::vector<std::unique_ptr<Communicator>> out;
  for (std::size_t r = 0; r < devices.size(); ++r)
    out.push_back(std::make_unique<NcclComm>(comms[r], static_cast<int>(r), static_cast<int>(devices.size()), devices[r]));
  return out;
}

NcclId nccl_unique_id() {
  ncclUniqueId id;
  nccl_check(ncclGetUniqueId(&id), "ncclGetUniqueId");
  NcclId out{};
  static_assert(sizeof(id.internal) == sizeof(NcclId), "NCCL unique id size");
  std::memcpy(out.data(), id.internal, sizeof(id.internal));
  return out;
}

std::unique_ptr<Communicator> make_nccl_communicator(int nranks, int rank, const NcclId& id, int device) {
  cuda_check(cudaSetDevice(device), "cudaSetDevice(" + std::to_string(device) + ")");
  ncclUniqueId uid;
  std::memcpy(uid.internal, id.data(), sizeof(uid.internal));
  ncclComm_t c = nullptr;
  nccl_check(ncclCommInitRank(&c, nranks, uid, rank), "ncclCommInitRank(rank " + std::to_string(rank) + ")");
  return std::make_unique<NcclComm>(c, rank, nranks, device);
}

}  // namespace twin::rt
