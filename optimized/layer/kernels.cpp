#include "optimized/layer/kernels.h"

#include "core/config.h"  // ConfigError

#include "optimized/layer/backend_entries.h"

namespace twin::opt {

#define TWIN_LAYER_KERNELS(ns)                                                                                      \
  LayerKernels {                                                                                                    \
    ns::rank_forward, ns::rank_backward, ns::rank_backward_workspace_bytes, ns::moe_router_phase,                   \
        ns::moe_expert_compute, ns::moe_postprocess, ns::moe_backward_postprocess, ns::moe_backward_expert_compute, \
        ns::moe_backward_router, ns::moe_rank_backward_workspace_bytes, ns::op_launchers()                          \
  }

const LayerKernels& layer_kernels(rt::Backend backend) {
  static const LayerKernels sim_kernels = TWIN_LAYER_KERNELS(sim);
#if TWIN_HAVE_CUDA
  static const LayerKernels cuda_kernels = TWIN_LAYER_KERNELS(cuda);
  if (backend == rt::Backend::Cuda) return cuda_kernels;
#else
  if (backend == rt::Backend::Cuda)
    throw ConfigError("this build has no CUDA backend (run on the simulator, Backend::Sim)");
#endif
  return sim_kernels;
}

#undef TWIN_LAYER_KERNELS

}  // namespace twin::opt
