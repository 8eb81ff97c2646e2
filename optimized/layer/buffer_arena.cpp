#include "optimized/layer/buffer_arena.h"

#include <algorithm>

namespace twin::opt {

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
