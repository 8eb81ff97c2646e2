// The simulator's semantics and runtime cases, compiled by nvcc (sm_90) and run on a GPU: the
// same kernel files and the same expectations as test_cudasim_semantics.cpp / test_device_sim.cpp.
// The WMMA products of wmma_cases.inc run here too. The negative and WMMA misuse kernels are
// compiled too (they must build with nvcc) but never launched here.
#include "tests/optimized/runtime/gpu_fixture.h"

#define SEMANTICS_FIXTURE GpuTest
#include "tests/optimized/runtime/semantics_cases.inc"

#define RUNTIME_FIXTURE GpuTest
#include "tests/optimized/runtime/runtime_cases.inc"

class WmmaGpuTest : public GpuTest {
 protected:
  template <class F>
  void for_each_order(F f) {
    f();  // a GPU has no resume order to vary
  }
};
#define WMMA_FIXTURE WmmaGpuTest
#include "tests/optimized/runtime/wmma_cases.inc"

#include "tests/optimized/runtime/kernels/negative_kernels.cuh"

// Keeps the negative kernels referenced so nvcc generates their device code.
[[maybe_unused]] static void* const negative_kernels_compiled[] = {
    reinterpret_cast<void*>(&negative::early_return_forward_kernel),
    reinterpret_cast<void*>(&negative::split_barrier_forward_kernel),
    reinterpret_cast<void*>(&negative::shuffle_missing_lane_forward_kernel),
    reinterpret_cast<void*>(&negative::partial_warp_shuffle_forward_kernel),
    reinterpret_cast<void*>(&negative::partial_warp_full_mask_forward_kernel),
    reinterpret_cast<void*>(&negative::caller_not_in_mask_forward_kernel),
    reinterpret_cast<void*>(&negative::shuffle_bad_width_forward_kernel),
    reinterpret_cast<void*>(&negative::shuffle_source_outside_mask_forward_kernel),
    reinterpret_cast<void*>(&negative::neighbour_forward_kernel),
    reinterpret_cast<void*>(&negative::throwing_forward_kernel),
    reinterpret_cast<void*>(&wmma_kernels::diverged_mma_kernel),
    reinterpret_cast<void*>(&wmma_kernels::returned_lane_kernel),
    reinterpret_cast<void*>(&wmma_kernels::bad_ldm_kernel),
    reinterpret_cast<void*>(&wmma_kernels::bad_store_ldm_kernel),
    reinterpret_cast<void*>(&wmma_kernels::nonuniform_ldm_kernel),
    reinterpret_cast<void*>(&wmma_kernels::misaligned_kernel),
    reinterpret_cast<void*>(&wmma_kernels::partial_warp_kernel),
};
