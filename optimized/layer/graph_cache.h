// One rank's forward captured into a graph and replayed (use_graph), for a layer whose host side
// launches its ops one at a time and allocates as it goes (layer/rank_context.h). A captured graph
// bakes in its buffers and its dropout arguments, so the cache is keyed by what invalidates it:
// the inputs' shapes (which ones are present) and training, seed and offset.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "optimized/layer/rank_context.h"

namespace twin::opt {

// A forward's device inputs / outputs in a fixed order; nullopt for one it was not given / made.
using DeviceTensors = std::vector<std::optional<DTensor>>;
using CapturableForward = std::function<DeviceTensors(const RankContext&, const DeviceTensors& inputs)>;

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
