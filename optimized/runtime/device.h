// device.h: the device runtime behind one small interface, with a CUDA and a simulated backend.
//
// Design: `Device` is an abstract interface (device memory, copies, streams, events, graphs);
// device(Backend::Cuda) wraps the CUDA runtime (plain cudaMalloc, never managed memory; every
// failing call throws CudaError naming the call), device(Backend::Sim) executes on the host for
// kernels built for the simulator. Handles are the CUDA types (cudaStream_t, ...) in both, so
// launch_kernel takes Stream::handle() unchanged. The simulator runs work synchronously at
// enqueue time (streams are trivially ordered); while a stream captures, launches and copies are
// recorded instead, and the Graph replays the recorded list. The RAII classes below are the API
// kernels' host code should use.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>

namespace twin::rt {

enum class Backend { Sim, Cuda };
const char* backend_name(Backend b);  // "sim" / "cuda"

// A failed CUDA (or simulated) runtime call; the message names the call and the error.
struct CudaError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

enum class CopyKind { HostToDevice, DeviceToHost, DeviceToDevice };

class Device {
 public:
  virtual ~Device() = default;
  virtual Backend backend() const = 0;

  virtual void* malloc(std::size_t bytes) = 0;  // 256-byte aligned; malloc(0) returns nullptr
  virtual void free(void* p) noexcept = 0;
  virtual void copy(void* dst, const void* src, std::size_t bytes, CopyKind kind, cudaStream_t stream) = 0;
  virtual void memset(void* dst, int byte, std::size_t bytes, cudaStream_t stream) = 0;
  virtual void synchronize() = 0;  // the whole device

  virtual cudaStream_t create_stream() = 0;
  virtual void destroy_stream(cudaStream_t s) noexcept = 0;
  virtual void synchronize(cudaStream_t s) = 0;

  virtual cudaEvent_t create_event() = 0;
  virtual void destroy_event(cudaEvent_t e) noexcept = 0;
  virtual void record(cudaEvent_t e, cudaStream_t s) = 0;
  virtual void wait(cudaStream_t s, cudaEvent_t e) = 0;  // s waits for e
  virtual void synchronize(cudaEvent_t e) = 0;
  virtual float elapsed_ms(cudaEvent_t start, cudaEvent_t end) = 0;

  // Graphs: capture everything enqueued on `s` between begin and end, then replay it.
  virtual void begin_capture(cudaStream_t s) = 0;
  virtual void* end_capture(cudaStream_t s) = 0;  // an executable graph
  virtual void launch_graph(void* graph, cudaStream_t s) = 0;
  virtual void destroy_graph(void* graph) noexcept = 0;
};

// The backend's device (CUDA: the current device). Throws CudaError when it is not available.
Device& device(Backend b);
// Whether `b` can run here; when not, *why says so ("built without CUDA", "no CUDA device: ...").
bool available(Backend b, std::string* why = nullptr);

class Graph;

// A stream; nullptr handle() is never returned (use `nullptr` directly for the default stream).
class Stream {
 public:
  explicit Stream(Device& d) : dev_(&d), s_(d.create_stream()) {}
  ~Stream() {
    if (dev_) dev_->destroy_stream(s_);
  }
  Stream(Stream&& o) noexcept : dev_(std::exchange(o.dev_, nullptr)), s_(o.s_), process_(o.process_) {}
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cudaStream_t handle() const { return s_; }
  // Ranks as processes (processes.h): the process whose rank's work this stream carries (-1: this
  // process's, as with threaded ranks). Reading such a stream's buffers outside the rank's phase
  // is a collective: its process sends them (layer/buffer_arena.h download_tensor).
  int process() const { return process_; }
  void set_process(int p) { process_ = p; }
  Device& device() const { return *dev_; }
  void synchronize() { dev_->synchronize(s_); }
  void begin_capture() { dev_->begin_capture(s_); }
  Graph end_capture();

 private:
  Device* dev_;
  cudaStream_t s_;
  int process_ = -1;
};

class Graph {
 public:
  Graph(Device& d, void* g) : dev_(&d), g_(g) {}
  ~Graph() {
    if (dev_) dev_->destroy_graph(g_);
  }
  Graph(Graph&& o) noexcept : dev_(std::exchange(o.dev_, nullptr)), g_(o.g_) {}
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;
  void launch(Stream& s) { dev_->launch_graph(g_, s.handle()); }

 private:
  Device* dev_;
  void* g_;
};

inline Graph Stream::end_capture() { return Graph(*dev_, dev_->end_capture(s_)); }

class Event {
 public:
  explicit Event(Device& d) : dev_(&d), e_(d.create_event()) {}
  ~Event() {
    if (dev_) dev_->destroy_event(e_);
  }
  Event(Event&& o) noexcept : dev_(std::exchange(o.dev_, nullptr)), e_(o.e_) {}
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  void record(Stream& s) { dev_->record(e_, s.handle()); }
  void synchronize() { dev_->synchronize(e_); }
  float elapsed_ms_since(const Event& start) { return dev_->elapsed_ms(start.e_, e_); }
  cudaEvent_t handle() const { return e_; }

 private:
  Device* dev_;
  cudaEvent_t e_;
};

// Device memory owned by one object. upload/download copy on `stream` (default: the default
// stream) and, for download, synchronize it before returning.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(Device& d, std::size_t bytes) : dev_(&d), p_(d.malloc(bytes)), bytes_(bytes) {}
  ~DeviceBuffer() { reset(); }
  DeviceBuffer(DeviceBuffer&& o) noexcept
      : dev_(std::exchange(o.dev_, nullptr)), p_(std::exchange(o.p_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      reset();
      dev_ = std::exchange(o.dev_, nullptr);
      p_ = std::exchange(o.p_, nullptr);
      bytes_ = std::exchange(o.bytes_, 0);
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* get() const { return p_; }
  template <class T>
  T* as() const {
    return static_cast<T*>(p_);
  }
  std::size_t bytes() const { return bytes_; }

  void upload(const void* host, std::size_t bytes, cudaStream_t stream = nullptr) {
    check_size(bytes, "upload");
    dev_->copy(p_, host, bytes, CopyKind::HostToDevice, stream);
  }
  void download(void* host, std::size_t bytes, cudaStream_t stream = nullptr) const {
    check_size(bytes, "download");
    dev_->copy(host, p_, bytes, CopyKind::DeviceToHost, stream);
    dev_->synchronize(stream);
  }
  void zero(cudaStream_t stream = nullptr) { dev_->memset(p_, 0, bytes_, stream); }
  void reset() noexcept {
    if (dev_ && p_) dev_->free(p_);
    p_ = nullptr;
    bytes_ = 0;
  }

 private:
  void check_size(std::size_t bytes, const char* what) const {
    if (bytes > bytes_)
      throw std::invalid_argument(std::string("DeviceBuffer::") + what + ": " + std::to_string(bytes) +
                                  " bytes do not fit the buffer of " + std::to_string(bytes_) + " bytes");
  }
  Device* dev_ = nullptr;
  void* p_ = nullptr;
  std::size_t bytes_ = 0;
};

}  // namespace twin::rt
