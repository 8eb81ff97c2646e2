// A rank's work captured into a graph and replayed (use_graph), for every layer kind. A captured
// graph bakes in the buffers and arguments of its launches, so each graph goes when they change:
//   StreamGraph  a plan's kernel sequence on fixed buffers (the dense layer's forward and backward,
//                the MoE layer's router and postprocess phases): its owner resets it where its
//                buffers, dropout and mask arguments or loss arguments change;
//   GraphCache   a forward that launches op by op and allocates as it goes (Retro's,
//                layer/rank_context.h): keyed by the inputs' shapes and the dropout arguments,
//                with the activations it was captured on.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "optimized/layer/rank_context.h"

namespace twin::opt {

// invalid_argument ("<who> graph replay ...") when use_graph cannot run at tp ranks on `backend`:
// on the simulator a rank's collectives are stream work, captured and replayed with its kernels,
// at any tp; on the GPU the ranks' threaded collectives are host work a CUDA graph cannot
// capture, so tp = 1 only.
void check_graph_ranks(const std::string& who, bool use_graph, int tp, rt::Backend backend);

// `launch`'s work on `stream` captured into a graph (nothing executes). If `launch` throws, the
// capture is ended and dropped, so the stream can run again.
rt::Graph capture_graph(rt::Stream& stream, const std::function<void()>& launch);

class StreamGraph {
 public:
  // `launch` on `stream`: eagerly, or with use_graph from the graph, captured first when there is none.
  void run(rt::Stream& stream, bool use_graph, const std::function<void()>& launch);
  // Whether run(stream, use_graph, ...) would capture (a plan may need to know it is being captured).
  bool will_capture(bool use_graph) const { return use_graph && !graph_; }
  void reset() { graph_.reset(); }
  // Device time of one replay on `stream` (ms), averaged over `iters` after one warm replay;
  // logic_error(`what`) when nothing was captured.
  double time_ms(rt::Device& dev, rt::Stream& stream, int iters, const std::string& what);

 private:
  std::optional<rt::Graph> graph_;
};

// The dropout arguments a captured forward bakes in.
struct GraphDropout {
  bool training = false;
  std::uint64_t seed = 0, offset = 0;
};

class GraphCache {
 public:
  GraphCache();
  ~GraphCache();
  GraphCache(GraphCache&&) noexcept;
  GraphCache& operator=(GraphCache&&) noexcept;

  // Replays the forward captured for these input shapes and dropout arguments on ex's stream,
  // capturing it first when there is none: warm-up (eager, allocating the arena), capture (the
  // same code on the same buffers, nothing executed), replay. Returns the outputs' buffers (the
  // graph's, valid until the next call). The rounding count advances by the captured forward's
  // points at each replay, as an eager run advances it (every count in a forward is its input's
  // count plus points, so the forward's points are the same for any input count).
  const DeviceTensors& run(const RankContext& ex, const std::vector<const Tensor*>& inputs, const GraphDropout& drop,
                           const CapturableForward& forward);

 private:
  struct Captured;
  std::unique_ptr<Captured> captured_;
};

}  // namespace twin::opt
