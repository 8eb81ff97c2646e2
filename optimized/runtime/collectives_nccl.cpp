// collectives_nccl.cpp: collectives on GPUs with NCCL (CUDA builds with NCCL only; needs GPUs).
//
// Design: one ncclComm_t per rank and GPU. make_nccl_group creates all ranks of one process with
// ncclCommInitAll; make_nccl_communicator joins a multi-process group from a unique id. Each call
// selects the rank's device, then enqueues the NCCL collective on the given stream;
// all_to_all is a group of ncclSend/ncclRecv pairs (zero-size parts are skipped on both sides,
// which stay consistent because rank q's send_counts[p] equals rank p's recv_counts[q]).
// libnccl is opened when the first communicator is made (dynlib.h says why); nccl.h only gives
// the types.
#include "optimized/runtime/collectives.h"
#include "optimized/runtime/cuda_check.h"
#include "optimized/runtime/dynlib.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstring>
#include <string>

#ifndef TWIN_NCCL_DIR
#define TWIN_NCCL_DIR ""
#endif

namespace twin::rt {
namespace {

// Every NCCL entry point this file calls; each is called as nccl().<name>.
// An X-macro list, laid out by hand (clang-format would split the X(...) items).
// clang-format off
#define TWIN_NCCL_FUNCTIONS(X)                                                                     \
  X(ncclGetErrorString) X(ncclGetUniqueId) X(ncclCommInitAll) X(ncclCommInitRank)                  \
  X(ncclCommDestroy) X(ncclAllReduce) X(ncclAllGather) X(ncclReduceScatter) X(ncclBroadcast)       \
  X(ncclSend) X(ncclRecv) X(ncclGroupStart) X(ncclGroupEnd)
// clang-format on

struct NcclApi {
  TWIN_NCCL_FUNCTIONS(TWIN_DYNLIB_DECLARE_FN)
};

bool resolve_nccl(DynLib& lib, NcclApi& api) { return true TWIN_NCCL_FUNCTIONS(TWIN_DYNLIB_RESOLVE_FN); }

// Opened when the first communicator is made. The soname is that of the major version the header
// describes: another major is another ABI.
LazyLibrary<NcclApi>& nccl_lib() {
  static LazyLibrary<NcclApi> lib("NCCL", library_candidates("libnccl.so." + std::to_string(NCCL_MAJOR), TWIN_NCCL_DIR),
                                  resolve_nccl);
  return lib;
}
const NcclApi& nccl() { return nccl_lib().api(); }

void nccl_check(ncclResult_t r, const std::string& call) {
  if (r != ncclSuccess) throw CudaError(call + ": " + nccl_lib().loaded_api().ncclGetErrorString(r));
}

ncclDataType_t to_nccl(DType dt) {
  switch (dt) {
    case DType::F32:
      return ncclFloat32;
    case DType::F64:
      return ncclFloat64;
    case DType::BF16:
      return ncclBfloat16;
    case DType::F16:
      return ncclFloat16;
    case DType::I32:
      return ncclInt32;
    case DType::I64:
      return ncclInt64;
    case DType::BOOL:  // moved, never summed (a routing map)
      return ncclUint8;
    default:
      throw CollectiveError(std::string("NCCL: unsupported dtype ") + dtype_name(dt));
  }
}

class NcclComm final : public Communicator {
 public:
  NcclComm(ncclComm_t c, int rank, int size, int device) : c_(c), rank_(rank), size_(size), dev_(device) {}
  ~NcclComm() override {
    if (c_) nccl_lib().loaded_api().ncclCommDestroy(c_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Backend backend() const override { return Backend::Cuda; }

  void all_reduce(const void* send, void* recv, std::size_t count, DType dt, cudaStream_t s) override {
    use_device();
    nccl_check(nccl().ncclAllReduce(send, recv, count, to_nccl(dt), ncclSum, c_, s), "ncclAllReduce");
  }
  void all_gather(const void* send, void* recv, std::size_t count, DType dt, cudaStream_t s) override {
    use_device();
    nccl_check(nccl().ncclAllGather(send, recv, count, to_nccl(dt), c_, s), "ncclAllGather");
  }
  void reduce_scatter(const void* send, void* recv, std::size_t count, DType dt, cudaStream_t s) override {
    use_device();
    nccl_check(nccl().ncclReduceScatter(send, recv, count, to_nccl(dt), ncclSum, c_, s), "ncclReduceScatter");
  }
  void all_to_all(const void* send, const std::vector<std::size_t>& send_counts, void* recv,
                  const std::vector<std::size_t>& recv_counts, DType dt, cudaStream_t s) override {
    if (send_counts.size() != static_cast<std::size_t>(size_) || recv_counts.size() != static_cast<std::size_t>(size_))
      throw CollectiveError("NCCL all_to_all: counts must have one entry per rank (" + std::to_string(size_) + ")");
    use_device();
    const std::size_t es = dtype_size(dt);
    std::size_t soff = 0, roff = 0;
    nccl_check(nccl().ncclGroupStart(), "ncclGroupStart");
    for (int p = 0; p < size_; ++p) {
      if (send_counts[p])
        nccl_check(nccl().ncclSend(static_cast<const char*>(send) + soff, send_counts[p], to_nccl(dt), p, c_, s),
                   "ncclSend");
      if (recv_counts[p])
        nccl_check(nccl().ncclRecv(static_cast<char*>(recv) + roff, recv_counts[p], to_nccl(dt), p, c_, s), "ncclRecv");
      soff += send_counts[p] * es;
      roff += recv_counts[p] * es;
    }
    nccl_check(nccl().ncclGroupEnd(), "ncclGroupEnd");
  }
  void broadcast(const void* send, void* recv, std::size_t count, DType dt, int root, cudaStream_t s) override {
    use_device();
    nccl_check(nccl().ncclBroadcast(send, recv, count, to_nccl(dt), root, c_, s), "ncclBroadcast");
  }

 private:
  void use_device() { cuda_check(cudaSetDevice(dev_), "cudaSetDevice(" + std::to_string(dev_) + ")"); }
  ncclComm_t c_;
  int rank_, size_, dev_;
};

}  // namespace

std::string load_nccl() { return nccl_lib().error(); }

std::vector<std::unique_ptr<Communicator>> make_nccl_group(const std::vector<int>& devices) {
  std::vector<ncclComm_t> comms(devices.size());
  nccl_check(nccl().ncclCommInitAll(comms.data(), static_cast<int>(devices.size()), devices.data()), "ncclCommInitAll");
  std::vector<std::unique_ptr<Communicator>> out;
  for (std::size_t r = 0; r < devices.size(); ++r)
    out.push_back(
        std::make_unique<NcclComm>(comms[r], static_cast<int>(r), static_cast<int>(devices.size()), devices[r]));
  return out;
}

NcclId nccl_unique_id() {
  ncclUniqueId id;
  nccl_check(nccl().ncclGetUniqueId(&id), "ncclGetUniqueId");
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
  nccl_check(nccl().ncclCommInitRank(&c, nranks, uid, rank), "ncclCommInitRank(rank " + std::to_string(rank) + ")");
  return std::make_unique<NcclComm>(c, rank, nranks, device);
}

}  // namespace twin::rt
