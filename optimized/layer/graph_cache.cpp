#include "optimized/layer/graph_cache.h"

#include <algorithm>
#include <stdexcept>

#include "core/rounding.h"

namespace twin::opt {

void check_graph_ranks(const std::string& who, bool use_graph, int tp, rt::Backend backend) {
  if (use_graph && tp != 1 && backend == rt::Backend::Cuda)
    throw std::invalid_argument(who +
                                " graph replay on the GPU is for tensor_model_parallel_size 1 (the ranks' threaded "
                                "collectives are host work a CUDA graph cannot capture)");
}

namespace {

RoundingCount minus(RoundingCount a, const RoundingCount& b) {
  a.bf16 -= b.bf16;
  a.fp16 -= b.fp16;
  a.fp32 -= b.fp32;
  a.reduction -= b.reduction;
  return a;
}

RoundingCount plus(RoundingCount a, const RoundingCount& b) {
  a.bf16 += b.bf16;
  a.fp16 += b.fp16;
  a.fp32 += b.fp32;
  a.reduction += b.reduction;
  return a;
}

// What a captured graph bakes in: which inputs are present and their shapes, and the dropout.
struct GraphKey {
  std::vector<std::optional<Shape>> inputs;
  GraphDropout drop;
  bool operator==(const GraphKey& o) const {
    return inputs == o.inputs && drop.training == o.drop.training && drop.seed == o.drop.seed &&
           drop.offset == o.drop.offset;
  }
};

GraphKey key_of(const std::vector<const Tensor*>& inputs, const GraphDropout& drop) {
  GraphKey key;
  for (const Tensor* t : inputs) key.inputs.push_back(t ? std::optional<Shape>(t->shape()) : std::nullopt);
  key.drop = drop;
  return key;
}

}  // namespace

rt::Graph capture_graph(rt::Stream& stream, const std::function<void()>& launch) {
  stream.begin_capture();
  try {
    launch();
  } catch (...) {
    try {
      rt::Graph discarded = stream.end_capture();
    } catch (...) {
    }
    throw;
  }
  return stream.end_capture();
}

void StreamGraph::run(rt::Stream& stream, bool use_graph, const std::function<void()>& launch) {
  if (!use_graph) return launch();
  if (!graph_) graph_.emplace(capture_graph(stream, launch));
  graph_->launch(stream);
}

double StreamGraph::time_ms(rt::Device& dev, rt::Stream& stream, int iters, const std::string& what) {
  if (!graph_) throw std::logic_error(what);
  rt::Event start(dev), stop(dev);
  graph_->launch(stream);  // warm
  start.record(stream);
  for (int i = 0; i < iters; ++i) graph_->launch(stream);
  stop.record(stream);
  stop.synchronize();
  return static_cast<double>(stop.elapsed_ms_since(start)) / std::max(1, iters);
}

// One rank's graph with every buffer it reads and writes.
struct GraphCache::Captured {
  GraphKey key;
  DeviceTensors inputs;   // the input buffers the graph reads: refilled before each replay
  Arena arena;            // its activations
  DeviceTensors outputs;  // in the arena
  std::optional<rt::Graph> graph;
  RoundingCount rounding;  // the rounding points the captured forward executes, counted at capture

  // Warm-up, then capture of `forward` on ex's stream, the inputs uploaded first.
  void capture(const RankContext& rank_ex, const std::vector<const Tensor*>& host_inputs,
               const CapturableForward& forward) {
    for (const Tensor* t : host_inputs) inputs.push_back(t ? std::optional<DTensor>(rank_ex.upload(*t)) : std::nullopt);
    RankContext ex = rank_ex;
    ex.arena = &arena;
    const RoundingCount start = rounding_now();
    forward(ex, inputs);  // warm-up
    ex.stream->synchronize();
    rounding_set(start);
    arena.capturing = true;
    graph.emplace(capture_graph(*ex.stream, [&] { outputs = forward(ex, inputs); }));
    if (arena.next != arena.bufs.size())
      throw std::logic_error(ex.what + ": the captured forward allocated fewer buffers than its warm-up");
    rounding = minus(rounding_now(), start);
    rounding_set(start);
  }
};

GraphCache::GraphCache() = default;
GraphCache::~GraphCache() = default;
GraphCache::GraphCache(GraphCache&&) noexcept = default;
GraphCache& GraphCache::operator=(GraphCache&&) noexcept = default;

const DeviceTensors& GraphCache::run(const RankContext& ex, const std::vector<const Tensor*>& inputs,
                                     const GraphDropout& drop, const CapturableForward& forward) {
  GraphKey key = key_of(inputs, drop);
  if (captured_ && captured_->key == key) {
    for (std::size_t i = 0; i < inputs.size(); ++i)
      if (inputs[i]) captured_->inputs[i]->buf->upload(inputs[i]->raw(), inputs[i]->nbytes(), ex.st());
  } else {
    captured_.reset();  // the old graph and its buffers
    auto fresh = std::make_unique<Captured>();
    fresh->key = std::move(key);
    fresh->capture(ex, inputs, forward);
    captured_ = std::move(fresh);
  }
  rounding_set(plus(rounding_now(), captured_->rounding));
  captured_->graph->launch(*ex.stream);
  return captured_->outputs;
}

}  // namespace twin::opt
