// Simulator semantics: the shared cases of semantics_cases.inc on the simulator, plus behaviour
// only the simulator has (dynamic shared memory poison, launch configuration checks).
#include "tests/optimized/runtime/sim_fixture.h"

#define SEMANTICS_FIXTURE SimTest
#include "tests/optimized/runtime/semantics_cases.inc"

#include "cuda_compat.h"

#include <thread>

TEST_F(SimTest, DynamicSharedMemoryIsPoisonedBeforeEachBlock) {
  using namespace semantics_test;
  const int blocks = 3, threads = 64;
  twin::rt::DeviceBuffer out(dev(), blocks * threads * 4);
  // Dirty the shared buffer first: the next launch must not see these values.
  std::vector<float> in(blocks * threads, 1.0f);
  auto din = upload(dev(), in);
  twin::rt::DeviceBuffer tmp(dev(), blocks * threads * 4);
  launch_kernel(semantics::shared_reverse_dynamic_kernel, blocks, threads, threads * 4, nullptr, din.as<const float>(),
                tmp.as<float>());
  launch_kernel(semantics::shared_read_uninitialized_kernel, blocks, threads, threads * 4, nullptr, out.as<unsigned>());
  for (unsigned v : download<unsigned>(out, blocks * threads)) ASSERT_EQ(v, 0xffffffffu);
}

TEST_F(SimTest, StaticSharedMemoryIsPoisonedBeforeEachBlock) {
  using namespace semantics_test;
  const int blocks = 6, threads = 64;
  twin::rt::DeviceBuffer out(dev(), blocks * threads * 4);
  // Blocks that write 7 run first (on the same workers); the next launch must not see the 7s.
  launch_kernel(semantics::static_shared_probe_kernel, blocks, threads, 0, nullptr, out.as<unsigned>(), true);
  launch_kernel(semantics::static_shared_probe_kernel, blocks, threads, 0, nullptr, out.as<unsigned>(), false);
  for (unsigned v : download<unsigned>(out, blocks * threads)) ASSERT_EQ(v, 0xffffffffu);
}

TEST_F(SimTest, BadLaunchConfigurationsAreErrors) {
  twin::rt::DeviceBuffer out(dev(), 4096 * 4);
  auto expect_error = [&](dim3 grid, dim3 block, std::size_t smem, const char* what) {
    try {
      launch_kernel(semantics::shared_read_uninitialized_kernel, grid, block, smem, nullptr, out.as<unsigned>());
      ADD_FAILURE() << "no error for " << what;
    } catch (const cudasim::KernelError& e) {
      EXPECT_NE(std::string(e.what()).find("semantics::shared_read_uninitialized_kernel"), std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  expect_error(dim3(1), dim3(2048), 0, "exceeds (1024,1024,64)");
  expect_error(dim3(1), dim3(64, 32), 0, "more than 1024 threads");
  expect_error(dim3(0), dim3(32), 0, "zero dimension");
  expect_error(dim3(1), dim3(32), 300 * 1024, "227 KiB");
  // CUDA's grid limits: y and z at most 65535 (x up to 2^31 - 1).
  expect_error(dim3(1, 65536, 1), dim3(32), 0, "grid (1,65536,1): y and z must be <= 65535");
  expect_error(dim3(1, 1, 65536), dim3(32), 0, "grid (1,1,65536): y and z must be <= 65535");
}

TEST_F(SimTest, ConcurrentLaunchesFromSeveralHostThreads) {
  // Simulated ranks are host threads that launch kernels at the same time.
  using namespace semantics_test;
  const int nthreads = 4, blocks = 16, threads = 128, n = blocks * threads;
  std::vector<std::vector<float>> results(nthreads);
  std::vector<std::thread> hosts;
  for (int h = 0; h < nthreads; ++h)
    hosts.emplace_back([&, h] {
      std::vector<float> in(n);
      for (int i = 0; i < n; ++i) in[i] = static_cast<float>(h * n + i);
      auto din = upload(dev(), in);
      twin::rt::DeviceBuffer dout(dev(), n * 4);
      for (int rep = 0; rep < 5; ++rep)
        launch_kernel(semantics::shared_reverse_dynamic_kernel, blocks, threads, threads * 4, nullptr,
                      din.as<const float>(), dout.as<float>());
      results[h] = download<float>(dout, n);
    });
  for (auto& t : hosts) t.join();
  for (int h = 0; h < nthreads; ++h)
    for (int b = 0; b < blocks; ++b)
      for (int t = 0; t < threads; ++t)
        ASSERT_EQ(results[h][b * threads + t], static_cast<float>(h * n + b * threads + threads - 1 - t))
            << h << " " << b << " " << t;
}

TEST_F(SimTest, ThreadIdxOutsideAKernelIsAnError) { EXPECT_THROW((void)threadIdx.x, cudasim::KernelError); }
