// What a layer whose host side launches its ops one at a time (Retro's) runs a rank's forward on:
// device tensors (a buffer and its shape), the activations of a captured forward (Arena), and the
// rank's context (device, stream, dtype, taps, rank and communicator, the backend's launchers).
// Backend-neutral: the launchers come from the backend boundary (layer/kernels.h).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/record.h"
#include "core/tensor.h"
#include "optimized/layer/kernels.h"
#include "optimized/runtime/collectives.h"
#include "optimized/runtime/device.h"

namespace twin::opt {

// A device tensor: a shared buffer and its logical shape (several names may share one buffer).
struct DTensor {
  std::shared_ptr<rt::DeviceBuffer> buf;
  Shape shape;
  void* get() const { return buf ? buf->get() : nullptr; }
  std::int64_t numel() const { return shape_numel(shape); }
};

// `d`'s buffer under another shape of as many elements or fewer.
DTensor view(const DTensor& d, Shape shape);

// The activations of a forward captured into a graph: the warm-up allocates them in order, the
// capture takes the same buffers in the same order (no allocation while the stream captures), and
// they live as long as the graph that reads and writes them.
struct Arena {
  std::vector<DTensor> bufs;
  std::size_t next = 0;
  bool capturing = false;  // hand out `bufs` in order instead of allocating
};

// What one rank's forward runs on: device, stream, dtype, taps, its rank and communicator.
struct RankContext {
  rt::Device* dev = nullptr;
  rt::Stream* stream = nullptr;
  const OpLaunchers* ops = nullptr;  // the device's backend's launchers
  DType dt = DType::F32;
  Record* rec = nullptr;  // null: no taps
  bool training = false;
  std::uint64_t seed = 0;
  int rank = 0, tp = 1;
  rt::Communicator* comm = nullptr;  // tp > 1
  Arena* arena = nullptr;            // a graph's warm-up or capture
  std::string what;                  // the layer's name, for errors

  cudaStream_t st() const { return stream->handle(); }
  // A tensor of `shape` in dt: from the arena in a capture (the warm-up's allocation in order).
  DTensor alloc(Shape shape) const;
  // `t` on the device, in its own dtype.
  DTensor upload(const Tensor& t) const;
  Tensor download(const DTensor& d, DType as) const;
  Tensor download(const DTensor& d) const { return download(d, dt); }
  // The tensor under `name`, with the rounding points counted so far (TP = 1: the full tensor).
  void tap(const std::string& name, const DTensor& d) const;
  void tap_param(const std::string& name, const Tensor* t) const;
};

}  // namespace twin::opt
