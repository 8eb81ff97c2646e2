// Simulator error reports: each bug in kernels/negative_kernels.cuh must make the launch throw
// cudasim::KernelError (a std::runtime_error) whose message names the kernel and the source line;
// a missing barrier must give a wrong result in at least one resume order.
#include "tests/optimized/runtime/kernels/negative_kernels.cuh"
#include "tests/optimized/runtime/marked_line.h"
#include "tests/optimized/runtime/sim_fixture.h"

#include <string>
#include <vector>

namespace {

// "negative_kernels.cuh:<line>" of the line marked `// @marker`.
std::string marked(const std::string& marker) {
  return "negative_kernels.cuh:" + std::to_string(twin::testing::marked_line(negative::source_file(), marker));
}

}  // namespace

TEST_F(SimTest, ThreadReturningBeforeABarrierIsReported) {
  twin::rt::DeviceBuffer out(dev(), 64 * 4);
  std::string m =
      launch_error([&] { launch_kernel(negative::early_return_forward_kernel, 2, 64, 0, nullptr, out.as<float>()); });
  EXPECT_HAS(m, "negative::early_return_forward_kernel");
  EXPECT_HAS(m, marked("early_return"));
  EXPECT_HAS(m, "thread (5,0,0)");
  EXPECT_HAS(m, "returned before");
}

TEST_F(SimTest, ThreadsAtDifferentBarriersAreReported) {
  twin::rt::DeviceBuffer out(dev(), 64 * 4);
  std::string m =
      launch_error([&] { launch_kernel(negative::split_barrier_forward_kernel, 1, 64, 0, nullptr, out.as<float>()); });
  EXPECT_HAS(m, "negative::split_barrier_forward_kernel");
  EXPECT_HAS(m, "different __syncthreads()");
  EXPECT_HAS(m, marked("split_a"));
  EXPECT_HAS(m, marked("split_b"));
}

TEST_F(SimTest, ShuffleWaitingForALaneThatNeverArrivesIsReported) {
  twin::rt::DeviceBuffer out(dev(), 64 * 4);
  std::string m = launch_error(
      [&] { launch_kernel(negative::shuffle_missing_lane_forward_kernel, 1, 64, 0, nullptr, out.as<int>()); });
  EXPECT_HAS(m, "negative::shuffle_missing_lane_forward_kernel");
  EXPECT_HAS(m, "__shfl_xor_sync at");
  EXPECT_HAS(m, marked("missing_lane"));
  EXPECT_HAS(m, "names lane 7");
  EXPECT_HAS(m, "has returned");
}

TEST_F(SimTest, ShuffleReadingALaneThatDoesNotExistIsReported) {
  twin::rt::DeviceBuffer out(dev(), 16 * 4);
  std::string m = launch_error(
      [&] { launch_kernel(negative::partial_warp_shuffle_forward_kernel, 1, 16, 0, nullptr, out.as<int>()); });
  EXPECT_HAS(m, "negative::partial_warp_shuffle_forward_kernel");
  EXPECT_HAS(m, marked("partial_warp"));
  EXPECT_HAS(m, "reads lane 16, which does not exist");
}

TEST_F(SimTest, MaskNamingLanesThatDoNotExistIsReported) {
  twin::rt::DeviceBuffer out(dev(), 16 * 4);
  std::string m = launch_error(
      [&] { launch_kernel(negative::partial_warp_full_mask_forward_kernel, 1, 16, 0, nullptr, out.as<int>()); });
  EXPECT_HAS(m, "negative::partial_warp_full_mask_forward_kernel");
  EXPECT_HAS(m, marked("full_mask"));
  EXPECT_HAS(m, "names lanes that do not exist");
}

TEST_F(SimTest, CallingLaneMissingFromItsMaskIsReported) {
  twin::rt::DeviceBuffer out(dev(), 32 * 4);
  std::string m = launch_error(
      [&] { launch_kernel(negative::caller_not_in_mask_forward_kernel, 1, 32, 0, nullptr, out.as<int>()); });
  EXPECT_HAS(m, "negative::caller_not_in_mask_forward_kernel");
  EXPECT_HAS(m, marked("not_in_mask"));
  EXPECT_HAS(m, "is not in its mask 0x1");
}

TEST_F(SimTest, ShuffleWidthNotAPowerOfTwoInOneToThirtyTwoIsReported) {
  twin::rt::DeviceBuffer out(dev(), 32 * 4);
  for (int width : {0, 3, 12, 64}) {
    std::string m = launch_error(
        [&] { launch_kernel(negative::shuffle_bad_width_forward_kernel, 1, 32, 0, nullptr, out.as<int>(), width); });
    EXPECT_HAS(m, "negative::shuffle_bad_width_forward_kernel");
    EXPECT_HAS(m, "__shfl_sync at");
    EXPECT_HAS(m, marked("bad_width"));
    EXPECT_HAS(m, "width " + std::to_string(width) + " is not a power of two in [1, 32]");
  }
  // The valid widths run (their results are checked by the semantics cases).
  for (int width : {1, 2, 4, 8, 16, 32})
    launch_kernel(negative::shuffle_bad_width_forward_kernel, 1, 32, 0, nullptr, out.as<int>(), width);
}

