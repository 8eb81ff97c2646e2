// What a layer whose host side launches its ops one at a time (Retro's) runs a rank's forward on:
// device tensors (a buffer and its shape), the activations of a captured forward (Arena), the
// rank's context (device, stream, dtype, taps, rank and communicator, the backend's launchers)
// with the ops such a layer composes, and the group of tensor-parallel ranks that runs a forward
// on every rank. Backend-neutral: the launchers come from the backend boundary (layer/kernels.h).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/record.h"
#include "core/rounding.h"
#include "core/tensor.h"
#include "optimized/layer/kernels.h"
#include "optimized/layer/rank_runner.h"  // RankTap
#include "optimized/runtime/collectives.h"
#include "optimized/runtime/device.h"

namespace twin::opt {

// A device tensor: a shared buffer and its logical shape (several names may share one buffer).
struct DTensor {
  std::shared_ptr<rt::DeviceBuffer> buf;
  Shape shape;
  std::size_t offset = 0;  // bytes into buf where the tensor starts
  void* get() const { return buf ? static_cast<char*>(buf->get()) + offset : nullptr; }
  std::int64_t numel() const { return shape_numel(shape); }
};

// `d`'s buffer under another shape of as many elements or fewer.
DTensor view(const DTensor& d, Shape shape);
// Rows [r0, r1) of `d` viewed as [rows, shape.back()] (elements of elem_bytes): a [r1 - r0, last] view.
DTensor row_slice(const DTensor& d, std::int64_t r0, std::int64_t r1, std::size_t elem_bytes);

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
  Record* rec = nullptr;                      // tp = 1: the taps' record (null: no taps)
  std::vector<RankTap>* rank_taps = nullptr;  // tp > 1: this rank's part of each tap (null: no taps)
  bool training = false;
  std::uint64_t seed = 0;
  int rank = 0, tp = 1;
  rt::Communicator* comm = nullptr;  // tp > 1
  Arena* arena = nullptr;            // a graph's warm-up or capture
  GradLeaves* leaves = nullptr;      // a backward's parameter gradients' rounding counts
  std::string what;                  // the layer's name, for errors

  cudaStream_t st() const { return stream->handle(); }
  // A tensor of `shape` in dt (or `as`): from the arena in a capture (the warm-up's allocation in order).
  DTensor alloc(Shape shape) const { return alloc(std::move(shape), dt); }
  DTensor alloc(Shape shape, DType as) const;
  // alloc, filled with zeros.
  DTensor zeros(Shape shape) const;
  // `t` on the device, in its own dtype.
  DTensor upload(const Tensor& t) const;
  Tensor download(const DTensor& d, DType as) const;
  Tensor download(const DTensor& d) const { return download(d, dt); }
  bool recording() const { return rec || rank_taps; }
  // The tensor under `name`, with the rounding points counted so far; at tp > 1 this rank's part,
  // `layout` saying how the ranks' parts make the full tensor (gather_rank_taps).
  // block_magnitude: RecordEntry::block_magnitude (undefined: none).
  void tap(const std::string& name, const DTensor& d, ShardLayout layout = {},
           const Tensor& block_magnitude = Tensor()) const;
  // A host tensor every rank holds whole, with the rounding points counted so far.
  void tap_value(const std::string& name, Tensor value) const;
  // A parameter (no rounding point).
  void tap_param(const std::string& name, const Tensor* t) const;

  // ---- ops: each output a new tensor of x's leading shape
  // LayerNorm over x's last dim (torch_norm.cuh).
  DTensor layer_norm(const DTensor& x, const void* weight, const void* bias, double eps,
                     bool zero_centered_gamma) const;
  // x [..., in] W^T [..., out_features] (+ bias in the GEMM's epilogue when not null).
  DTensor linear(const DTensor& x, const void* weight, const void* bias, std::int64_t out_features) const;
  // A row-parallel linear (linear_proj, fc2): each rank's product summed over the ranks
  // (sum_over_ranks); the bias is left to the bias-dropout-add, as in Megatron.
  DTensor row_parallel_linear(const DTensor& x, const void* weight, std::int64_t out_features) const;

  // ---- backward ops
  // Each rank's partial summed over the ranks (all-reduce, one store in dt per added rank): a
  // row-parallel linear's output, a column-parallel linear's input gradient. At tp = 1 the partial.
  DTensor sum_over_ranks(const DTensor& partial) const;
  // a + b in a new tensor (a gradient reaching a tensor used twice: autograd adds the two, stored in dt).
  DTensor grad_sum(const DTensor& a, const DTensor& b) const;
  // A device buffer of `bytes` (a launcher's workspace).
  std::shared_ptr<rt::DeviceBuffer> workspace(std::size_t bytes) const;
};

// A forward's options as the group runs it.
struct GroupRun {
  bool training = false;
  std::uint64_t seed = 0, offset = 0;
  bool record_taps = false;
  bool use_graph = false;  // capture each rank's forward once, then replay (layer/graph_cache.h)
};

// A forward's device inputs / outputs in a fixed order; nullopt for one it was not given / made.
using DeviceTensors = std::vector<std::optional<DTensor>>;
using CapturableForward = std::function<DeviceTensors(const RankContext&, const DeviceTensors& inputs)>;

class GraphCache;

// The tensor-parallel ranks of a built layer (a stream and a communicator each) and a forward run
// on every rank (layer/rank_runner.h: the rounding counts joined as every kind joins them),
// eagerly or from each rank's captured graph.
class RankGroup {
 public:
  // `what`: the layer's name in errors; dt its params dtype.
  RankGroup(std::string what, DType dt, int tp, rt::Backend backend);
  ~RankGroup();
  RankGroup(RankGroup&&) noexcept;
  RankGroup& operator=(RankGroup&&) noexcept;

  RankContext context(int rank, const GroupRun& run = {}) const;
  // invalid_argument for what `run` asks that the group cannot do (forward() checks it first too).
  void check_run(const GroupRun& run) const;
  // Runs `forward` on every rank on the uploaded `inputs` (null: not given) and returns rank 0's
  // outputs on the host (nullopt where it made none) and the taps (at tp > 1 the ranks' parts put
  // together). invalid_argument for use_graph with taps, and use_graph on the GPU at tp > 1.
  std::vector<std::optional<Tensor>> forward(const std::vector<const Tensor*>& inputs, const GroupRun& run,
                                             const CapturableForward& forward, Record* record);
  // Runs `body` eagerly on every rank (a backward), each in its own thread past one, with its
  // context under `run`'s dropout arguments; the rounding counts joined as forward() joins them.
  void run_each(const GroupRun& run, const std::function<void(const RankContext&)>& body);

 private:
  std::string what_;
  DType dt_;
  int tp_;
  rt::Device* dev_;
  const OpLaunchers* ops_;
  std::vector<std::unique_ptr<rt::Stream>> streams_;      // per rank
  std::vector<std::unique_ptr<rt::Communicator>> comms_;  // tp > 1
  std::vector<GraphCache> graphs_;                        // per rank (use_graph)
};

}  // namespace twin::opt
