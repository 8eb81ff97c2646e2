#include "optimized/layer/buffer_arena.h"

#include <algorithm>

namespace twin::opt {

Tensor download_tensor(rt::Device& dev, rt::Stream& stream, const void* ptr, DType dt, Shape shape) {
  Tensor t = Tensor::empty(dt, std::move(shape));
  if (t.nbytes()) {
    dev.copy(t.raw_mut(), ptr, t.nbytes(), rt::CopyKind::DeviceToHost, stream.handle());
    stream.synchronize();
  }
  return t;
}

void BufferArena::clear() {
  buffers_.clear();
  rows_.clear();
}

void* BufferArena::allocate(rt::Device& dev, const char* name, std::size_t bytes) {
  buffers_.emplace_back(dev, std::max<std::size_t>(bytes, 1));
  rows_.emplace_back(name, bytes);
  return buffers_.back().get();
}

std::size_t BufferArena::bytes() const {
  std::size_t total = 0;
  for (const auto& [name, b] : rows_) total += b;
  return total;
}

const void* DeviceWeights::upload(rt::Device& dev, const void* host, std::size_t bytes) {
  buffers_.emplace_back(dev, std::max<std::size_t>(bytes, 1));
  buffers_.back().upload(host, bytes);
  return buffers_.back().get();
}

}  // namespace twin::opt
