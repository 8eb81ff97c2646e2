#include "optimized/layer/buffer_arena.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "optimized/layer/rank_runner.h"  // in_rank_phase
#include "optimized/runtime/processes.h"

namespace twin::opt {

Tensor download_tensor(rt::Device& dev, rt::Stream& stream, const void* ptr, DType dt, Shape shape) {
  Tensor t = Tensor::empty(dt, std::move(shape));
  const int owner = stream.process();
  const bool collective = owner >= 0 && !in_rank_phase();
  if (t.nbytes() && (owner < 0 || owner == rt::process_rank())) {
    dev.copy(t.raw_mut(), ptr, t.nbytes(), rt::CopyKind::DeviceToHost, stream.handle());
    stream.synchronize();
  }
  if (collective) rt::process_broadcast(t.raw_mut(), t.nbytes(), owner);
  return t;
}

void* BufferArena::allocate(rt::Device& dev, const char* name, std::size_t bytes) {
  if (elsewhere_) return nullptr;
  try {
    buffers_.emplace_back(dev, std::max<std::size_t>(bytes, 1));
  } catch (const std::exception& e) {
    throw std::runtime_error(std::string("cannot allocate the activation buffer '") + name + "' (" +
                             std::to_string(bytes) + " bytes): " + e.what());
  }
  return buffers_.back().get();
}

const void* DeviceWeights::upload(rt::Device& dev, const void* host, std::size_t bytes) {
  if (elsewhere_) return nullptr;
  buffers_.emplace_back(dev, std::max<std::size_t>(bytes, 1));
  buffers_.back().upload(host, bytes);
  return buffers_.back().get();
}

}  // namespace twin::opt