TEST_F(SimTest, ShuffleReadingALaneOutsideTheMaskIsReported) {
  twin::rt::DeviceBuffer out(dev(), 32 * 4);
  std::string m = launch_error(
      [&] { launch_kernel(negative::shuffle_source_outside_mask_forward_kernel, 1, 32, 0, nullptr, out.as<int>()); });
  EXPECT_HAS(m, "negative::shuffle_source_outside_mask_forward_kernel");
  EXPECT_HAS(m, "__shfl_down_sync at");
  EXPECT_HAS(m, marked("outside_mask"));
  // Lane 8 is the first lane whose source (8 + 8 = 16) lies outside 0xffff.
  EXPECT_HAS(m, "thread (8,0,0)");
  EXPECT_HAS(m, "(warp 0, lane 8) reads lane 16, which is not in the mask 0xffff");
}

TEST_F(SimTest, ExceptionInKernelNamesKernelBlockAndThread) {
  twin::rt::DeviceBuffer out(dev(), 64 * 4);
  std::string m =
      launch_error([&] { launch_kernel(negative::throwing_forward_kernel, 4, 16, 0, nullptr, out.as<int>()); });
  EXPECT_HAS(m, "negative::throwing_forward_kernel");
  EXPECT_HAS(m, "block (1,0,0) thread (3,0,0)");
  EXPECT_HAS(m, "bad value");
}

TEST_F(SimTest, MissingBarrierGivesAWrongResultInSomeOrder) {
  const int n = 128;
  std::vector<float> in(n);
  for (int i = 0; i < n; ++i) in[i] = 1.0f + i;
  twin::rt::DeviceBuffer din(dev(), n * 4), dout(dev(), n * 4);
  din.upload(in.data(), n * 4);
  auto run = [&](bool sync) {
    launch_kernel(negative::neighbour_forward_kernel, 1, n, n * sizeof(float), nullptr, din.as<const float>(),
                  dout.as<float>(), sync);
    std::vector<float> out(n);
    dout.download(out.data(), n * 4);
    for (int t = 0; t < n; ++t)
      if (out[t] != in[(t + 1) % n]) return false;
    return true;
  };
  int wrong_orders = 0;
  for (cudasim::Order order : {cudasim::Order::Forward, cudasim::Order::Reverse, cudasim::Order::Random}) {
    set_order(order);
    EXPECT_TRUE(run(true)) << "with the barrier, order " << cudasim::order_name(order);
    if (!run(false)) ++wrong_orders;
  }
  EXPECT_GE(wrong_orders, 1) << "the missing barrier went unnoticed in every order";
}

TEST_F(SimTest, SimulatorRecoversAfterAFailedLaunch) {
  twin::rt::DeviceBuffer out(dev(), 64 * 4);
  for (int i = 0; i < 3; ++i)
    EXPECT_THROW(launch_kernel(negative::early_return_forward_kernel, 8, 64, 0, nullptr, out.as<float>()),
                 cudasim::KernelError);
  std::vector<float> in(64, 2.0f);
  twin::rt::DeviceBuffer din(dev(), 64 * 4);
  din.upload(in.data(), 64 * 4);
  launch_kernel(negative::neighbour_forward_kernel, 1, 64, 64 * 4, nullptr, din.as<const float>(), out.as<float>(),
                true);
  std::vector<float> got(64);
  out.download(got.data(), 64 * 4);
  for (float v : got) EXPECT_EQ(v, 2.0f);
}

namespace {
// Simulator-only kernel (a .cpp file): unbounded recursion exhausts the thread's fiber stack.
__device__ int deep_recursion(int n) {
  volatile char pad[512];
  pad[n % 512] = static_cast<char>(n);
  return n == 0 ? 0 : deep_recursion(n - 1) + pad[n % 512];
}
__global__ void stack_overflow_forward_kernel(int* out, int depth) { out[threadIdx.x] = deep_recursion(depth); }
}  // namespace

namespace {
// Simulator-only kernels (a .cpp file): nvcc would reject a host launch inside a kernel.
__global__ void launched_from_device_forward_kernel(int* out) { out[threadIdx.x] = 1; }
int g_inner_launch_line = 0;
__global__ void launching_forward_kernel(int* out) {
  if (threadIdx.x == 2) {
    g_inner_launch_line = __LINE__ + 1;
    launch_kernel(launched_from_device_forward_kernel, 1, 1, 0, nullptr, out);
  }
  out[threadIdx.x] = 0;
}
}  // namespace

TEST_F(SimTest, LaunchFromDeviceCodeIsReported) {
  twin::rt::DeviceBuffer out(dev(), 4 * 4);
  std::string m = launch_error([&] { launch_kernel(launching_forward_kernel, 1, 4, 0, nullptr, out.as<int>()); });
  EXPECT_HAS(m, "kernel 'launching_forward_kernel' block (0,0,0) thread (2,0,0)");
  EXPECT_HAS(m, "launch_kernel(launched_from_device_forward_kernel) at " + std::string(__FILE__) + ":" +
                    std::to_string(g_inner_launch_line));
  EXPECT_HAS(m, "launching from device code (dynamic parallelism) is not supported");
}

TEST(SimDeathTest, FiberStackOverflowIsReportedNotASilentCrash) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
#if defined(TWIN_ASAN)
  const char* pattern = "AddressSanitizer";  // ASan reports the overflow itself
#else
  const char* pattern = "overflowed its fiber stack.*CUDASIM_STACK_KB";
#endif
  EXPECT_DEATH(
      {
        twin::rt::DeviceBuffer out(twin::rt::device(twin::rt::Backend::Sim), 32 * 4);
        launch_kernel(stack_overflow_forward_kernel, 1, 32, 0, nullptr, out.as<int>(), 1 << 20);
      },
      pattern);
}
