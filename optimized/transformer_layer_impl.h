// The optimized dense layer's state (private to optimized/transformer_layer*.cpp): the device, the
// full params' host copies, each rank's weights, activation buffers, stream, plan and graph, and
// the backward's buffers. The forward's jobs are in transformer_layer.cpp, the backward's in
// transformer_layer_backward.cpp.
#pragma once

#include <algorithm>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "optimized/runtime/collectives.h"
#include "optimized/runtime/device.h"
#include "optimized/transformer_layer.h"
#include "optimized/transformer_layer_plan.h"

namespace twin::opt {

struct DenseTransformerLayer::Impl {
  rt::Device* dev = nullptr;
  DType dt = DType::F32;
  int h = 0, np = 0, ng = 0, hn = 0, ffn = 0;
  std::map<std::string, Tensor> full;  // host copies of the full params (taps of the biases)

  struct Rank {
    std::vector<rt::DeviceBuffer> weights;
    std::vector<rt::DeviceBuffer> acts;  // activation buffers for the current (s, b)
    std::optional<rt::Stream> stream;
    RankPlan plan;
    std::optional<rt::Graph> graph;
  };
  std::vector<Rank> ranks;
  std::vector<std::unique_ptr<rt::Communicator>> comms;
  int cur_s = -1, cur_b = -1, cur_rot = -1;
  bool cur_mask = false;
  rt::DeviceBuffer freqs, mask;
  std::vector<rt::DeviceBuffer> inputs;  // per rank [s_local, b, h]
  // What backward() reads beyond the activation buffers: the softmax statistics (rank 0; tp = 1),
  // kept by the last forward when it was asked to (kept: for that forward's shape).
  rt::DeviceBuffer softmax_stats;
  rt::DeviceBuffer qkv_pre_norm;            // linear_qkv's output before qk-layernorm, kept for its backward
  std::optional<rt::Graph> backward_graph;  // rank 0's backward, captured against the last forward's buffers
  bool kept = false;
  // The backward's buffers for the current (s, b): gradients and scratch (RankGrads points into them).
  std::vector<rt::DeviceBuffer> grad_bufs;
  RankGrads grads;
  int grads_s = -1, grads_b = -1;
  // (Re)allocates the backward's buffers for rank 0's plan (transformer_layer_backward.cpp).
  void ensure_grad_buffers(const RankPlan& p, rt::Backend backend);

  const void* upload(Rank& r, const Tensor& t) {
    r.weights.emplace_back(*dev, t.nbytes());
    r.weights.back().upload(t.raw(), t.nbytes());
    return r.weights.back().get();
  }

  // Device time of one replay of `graph` on rank 0's stream (ms), averaged over `iters` after one
  // warm replay; `what` names the call for the error when nothing was captured.
  double time_graph_ms(std::optional<rt::Graph>& graph, int iters, const std::string& what) {
    if (!graph) throw std::logic_error(what);
    rt::Stream& s = *ranks.at(0).stream;
    rt::Event start(*dev), stop(*dev);
    graph->launch(s);  // warm
    start.record(s);
    for (int i = 0; i < iters; ++i) graph->launch(s);
    stop.record(s);
    stop.synchronize();
    return static_cast<double>(stop.elapsed_ms_since(start)) / std::max(1, iters);
  }
};

}  // namespace twin::opt
