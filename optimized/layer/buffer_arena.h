// One rank's device buffers for the current input shape, from a table of named, shaped rows
// (llm.c's activation table): each add() is a row, its name and shape beside the plan pointer it
// fills, so a layer sizes and binds its buffers in one place. Each row is its own allocation, so
// the simulator's sanitizer build sees each buffer's bounds. A graph captured against the buffers
// must be dropped with them (clear()).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/dtype.h"
#include "core/tensor.h"
#include "optimized/runtime/device.h"

namespace twin::opt {

class BufferArena {
 public:
  // Drops every buffer and row.
  void clear();
  // A buffer of prod(dims) elements of `dt` (at least one byte), under `name`.
  template <class... Dims>
  void* add(rt::Device& dev, const char* name, DType dt, Dims... dims) {
    return allocate(dev, name, dtype_size(dt) * elements(dims...));
  }
  // A buffer of prod(dims) elements of T.
  template <class T, class... Dims>
  T* add(rt::Device& dev, const char* name, Dims... dims) {
    return static_cast<T*>(allocate(dev, name, sizeof(T) * elements(dims...)));
  }
  // The rows so far: name and bytes, in the order added.
  const std::vector<std::pair<std::string, std::size_t>>& rows() const { return rows_; }
  std::size_t bytes() const;

 private:
  template <class... Dims>
  static std::size_t elements(Dims... dims) {
    return (std::size_t(1) * ... * static_cast<std::size_t>(dims));
  }
  void* allocate(rt::Device& dev, const char* name, std::size_t bytes);
  std::vector<rt::DeviceBuffer> buffers_;
  std::vector<std::pair<std::string, std::size_t>> rows_;
};

// A layer's weights on the device, as long as the layer lives: each upload its own buffer.
class DeviceWeights {
 public:
  // `bytes` bytes from the host (at least one byte on the device).
  const void* upload(rt::Device& dev, const void* host, std::size_t bytes);
  const void* upload(rt::Device& dev, const Tensor& t) { return upload(dev, t.raw(), t.nbytes()); }

 private:
  std::vector<rt::DeviceBuffer> buffers_;
};

}  // namespace twin::opt
