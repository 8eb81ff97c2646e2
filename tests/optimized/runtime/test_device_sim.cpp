// The simulated device runtime: the shared runtime cases (graphs, copies, events) on the
// simulator, and the simulator's own checks on device pointers and capture misuse.
#include "tests/optimized/runtime/sim_fixture.h"

#define RUNTIME_FIXTURE SimTest
#include "tests/optimized/runtime/runtime_cases.inc"

#include <sstream>
#include <vector>

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

TEST_F(SimTest, ElapsedTimeOfAnUnrecordedEventIsAnError) {
  twin::rt::Device& d = dev();
  twin::rt::Event recorded(d), never(d);
  d.record(recorded.handle(), nullptr);  // on the default stream
  for (const bool start_recorded : {true, false}) {
    try {
      (void)(start_recorded ? never.elapsed_ms_since(recorded) : recorded.elapsed_ms_since(never));
      ADD_FAILURE() << "elapsed time of an unrecorded event accepted";
    } catch (const twin::rt::CudaError& e) {
      EXPECT_NE(std::string(e.what()).find("cudaEventElapsedTime [sim]: cudaErrorInvalidResourceHandle: an event "
                                           "was not recorded"),
                std::string::npos)
          << e.what();
    }
  }
  // Recorded on a capturing stream, the event is recorded only when the graph runs.
  twin::rt::Stream s(d);
  twin::rt::Event captured(d);
  s.begin_capture();
  captured.record(s);
  twin::rt::Graph g = s.end_capture();
  EXPECT_THROW(captured.elapsed_ms_since(recorded), twin::rt::CudaError);
  g.launch(s);
  EXPECT_GE(captured.elapsed_ms_since(recorded), 0.0f);
}

TEST_F(SimTest, FreeOfADeadPointerIsReported) {
  twin::rt::Device& d = dev();
  void* p = d.malloc(64);
  d.free(p);
  std::ostringstream name;
  name << p;
  // cudaFree cannot throw (destructors call it): the report goes to stderr and nothing is freed.
  ::testing::internal::CaptureStderr();
  d.free(p);
  int on_stack = 0;
  d.free(&on_stack);
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("cudaFree(" + name.str() + ") [sim]: not a live device allocation"), std::string::npos) << err;
  std::ostringstream stack_name;
  stack_name << static_cast<void*>(&on_stack);
  EXPECT_NE(err.find("cudaFree(" + stack_name.str() + ") [sim]: not a live device allocation"), std::string::npos)
      << err;
  // The allocator is intact afterwards.
  twin::rt::DeviceBuffer b(d, 64);
  std::vector<char> host(64, 7), back(64);
  b.upload(host.data(), 64);
  b.download(back.data(), 64);
  EXPECT_EQ(back, host);
}

TEST(Backends, CudaIsReportedUnavailableWithAReason) {
  std::string why;
  if (twin::rt::available(twin::rt::Backend::Cuda, &why)) GTEST_SKIP() << "a CUDA device is present";
  EXPECT_FALSE(why.empty());
  EXPECT_THROW(twin::rt::device(twin::rt::Backend::Cuda), twin::rt::CudaError);
}
