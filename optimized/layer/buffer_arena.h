// One rank's device buffers for the current input shape, from a table of named, shaped rows
// (llm.c's activation table): each add() is a row, its name and shape beside the plan pointer it
// fills, so a layer sizes and binds its buffers in one place. Each row is its own allocation, so
// the simulator's sanitizer build sees each buffer's bounds. A graph captured against the buffers
// must be dropped with them (clear()).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/dtype.h"
#include "core/tensor.h"
#include "optimized/runtime/device.h"

namespace twin::opt {

// What a forward's buffers, and the graphs captured on them, are made for: a change reallocates them.
struct BufferShape {
  int s = -1, b = -1, rot = -1;  // sequence, batch, RoPE's rot_dim
  std::size_t mask_bytes = 0;    // the attention mask's, 0 without one
  bool padding = false;          // a padding mask (the MoE router's)
  bool operator==(const BufferShape& o) const {
    return s == o.s && b == o.b && rot == o.rot && mask_bytes == o.mask_bytes && padding == o.padding;
  }
};

// A device tensor of `shape` in `dt` on the host, after `stream`'s work so far. With ranks as
// processes, outside a rank's phase, a collective: the stream's process reads it and sends it to
// every process (the others' `ptr` is not read).
Tensor download_tensor(rt::Device& dev, rt::Stream& stream, const void* ptr, DType dt, Shape shape);

class BufferArena {
 public:
  // Drops every buffer.
  void clear() { buffers_.clear(); }
  // A rank another process runs (ranks as processes, layer/rank_runner.h): nothing is allocated,
  // every buffer's pointer is null, while the layer keeps the rank's sizes.
  void set_elsewhere() { elsewhere_ = true; }
  // A buffer of prod(dims) elements of `dt` (at least one byte); `name` says which in the error
  // when the device cannot allocate it.
  template <class... Dims>
  void* add(rt::Device& dev, const char* name, DType dt, Dims... dims) {
    return allocate(dev, name, dtype_size(dt) * elements(dims...));
  }
  // A buffer of prod(dims) elements of T.
  template <class T, class... Dims>
  T* add(rt::Device& dev, const char* name, Dims... dims) {
    return static_cast<T*>(allocate(dev, name, sizeof(T) * elements(dims...)));
  }

 private:
  template <class... Dims>
  static std::size_t elements(Dims... dims) {
    return (std::size_t(1) * ... * static_cast<std::size_t>(dims));
  }
  void* allocate(rt::Device& dev, const char* name, std::size_t bytes);
  std::vector<rt::DeviceBuffer> buffers_;
  bool elsewhere_ = false;
};

// A layer's weights on the device, as long as the layer lives: each upload its own buffer.
class DeviceWeights {
 public:
  // A rank another process runs: nothing is uploaded, every pointer is null (BufferArena's).
  void set_elsewhere() { elsewhere_ = true; }
  // `bytes` bytes from the host (at least one byte on the device).
  const void* upload(rt::Device& dev, const void* host, std::size_t bytes);
  const void* upload(rt::Device& dev, const Tensor& t) { return upload(dev, t.raw(), t.nbytes()); }

 private:
  std::vector<rt::DeviceBuffer> buffers_;
  bool elsewhere_ = false;
};

}  // namespace twin::opt
