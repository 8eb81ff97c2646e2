#include "optimized/layer/rank_context.h"

#include <algorithm>
#include <stdexcept>

namespace twin::opt {

DTensor view(const DTensor& d, Shape shape) { return DTensor{d.buf, std::move(shape)}; }

DTensor RankContext::alloc(Shape shape) const {
  if (arena && arena->capturing) {
    // The capture runs the warm-up's code on the same shapes: the same allocations in order.
    if (arena->next >= arena->bufs.size() || arena->bufs[arena->next].shape != shape)
      throw std::logic_error(what + ": the captured forward's allocation " + std::to_string(arena->next) + " " +
                             shape_str(shape) + " differs from its warm-up's");
    return arena->bufs[arena->next++];
  }
  const std::size_t bytes = std::max<std::size_t>(std::size_t(shape_numel(shape)) * dtype_size(dt), 1);
  DTensor d{std::make_shared<rt::DeviceBuffer>(*dev, bytes), std::move(shape)};
  if (arena) arena->bufs.push_back(d);
  return d;
}

DTensor RankContext::upload(const Tensor& t) const {
  DTensor d{std::make_shared<rt::DeviceBuffer>(*dev, std::max<std::size_t>(t.nbytes(), 1)), t.shape()};
  d.buf->upload(t.raw(), t.nbytes(), st());
  return d;
}

Tensor RankContext::download(const DTensor& d, DType as) const {
  Tensor t = Tensor::empty(as, d.shape);
  dev->copy(t.raw_mut(), d.get(), t.nbytes(), rt::CopyKind::DeviceToHost, st());
  stream->synchronize();
  return t;
}

void RankContext::tap(const std::string& name, const DTensor& d) const {
  if (rec) rec->add(Role::Tap, name, download(d));
}

void RankContext::tap_param(const std::string& name, const Tensor* t) const {
  if (rec && t) rec->add_exact(Role::Tap, name, t->clone());
}

}  // namespace twin::opt
