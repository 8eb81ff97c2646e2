// The simulator's nvcuda::wmma (optimized/include/cudasim/wmma.h): products against a double
// product in every resume order (wmma_cases.inc, shared with the GPU test), and each misuse of
// kernels/wmma_kernels.cuh reported as a KernelError naming the kernel and the marked source line.
#include "tests/optimized/runtime/marked_line.h"
#include "tests/optimized/runtime/sim_fixture.h"

#include <string>

class WmmaSimTest : public SimTest {
 protected:
  // Each resume order once (the product must not depend on which lane arrives last).
  template <class F>
  void for_each_order(F f) {
    for (cudasim::Order o : {cudasim::Order::Forward, cudasim::Order::Reverse, cudasim::Order::Random}) {
      SCOPED_TRACE(cudasim::order_name(o));
      set_order(o);
      f();
    }
  }
};

#define WMMA_FIXTURE WmmaSimTest
#include "tests/optimized/runtime/wmma_cases.inc"

namespace {

std::string marked(const std::string& marker) {
  return "wmma_kernels.cuh:" + std::to_string(twin::testing::marked_line(wmma_kernels::source_file(), marker));
}

}  // namespace

TEST_F(WmmaSimTest, DivergedWarpIsReportedWithBothCallSites) {
  for_each_order([&] {
    twin::rt::DeviceBuffer a(dev(), 256 * 2), d(dev(), 256 * 4);
    const std::string m = launch_error([&] {
      launch_kernel(wmma_kernels::diverged_mma_kernel, 1, 32, 0, nullptr, a.as<const __nv_bfloat16>(), d.as<float>());
    });
    EXPECT_HAS(m, "wmma_kernels::diverged_mma_kernel");
    EXPECT_HAS(m, "wmma::mma_sync");
    EXPECT_HAS(m, "diverged");
    EXPECT_HAS(m, marked("diverged_low"));
    EXPECT_HAS(m, marked("diverged_high"));
  });
}

TEST_F(WmmaSimTest, LaneThatReturnedIsReported) {
  for_each_order([&] {
    twin::rt::DeviceBuffer a(dev(), 256 * 2), d(dev(), 64 * 4);
    const std::string m = launch_error([&] {
      launch_kernel(wmma_kernels::returned_lane_kernel, 1, 64, 0, nullptr, a.as<const __half>(), d.as<float>());
    });
    EXPECT_HAS(m, "wmma_kernels::returned_lane_kernel");
    EXPECT_HAS(m, "wmma::load_matrix_sync");
    EXPECT_HAS(m, marked("returned_lane"));
    EXPECT_HAS(m, "has returned");
  });
}

TEST_F(WmmaSimTest, WrongLeadingDimensionIsReported) {
  twin::rt::DeviceBuffer a(dev(), 16 * 32 * 2), d(dev(), 16 * 32 * 4);
  std::string m = launch_error([&] {
    launch_kernel(wmma_kernels::bad_ldm_kernel, 1, 32, 0, nullptr, a.as<const __nv_bfloat16>(), d.as<float>());
  });
  EXPECT_HAS(m, "wmma::load_matrix_sync at ");
  EXPECT_HAS(m, marked("bad_ldm"));
  EXPECT_HAS(m, "ldm 20 must be a positive multiple of 8");
  m = launch_error([&] { launch_kernel(wmma_kernels::bad_store_ldm_kernel, 1, 32, 0, nullptr, d.as<float>()); });
  EXPECT_HAS(m, "wmma::store_matrix_sync at ");
  EXPECT_HAS(m, marked("bad_store_ldm"));
  EXPECT_HAS(m, "ldm 18 must be a positive multiple of 4");
}

TEST_F(WmmaSimTest, LeadingDimensionDifferingBetweenLanesIsReported) {
  twin::rt::DeviceBuffer a(dev(), 16 * 32 * 2), d(dev(), 32 * 4);
  const std::string m = launch_error([&] {
    launch_kernel(wmma_kernels::nonuniform_ldm_kernel, 1, 32, 0, nullptr, a.as<const __half>(), d.as<float>());
  });
  EXPECT_HAS(m, marked("nonuniform_ldm"));
  EXPECT_HAS(m, "lane 9 passes another pointer, ldm or layout");
}

TEST_F(WmmaSimTest, MisalignedPointerIsReported) {
  twin::rt::DeviceBuffer a(dev(), 16 * 32 * 2), d(dev(), 32 * 4);
  const std::string m = launch_error(
      [&] { launch_kernel(wmma_kernels::misaligned_kernel, 1, 32, 0, nullptr, a.as<const __half>(), d.as<float>()); });
  EXPECT_HAS(m, marked("misaligned"));
  EXPECT_HAS(m, "32-byte) aligned");
}

TEST_F(WmmaSimTest, PartialWarpIsReported) {
  twin::rt::DeviceBuffer d(dev(), 2 * 256 * 4);
  const std::string m =
      launch_error([&] { launch_kernel(wmma_kernels::partial_warp_kernel, 1, 48, 0, nullptr, d.as<float>()); });
  EXPECT_HAS(m, marked("partial_warp"));
  EXPECT_HAS(m, "needs a full warp of 32 threads; warp 1 has 16");
}
