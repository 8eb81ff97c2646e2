// The optimized dense layer's state (private to optimized/transformer_layer*.cpp): the device, the
// full params' host copies, each rank's weights, activation buffers, stream, plan and graph, and
// the backward's buffers. The forward's jobs are in transformer_layer.cpp, the backward's in
// transformer_layer_backward.cpp.
#pragma once

#include <algorithm>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/rounding.h"
#include "optimized/layer/attention_half.h"  // AttentionInputs
#include "optimized/layer/graph_cache.h"     // StreamGraph
#include "optimized/runtime/collectives.h"
#include "optimized/runtime/device.h"
#include "optimized/transformer_layer.h"
#include "optimized/transformer_layer_plan.h"

namespace twin::opt {

// How one rank holds its part of a tap: dim < 0, the whole tensor (the same on every rank);
// else each rank's tensor, its dims from `dim` on split into `blocks` equal consecutive blocks,
// holds one slice of each block along `dim` (blocks = 2: linear_fc1 with GLU, whose output is
// [gate | linear] both on a rank and in the full tensor).
struct ShardLayout {
  int dim = -1;
  int blocks = 1;
};

// The full tensor from the ranks' shards in rank order: for each index before `dim`, for each
// block, rank 0's slice, rank 1's, ... (a concatenation along `dim` block by block).
inline Tensor gather_shards(const std::vector<const Tensor*>& shards, ShardLayout layout) {
  const Tensor& s0 = *shards.at(0);
  if (layout.dim < 0 || shards.size() == 1) return s0;
  Shape shape = s0.shape();
  std::int64_t outer = 1;
  for (int d = 0; d < layout.dim; ++d) outer *= shape[d];
  const std::size_t chunk = s0.nbytes() / static_cast<std::size_t>(outer * layout.blocks);
  shape[layout.dim] *= static_cast<std::int64_t>(shards.size());
  Tensor out = Tensor::empty(s0.dtype(), shape);
  std::byte* dst = out.raw_mut();
  for (std::int64_t o = 0; o < outer * layout.blocks; ++o)
    for (const Tensor* t : shards) {
      std::memcpy(dst, t->raw() + static_cast<std::size_t>(o) * chunk, chunk);
      dst += chunk;
    }
  return out;
}

struct DenseTransformerLayer::Impl {
  rt::Device* dev = nullptr;
  DType dt = DType::F32;
  int h = 0, np = 0, ng = 0, hn = 0, ffn = 0;
  std::map<std::string, Tensor> full;  // host copies of the full params (taps of the biases)

  struct Rank {
    std::vector<rt::DeviceBuffer> weights;
    BufferArena acts;  // activations for the current (s, b)
    std::optional<rt::Stream> stream;
    RankPlan plan;
    StreamGraph graph;  // its forward (use_graph)
    // What backward() reads beyond the activation buffers, kept by the last forward when it was
    // asked to (kept: for that forward's shape): the softmax statistics, and linear_qkv's output
    // before qk-layernorm (which works in place).
    rt::DeviceBuffer softmax_stats, qkv_pre_norm;
    // The backward's buffers for the current (s, b): gradients and scratch (grads points into them).
    BufferArena grad_bufs;
    RankGrads grads;
  };
  std::vector<Rank> ranks;
  std::vector<std::unique_ptr<rt::Communicator>> comms;
  int cur_s = -1, cur_b = -1, cur_rot = -1;
  bool cur_mask = false;
  rt::DeviceBuffer freqs, mask;
  std::vector<rt::DeviceBuffer> inputs;  // per rank [s_local, b, h]
  StreamGraph backward_graph;            // rank 0's backward (tp = 1), captured against the last forward's buffers
  bool kept = false;                     // the last forward kept what backward() reads
  int grads_s = -1, grads_b = -1;        // the shape the ranks' backward buffers are sized for
  // (Re)allocates every rank's backward buffers for the ranks' plans (transformer_layer_backward.cpp).
  void ensure_grad_buffers(rt::Backend backend);

  // The forward's steps (transformer_layer.cpp).
  void ensure_activations(const AttentionInputs& in, bool mask);
  void set_rank_inputs(int r, const Tensor& hidden_states, const ForwardOptions& fo, MaskMode mask_mode,
                       const AttentionInputs& in, bool has_mask, bool rotary_interleaved);
  // One rank's part of a tap, with the rounding count of its thread when it was produced.
  struct RankTap {
    std::string name;
    Tensor value;
    RoundingCount rounding;
    ShardLayout layout;
  };
  void record_tap(int r, TapPoint t, std::vector<RankTap>& taps);
  Record gather_rank_taps(const std::vector<std::vector<RankTap>>& rank_taps);
  Tensor download_output(bool sp);

  const void* upload(Rank& r, const Tensor& t) {
    r.weights.emplace_back(*dev, t.nbytes());
    r.weights.back().upload(t.raw(), t.nbytes());
    return r.weights.back().get();
  }
};

}  // namespace twin::opt
