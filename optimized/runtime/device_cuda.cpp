// device_cuda.cpp: the CUDA device runtime (built only with TWIN_HAVE_CUDA; needs a GPU to run).
//
// Design: a thin layer over the CUDA runtime API: cudaMalloc (never managed memory),
// cudaMemcpyAsync/cudaMemsetAsync on the given stream, non-blocking streams, timing events, and
// graphs from stream capture (cudaStreamCaptureModeThreadLocal) instantiated once and replayed
// with cudaGraphLaunch. Every failing call throws CudaError naming the call and its arguments.
#include "optimized/runtime/cuda_check.h"
#include "optimized/runtime/device.h"

#include <cuda_runtime.h>

namespace twin::rt {
namespace {

struct CudaGraph {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
};

cudaMemcpyKind to_cuda(CopyKind k) {
  switch (k) {
    case CopyKind::HostToDevice:
      return cudaMemcpyHostToDevice;
    case CopyKind::DeviceToHost:
      return cudaMemcpyDeviceToHost;
    case CopyKind::DeviceToDevice:
      return cudaMemcpyDeviceToDevice;
  }
  return cudaMemcpyDefault;
}

class CudaDevice final : public Device {
 public:
  Backend backend() const override { return Backend::Cuda; }

  void* malloc(std::size_t bytes) override {
    if (bytes == 0) return nullptr;
    void* p = nullptr;
    cuda_check(cudaMalloc(&p, bytes), "cudaMalloc(" + std::to_string(bytes) + " bytes)");
    return p;
  }
  void free(void* p) noexcept override {
    if (p) cudaFree(p);  // cannot throw from destructors; a failure here shows at the next call
  }
  void copy(void* dst, const void* src, std::size_t bytes, CopyKind kind, cudaStream_t s) override {
    if (bytes == 0) return;
    cuda_check(cudaMemcpyAsync(dst, src, bytes, to_cuda(kind), s),
               "cudaMemcpyAsync(" + std::to_string(bytes) + " bytes)");
  }
  void memset(void* dst, int byte, std::size_t bytes, cudaStream_t s) override {
    if (bytes == 0) return;
    cuda_check(cudaMemsetAsync(dst, byte, bytes, s), "cudaMemsetAsync(" + std::to_string(bytes) + " bytes)");
  }
  void synchronize() override { cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize"); }

  cudaStream_t create_stream() override {
    cudaStream_t s = nullptr;
    cuda_check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    return s;
  }
  void destroy_stream(cudaStream_t s) noexcept override {
    if (s) cudaStreamDestroy(s);
  }
  void synchronize(cudaStream_t s) override { cuda_check(cudaStreamSynchronize(s), "cudaStreamSynchronize"); }

  cudaEvent_t create_event() override {
    cudaEvent_t e = nullptr;
    cuda_check(cudaEventCreate(&e), "cudaEventCreate");
    return e;
  }
  void destroy_event(cudaEvent_t e) noexcept override {
    if (e) cudaEventDestroy(e);
  }
  void record(cudaEvent_t e, cudaStream_t s) override { cuda_check(cudaEventRecord(e, s), "cudaEventRecord"); }
  void wait(cudaStream_t s, cudaEvent_t e) override { cuda_check(cudaStreamWaitEvent(s, e, 0), "cudaStreamWaitEvent"); }
  void synchronize(cudaEvent_t e) override { cuda_check(cudaEventSynchronize(e), "cudaEventSynchronize"); }
  float elapsed_ms(cudaEvent_t a, cudaEvent_t b) override {
    float ms = 0;
    cuda_check(cudaEventElapsedTime(&ms, a, b), "cudaEventElapsedTime");
    return ms;
  }

  void begin_capture(cudaStream_t s) override {
    cuda_check(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
  }
  void* end_capture(cudaStream_t s) override {
    auto g = std::make_unique<CudaGraph>();
    cuda_check(cudaStreamEndCapture(s, &g->graph), "cudaStreamEndCapture");
    cuda_check(cudaGraphInstantiate(&g->exec, g->graph, 0), "cudaGraphInstantiate");
    return g.release();
  }
  void launch_graph(void* graph, cudaStream_t s) override {
    cuda_check(cudaGraphLaunch(static_cast<CudaGraph*>(graph)->exec, s), "cudaGraphLaunch");
  }
  void destroy_graph(void* graph) noexcept override {
    auto* g = static_cast<CudaGraph*>(graph);
    if (!g) return;
    if (g->exec) cudaGraphExecDestroy(g->exec);
    if (g->graph) cudaGraphDestroy(g->graph);
    delete g;
  }
};

}  // namespace

bool cuda_device_present(std::string* why) {
  int n = 0;
  cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    if (why)
      *why =
          std::string("no CUDA device: cudaGetDeviceCount: ") + cudaGetErrorName(err) + ": " + cudaGetErrorString(err);
    cudaGetLastError();  // clear the sticky-free error so later calls start clean
    return false;
  }
  if (n == 0) {
    if (why) *why = "no CUDA device: cudaGetDeviceCount returned 0";
    return false;
  }
  return true;
}

Device& cuda_device() {
  static CudaDevice d;
  return d;
}

}  // namespace twin::rt
