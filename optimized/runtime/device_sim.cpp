// device_sim.cpp: the simulated device runtime (memory, copies, streams, events, graphs).
//
// Design: device memory is host memory from posix_memalign (256-byte aligned, like cudaMalloc), registered in a table
// so that copies and frees can check that a "device" pointer lies inside a live allocation (a wrong pointer is an error
// naming the call, not a silent host write). Work runs synchronously when enqueued, so a stream synchronize is a no-op
// and an event records the host time at which it was reached; under capture, copies and launches are appended to the
// stream's list, and a graph replays that list.
#include "optimized/runtime/device.h"
#include "optimized/runtime/sim_stream.h"

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <sstream>

namespace twin::rt {
namespace {

using cudasim::detail::sim_stream;
using cudasim::detail::SimStream;

struct SimEvent {
  std::chrono::steady_clock::time_point t{};
  bool recorded = false;
};
struct SimGraph {
  std::vector<std::function<void()>> steps;
};

std::string ptr_str(const void* p) {
  std::ostringstream os;
  os << p;
  return os.str();
}

class SimDevice final : public Device {
 public:
  Backend backend() const override { return Backend::Sim; }

  void* malloc(std::size_t bytes) override {
    if (bytes == 0) return nullptr;
    // Exactly `bytes` (no rounding up), so ASan's redzone starts right after the last element.
    void* p = nullptr;
    if (posix_memalign(&p, 256, bytes) != 0) p = nullptr;
    if (!p) throw CudaError("cudaMalloc(" + std::to_string(bytes) + " bytes) [sim]: out of host memory");
    std::lock_guard<std::mutex> lock(m_);
    allocs_[static_cast<char*>(p)] = bytes;
    return p;
  }
  void free(void* p) noexcept override {
    if (!p) return;
    std::lock_guard<std::mutex> lock(m_);
    auto it = allocs_.find(static_cast<char*>(p));
    if (it == allocs_.end()) {
      // A destructor cannot throw: report and keep going, as cudaFree would return an error code.
      std::fprintf(stderr, "cudaFree(%p) [sim]: not a live device allocation\n", p);
      return;
    }
    allocs_.erase(it);
    std::free(p);
  }

  void copy(void* dst, const void* src, std::size_t bytes, CopyKind kind, cudaStream_t stream) override {
    if (bytes == 0) return;
    const char* call = kind == CopyKind::HostToDevice   ? "cudaMemcpyAsync(HostToDevice)"
                       : kind == CopyKind::DeviceToHost ? "cudaMemcpyAsync(DeviceToHost)"
                                                        : "cudaMemcpyAsync(DeviceToDevice)";
    if (kind != CopyKind::DeviceToHost) check_range(dst, bytes, call, "destination");
    if (kind != CopyKind::HostToDevice) check_range(src, bytes, call, "source");
    if (!dst || !src) throw CudaError(std::string(call) + " [sim]: null pointer");
    cudasim::detail::enqueue(stream, [=] { std::memmove(dst, src, bytes); });
  }
  void memset(void* dst, int byte, std::size_t bytes, cudaStream_t stream) override {
    if (bytes == 0) return;
    check_range(dst, bytes, "cudaMemsetAsync", "destination");
    cudasim::detail::enqueue(stream, [=] { std::memset(dst, byte, bytes); });
  }
  void synchronize() override {}

  cudaStream_t create_stream() override { return cudasim::detail::to_handle(new SimStream()); }
  void destroy_stream(cudaStream_t s) noexcept override { delete sim_stream(s); }
  void synchronize(cudaStream_t s) override {
    if (s && sim_stream(s)->capturing)
      throw CudaError("cudaStreamSynchronize [sim]: cudaErrorStreamCaptureUnsupported: the stream is capturing");
  }

  cudaEvent_t create_event() override { return reinterpret_cast<cudaEvent_t>(new SimEvent()); }
  void destroy_event(cudaEvent_t e) noexcept override { delete reinterpret_cast<SimEvent*>(e); }
  void record(cudaEvent_t e, cudaStream_t s) override {
    auto* ev = reinterpret_cast<SimEvent*>(e);
    cudasim::detail::enqueue(s, [ev] {
      ev->t = std::chrono::steady_clock::now();
      ev->recorded = true;
    });
  }
  void wait(cudaStream_t, cudaEvent_t) override {}  // work already ran in issue order
  void synchronize(cudaEvent_t) override {}
  float elapsed_ms(cudaEvent_t start, cudaEvent_t end) override {
    auto* a = reinterpret_cast<SimEvent*>(start);
    auto* b = reinterpret_cast<SimEvent*>(end);
    if (!a->recorded || !b->recorded)
      throw CudaError("cudaEventElapsedTime [sim]: cudaErrorInvalidResourceHandle: an event was not recorded");
    return std::chrono::duration<float, std::milli>(b->t - a->t).count();
  }

  void begin_capture(cudaStream_t s) override {
    if (!s)
      throw CudaError(
          "cudaStreamBeginCapture [sim]: cudaErrorStreamCaptureUnsupported: the default stream cannot be captured");
    SimStream* ss = sim_stream(s);
    if (ss->capturing)
      throw CudaError("cudaStreamBeginCapture [sim]: cudaErrorIllegalState: the stream is already capturing");
    ss->capturing = true;
    ss->recorded.clear();
  }
  void* end_capture(cudaStream_t s) override {
    SimStream* ss = s ? sim_stream(s) : nullptr;
    if (!ss || !ss->capturing)
      throw CudaError("cudaStreamEndCapture [sim]: cudaErrorIllegalState: the stream is not capturing");
    ss->capturing = false;
    auto* g = new SimGraph();
    g->steps = std::move(ss->recorded);
    ss->recorded.clear();
    return g;
  }
  void launch_graph(void* graph, cudaStream_t s) override {
    auto* g = static_cast<SimGraph*>(graph);
    cudasim::detail::enqueue(s, [g] {
      for (auto& step : g->steps) step();
    });
  }
  void destroy_graph(void* graph) noexcept override { delete static_cast<SimGraph*>(graph); }

 private:
  // [p, p + bytes) must lie inside one live allocation.
  void check_range(const void* p, std::size_t bytes, const char* call, const char* which) {
    std::lock_guard<std::mutex> lock(m_);
    const char* c = static_cast<const char*>(p);
    auto it = allocs_.upper_bound(const_cast<char*>(c));
    if (it != allocs_.begin()) {
      --it;
      if (c >= it->first && c + bytes <= it->first + it->second) return;
      if (c >= it->first && c < it->first + it->second)
        throw CudaError(std::string(call) + " [sim]: cudaErrorInvalidValue: " + which + " range of " +
                        std::to_string(bytes) + " bytes at " + ptr_str(p) + " runs past the end of its allocation of " +
                        std::to_string(it->second) + " bytes at " + ptr_str(it->first));
    }
    throw CudaError(std::string(call) + " [sim]: cudaErrorInvalidValue: " + which + " " + ptr_str(p) +
                    " is not inside a live device allocation");
  }

  std::mutex m_;
  std::map<char*, std::size_t> allocs_;
};

}  // namespace

Device& sim_device() {
  static SimDevice d;
  return d;
}

}  // namespace twin::rt
