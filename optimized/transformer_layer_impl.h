// The optimized dense layer's state (private to optimized/transformer_layer*.cpp): the device, the
// full params' host copies, each rank's weights, activation buffers, stream, plan and graph, and
// the backward's buffers. The forward's jobs are in transformer_layer.cpp, the backward's in
// transformer_layer_backward.cpp.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "optimized/layer/attention_half.h"  // AttentionInputs, RankTap, BufferArena
#include "optimized/layer/graph_cache.h"     // StreamGraph
#include "optimized/layer/rank_plan.h"
#include "optimized/layer/rank_runner.h"  // runs_rank
#include "optimized/runtime/collectives.h"
#include "optimized/runtime/device.h"
#include "optimized/runtime/processes.h"
#include "optimized/transformer_layer.h"

namespace twin::opt {

struct DenseTransformerLayer::Impl {
  rt::Device* dev = nullptr;
  DType dt = DType::F32;
  int h = 0, np = 0, ng = 0, hn = 0, ffn = 0;
  std::map<std::string, Tensor> full;  // host copies of the full params (taps of the biases)

  struct Rank {
    DeviceWeights weights;
    BufferArena acts;  // activations for the current (s, b)
    std::optional<rt::Stream> stream;
    RankPlan plan;
    StreamGraph graph;           // its forward (use_graph)
    StreamGraph backward_graph;  // its backward (use_graph), captured against the last forward's buffers
    // What backward() reads beyond the activation buffers, kept by the last forward when it was
    // asked to (kept: for that forward's shape): the softmax statistics, and linear_qkv's output
    // before qk-layernorm (which works in place).
    rt::DeviceBuffer softmax_stats, qkv_pre_norm;
    // The backward's buffers for the current (s, b): gradients and scratch (grads points into them).
    BufferArena grad_bufs;
    RankGrads grads;
  };
  std::vector<Rank> ranks;
  bool processes = false;  // LayerOptions::processes: this process holds only its own rank's buffers
  bool here(int r) const { return runs_rank(r, processes); }
  // The rank this process runs (rank 0 of threaded ranks): what the host reads of a plan, not its sizes alone.
  Rank& local() { return ranks.at(std::size_t(processes ? rt::process_rank() : 0)); }
  std::vector<std::unique_ptr<rt::Communicator>> comms;
  BufferShape buffer_shape;  // what the activations are allocated for
  rt::DeviceBuffer freqs, mask;
  std::vector<rt::DeviceBuffer> inputs;  // per rank [s_local, b, h]
  bool kept = false;                     // the last forward kept what backward() reads
  int grads_s = -1, grads_b = -1;        // the shape the ranks' backward buffers are sized for
  // (Re)allocates every rank's backward buffers for the ranks' plans (transformer_layer_backward.cpp).
  void ensure_grad_buffers(rt::Backend backend);

  // The forward's steps (transformer_layer.cpp).
  void ensure_activations(const AttentionInputs& in, std::size_t mask_bytes);
  void set_rank_inputs(int r, const Tensor& hidden_states, const ForwardOptions& fo, MaskMode mask_mode,
                       const AttentionInputs& in, bool has_mask, bool rotary_interleaved);
  void record_tap(int r, TapPoint t, std::vector<RankTap>& taps);
  Tensor download_output(bool sp);

  const void* upload(Rank& r, const Tensor& t) { return r.weights.upload(*dev, t); }
};

}  // namespace twin::opt
