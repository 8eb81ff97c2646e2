#include "optimized/layer/rank_context.h"

#include <algorithm>
#include <stdexcept>

#include "core/rounding.h"
#include "optimized/layer/buffer_arena.h"  // download_tensor
#include "optimized/layer/graph_cache.h"
#include "optimized/layer/rank_runner.h"

namespace twin::opt {

DTensor view(const DTensor& d, Shape shape) { return DTensor{d.buf, std::move(shape), d.offset}; }

DTensor row_slice(const DTensor& d, std::int64_t r0, std::int64_t r1, std::size_t elem_bytes) {
  const std::int64_t width = d.shape.back();
  if (r0 < 0 || r1 < r0 || r1 * width > d.numel())
    throw std::logic_error("row_slice: rows [" + std::to_string(r0) + ", " + std::to_string(r1) + ") of " +
                           shape_str(d.shape));
  return DTensor{d.buf, {r1 - r0, width}, d.offset + std::size_t(r0 * width) * elem_bytes};
}

DTensor RankContext::alloc(Shape shape, DType as) const {
  if (arena && arena->capturing) {
    // The capture runs the warm-up's code on the same shapes: the same allocations in order.
    if (arena->next >= arena->bufs.size() || arena->bufs[arena->next].shape != shape)
      throw std::logic_error(what + ": the captured forward's allocation " + std::to_string(arena->next) + " " +
                             shape_str(shape) + " differs from its warm-up's");
    return arena->bufs[arena->next++];
  }
  const std::size_t bytes = std::max<std::size_t>(std::size_t(shape_numel(shape)) * dtype_size(as), 1);
  DTensor d{std::make_shared<rt::DeviceBuffer>(*dev, bytes), std::move(shape)};
  if (arena) arena->bufs.push_back(d);
  return d;
}

DTensor RankContext::zeros(Shape shape) const {
  DTensor d = alloc(std::move(shape));
  d.buf->zero(st());
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

void RankContext::tap(const std::string& name, const DTensor& d, ShardLayout layout,
                      const Tensor& block_magnitude) const {
  if (rec) rec->add(Role::Tap, name, download(d)).block_magnitude = block_magnitude;
  if (rank_taps) rank_taps->push_back({name, download(d), rounding_now(), layout, block_magnitude});
}

void RankContext::tap_value(const std::string& name, Tensor value) const {
  if (rec) rec->add(Role::Tap, name, std::move(value));
  if (rank_taps) rank_taps->push_back({name, std::move(value), rounding_now(), {}});
}

void RankContext::tap_param(const std::string& name, const Tensor* t) const {
  if (!t) return;
  if (rec) rec->add_exact(Role::Tap, name, t->clone());
  if (rank_taps) rank_taps->push_back({name, t->clone(), RoundingCount{}, {}});
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
  return sum_over_ranks(linear(x, weight, nullptr, out_features));
}

DTensor RankContext::sum_over_ranks(const DTensor& partial) const {
  if (tp == 1) return partial;
  // counts: the threaded group adds rank by rank in a fixed order, rounding to dt after each
  // addition (NCCL rounds per hop likewise): tp - 1 stores.
  rounding_store(dt, tp - 1);
  DTensor sum = alloc(partial.shape);
  comm->all_reduce(partial.get(), sum.get(), std::size_t(partial.numel()), dt, st());
  return sum;
}

DTensor RankContext::grad_sum(const DTensor& a, const DTensor& b) const {
  if (a.numel() != b.numel())
    throw std::logic_error(what + ": grad_sum of " + shape_str(a.shape) + " and " + shape_str(b.shape));
  DTensor out = alloc(a.shape);
  ops->grad_sum(dt, a.get(), b.get(), out.get(), a.numel(), st());
  return out;
}

std::shared_ptr<rt::DeviceBuffer> RankContext::workspace(std::size_t bytes) const {
  return std::make_shared<rt::DeviceBuffer>(*dev, std::max<std::size_t>(bytes, 1));
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
  check_graph_ranks(what_ + ":", run.use_graph, tp_, dev_->backend());
}

std::vector<std::optional<Tensor>> RankGroup::forward(const std::vector<const Tensor*>& inputs, const GroupRun& run,
                                                      const CapturableForward& forward, Record* record) {
  check_run(run);
  std::vector<std::optional<Tensor>> out;
  std::vector<std::vector<RankTap>> rank_taps(static_cast<std::size_t>(tp_));
  run_ranks_counted(tp_, [&](int r) {
    RankContext ex = context(r, run);
    if (run.record_taps && tp_ == 1) ex.rec = record;
    if (run.record_taps && tp_ > 1) ex.rank_taps = &rank_taps[static_cast<std::size_t>(r)];
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
  if (run.record_taps && tp_ > 1)
    for (RecordEntry& e : gather_rank_taps(rank_taps, what_).entries) record->entries.push_back(std::move(e));
  return out;
}

void RankGroup::run_each(const GroupRun& run, const std::function<void(const RankContext&)>& body) {
  run_ranks_counted(tp_, [&](int r) { body(context(r, run)); });
}

}  // namespace twin::opt
