#include "optimized/layer/rank_context.h"

#include <algorithm>
#include <stdexcept>

#include "core/rounding.h"
#include "optimized/layer/buffer_arena.h"  // download_tensor
#include "optimized/layer/graph_cache.h"
#include "optimized/layer/rank_runner.h"

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
  return download_tensor(*dev, *stream, d.get(), as, d.shape);
}

void RankContext::tap(const std::string& name, const DTensor& d) const {
  if (rec) rec->add(Role::Tap, name, download(d));
}

void RankContext::tap_param(const std::string& name, const Tensor* t) const {
  if (rec && t) rec->add_exact(Role::Tap, name, t->clone());
}

DTensor RankContext::layer_norm(const DTensor& x, const void* weight, const void* bias, double eps,
                                bool zero_centered_gamma) const {
  DTensor y = alloc(x.shape);
  const int width = static_cast<int>(x.shape.back());
  ops->norm_forward(false, dt, x.get(), y.get(), weight, bias, NormRows::dense(x.numel() / width, width), eps,
                    zero_centered_gamma, st());
  return y;
}

DTensor RankContext::linear(const DTensor& x, const void* weight, const void* bias, std::int64_t out_features) const {
  const std::int64_t in = x.shape.back(), rows = x.numel() / in;
  Shape shape = x.shape;
  shape.back() = out_features;
  DTensor y = alloc(shape);
  ops->linear_forward(dt, x.get(), weight, bias, y.get(), rows, in, out_features, st());
  return y;
}

DTensor RankContext::row_parallel_linear(const DTensor& x, const void* weight, std::int64_t out_features) const {
  DTensor y = linear(x, weight, nullptr, out_features);
  if (tp == 1) return y;
  rounding_store(dt);  // counts: the sum over ranks, stored in T
  DTensor sum = alloc(y.shape);
  comm->all_reduce(y.get(), sum.get(), std::size_t(y.numel()), dt, st());
  return sum;
}

// ---- the group of ranks ---------------------------------------------------------------------

RankGroup::RankGroup(std::string what, DType dt, int tp, rt::Backend backend)
    : what_(std::move(what)), dt_(dt), tp_(tp), dev_(&rt::device(backend)), ops_(&layer_kernels(backend).ops) {
  for (int r = 0; r < tp; ++r) streams_.push_back(std::make_unique<rt::Stream>(*dev_));
  if (tp > 1) comms_ = rt::make_threaded_group(tp);
  graphs_.resize(static_cast<std::size_t>(tp));
}
RankGroup::~RankGroup() = default;
RankGroup::RankGroup(RankGroup&&) noexcept = default;
RankGroup& RankGroup::operator=(RankGroup&&) noexcept = default;

RankContext RankGroup::context(int rank, const GroupRun& run) const {
  RankContext ex;
  ex.dev = dev_;
  ex.stream = streams_.at(static_cast<std::size_t>(rank)).get();
  ex.ops = ops_;
  ex.dt = dt_;
  ex.training = run.training;
  ex.seed = run.seed;
  ex.rank = rank;
  ex.tp = tp_;
  ex.comm = tp_ > 1 ? comms_[static_cast<std::size_t>(rank)].get() : nullptr;
  ex.what = what_;
  return ex;
}

void RankGroup::check_run(const GroupRun& run) const {
  if (run.use_graph && run.record_taps)
    throw std::invalid_argument(what_ +
                                ": use_graph records no taps (a tap copies to the host mid-forward, which a captured "
                                "stream cannot)");
  if (run.use_graph && dev_->backend() == rt::Backend::Cuda && tp_ != 1)
    throw std::invalid_argument(what_ +
                                ": use_graph on the GPU is for tensor_model_parallel_size 1 (the ranks' threaded "
                                "collectives are host work a CUDA graph cannot capture)");
  if (run.record_taps && tp_ != 1)
    throw std::invalid_argument(what_ + ": taps are recorded at tensor_model_parallel_size 1 only");
}

std::vector<std::optional<Tensor>> RankGroup::forward(const std::vector<const Tensor*>& inputs, const GroupRun& run,
                                                      const CapturableForward& forward, Record* record) {
  check_run(run);
  std::vector<std::optional<Tensor>> out;
  run_ranks_counted(tp_, [&](int r) {
    RankContext ex = context(r, run);
    if (run.record_taps) ex.rec = record;
    DeviceTensors outputs;
    if (run.use_graph) {
      outputs = graphs_[static_cast<std::size_t>(r)].run(ex, inputs, {run.training, run.seed, run.offset}, forward);
    } else {
      DeviceTensors in;
      for (const Tensor* t : inputs) in.push_back(t ? std::optional<DTensor>(ex.upload(*t)) : std::nullopt);
      outputs = forward(ex, in);
    }
    if (r != 0) return;
    for (const auto& o : outputs) out.push_back(o ? std::optional<Tensor>(ex.download(*o)) : std::nullopt);
  });
  return out;
}

}  // namespace twin::opt
