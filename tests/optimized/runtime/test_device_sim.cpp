// The simulated device runtime: the shared runtime cases (graphs, copies, events) on the
// simulator, and the simulator's own checks on device pointers and capture misuse.
#include "tests/optimized/runtime/sim_fixture.h"

#define RUNTIME_FIXTURE SimTest
#include "tests/optimized/runtime/runtime_cases.inc"

TEST_F(SimTest, CopiesOutsideADeviceAllocationAreErrors) {
  twin::rt::Device& d = dev();
  twin::rt::DeviceBuffer a(d, 64);
  std::vector<char> host(128);
  try {
    d.copy(a.as<char>() + 32, host.data(), 64, twin::rt::CopyKind::HostToDevice, nullptr);
    ADD_FAILURE() << "overrunning copy accepted";
  } catch (const twin::rt::CudaError& e) {
    EXPECT_NE(std::string(e.what()).find("cudaMemcpyAsync(HostToDevice)"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("runs past the end of its allocation of 64 bytes"), std::string::npos)
        << e.what();
  }
  try {
    d.copy(host.data(), host.data() + 64, 8, twin::rt::CopyKind::DeviceToHost, nullptr);
    ADD_FAILURE() << "host pointer accepted as device source";
  } catch (const twin::rt::CudaError& e) {
    EXPECT_NE(std::string(e.what()).find("is not inside a live device allocation"), std::string::npos) << e.what();
  }
}

TEST_F(SimTest, CaptureMisuseIsAnError) {
  twin::rt::Device& d = dev();
  twin::rt::Stream s(d);
  EXPECT_THROW(d.begin_capture(nullptr), twin::rt::CudaError);  // the default stream
  EXPECT_THROW(s.end_capture(), twin::rt::CudaError);           // not capturing
  s.begin_capture();
  EXPECT_THROW(s.begin_capture(), twin::rt::CudaError);
  EXPECT_THROW(s.synchronize(), twin::rt::CudaError);
  twin::rt::Graph g = s.end_capture();
  g.launch(s);  // an empty graph replays nothing
}

TEST(Backends, CudaIsReportedUnavailableWithAReason) {
  std::string why;
  if (twin::rt::available(twin::rt::Backend::Cuda, &why)) GTEST_SKIP() << "a CUDA device is present";
  EXPECT_FALSE(why.empty());
  EXPECT_THROW(twin::rt::device(twin::rt::Backend::Cuda), twin::rt::CudaError);
}
