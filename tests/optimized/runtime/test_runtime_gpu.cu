// The simulator's semantics and runtime cases, compiled by nvcc (sm_90) and run on a GPU: the
// same kernel files and the same expectations as test_cudasim_semantics.cpp / test_device_sim.cpp.
// The negative kernels are compiled too (they must build with nvcc) but never launched here.
#include "tests/optimized/runtime/gpu_fixture.h"

#define SEMANTICS_FIXTURE GpuTest
#include "tests/optimized/runtime/semantics_cases.inc"

#define RUNTIME_FIXTURE GpuTest
#include "tests/optimized/runtime/runtime_cases.inc"

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
};
