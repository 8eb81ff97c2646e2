// backends.cpp: picks the implementation of a backend for each runtime interface (device, GEMM,
// collectives). The CUDA ones exist only in builds with TWIN_HAVE_CUDA (NCCL: TWIN_HAVE_NCCL).
#include "optimized/runtime/collectives.h"
#include "optimized/runtime/device.h"
#include "optimized/runtime/gemm.h"

namespace twin::rt {

Device& sim_device();  // device_sim.cpp
Gemm& sim_gemm();      // gemm_sim.cpp
#if TWIN_HAVE_CUDA
Device& cuda_device();  // device_cuda.cpp
bool cuda_device_present(std::string* why);
Gemm& cublaslt_gemm();  // gemm_cublaslt.cpp
#endif

const char* backend_name(Backend b) { return b == Backend::Sim ? "sim" : "cuda"; }

bool available(Backend b, std::string* why) {
  if (b == Backend::Sim) return true;
#if TWIN_HAVE_CUDA
  return cuda_device_present(why);
#else
  if (why) *why = "built without CUDA (nvcc was not found, or an ASan build)";
  return false;
#endif
}

Device& device(Backend b) {
  if (b == Backend::Sim) return sim_device();
  std::string why;
  if (!available(b, &why)) throw CudaError("device(cuda): not available: " + why);
#if TWIN_HAVE_CUDA
  return cuda_device();
#else
  throw CudaError("device(cuda): " + why);
#endif
}

Gemm& gemm(Backend b) {
  if (b == Backend::Sim) return sim_gemm();
  device(b);  // throws when CUDA is not available
#if TWIN_HAVE_CUDA
  return cublaslt_gemm();
#else
  throw CudaError("gemm(cuda): built without CUDA");
#endif
}

#if !TWIN_HAVE_NCCL
std::vector<std::unique_ptr<Communicator>> make_nccl_group(const std::vector<int>&) {
  throw CudaError("make_nccl_group: built without NCCL");
}
NcclId nccl_unique_id() { throw CudaError("nccl_unique_id: built without NCCL"); }
std::unique_ptr<Communicator> make_nccl_communicator(int, int, const NcclId&, int) {
  throw CudaError("make_nccl_communicator: built without NCCL");
}
#endif

}  // namespace twin::rt
