// An out-of-bounds global write in a simulated kernel is reported by AddressSanitizer with the
// kernel's source line (only in the ASan build: `cmake --preset asan`; skipped elsewhere).
#include "optimized/runtime/cudasim_options.h"
#include "optimized/runtime/device.h"
#include "tests/optimized/runtime/kernels/oob_kernels.cuh"
#include "tests/optimized/runtime/marked_line.h"

#include <gtest/gtest.h>

#include <string>

using twin::testing::marked_line;

TEST(SimAsan, OutOfBoundsGlobalWriteIsReportedWithItsSourceLine) {
#if !defined(TWIN_ASAN)
  GTEST_SKIP() << "needs the AddressSanitizer build (cmake --preset asan)";
#else
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const int line = marked_line(oob::source_file(), "oob_write");
  ASSERT_GT(line, 0);
  const std::string pattern = "heap-buffer-overflow.*WRITE of size 4.*oob_kernels.cuh:" + std::to_string(line);
  EXPECT_DEATH(
      {
        cudasim::Options o = cudasim::options();
        o.workers = 1;
        cudasim::set_options(o);
        const int n = 200;
        twin::rt::DeviceBuffer out(twin::rt::device(twin::rt::Backend::Sim), n * sizeof(float));
        launch_kernel(oob::off_by_one_write_forward_kernel, 2, 128, 0, nullptr, out.as<float>(), n);
      },
      pattern);
#endif
}

TEST(SimAsan, OutOfBoundsWriteToAThreadsLocalArrayIsReported) {
#if !defined(TWIN_ASAN)
  GTEST_SKIP() << "needs the AddressSanitizer build (cmake --preset asan)";
#else
  // The local array is on a fiber stack: this checks the fiber-switch annotations too.
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const int line = marked_line(oob::source_file(), "oob_local");
  ASSERT_GT(line, 0);
  const std::string pattern = "stack-buffer-overflow.*WRITE of size 4.*oob_kernels.cuh:" + std::to_string(line);
  EXPECT_DEATH(
      {
        twin::rt::DeviceBuffer out(twin::rt::device(twin::rt::Backend::Sim), 64 * sizeof(float));
        launch_kernel(oob::local_array_overflow_forward_kernel, 1, 64, 0, nullptr, out.as<float>(), 37);
      },
      pattern);
#endif
}

TEST(SimAsan, InBoundsKernelRunsCleanUnderAsan) {
  const int n = 255;  // 256 threads write elements 0..255 = 0..n
  twin::rt::DeviceBuffer out(twin::rt::device(twin::rt::Backend::Sim), (n + 1) * sizeof(float));
  launch_kernel(oob::off_by_one_write_forward_kernel, 2, 128, 0, nullptr, out.as<float>(), n);
  std::vector<float> host(n + 1);
  out.download(host.data(), (n + 1) * sizeof(float));
  for (float v : host) EXPECT_EQ(v, 1.0f);
}
