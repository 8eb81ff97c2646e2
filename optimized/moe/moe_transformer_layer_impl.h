// The optimized MoE layer's per-rank state, shared by its forward (moe_transformer_layer.cpp) and
// backward (moe_transformer_layer_backward.cpp).
#pragma once

#include <memory>
#include <optional>

#include "optimized/layer/buffer_arena.h"
#include "optimized/layer/graph_cache.h"
#include "optimized/moe/moe_layer.h"
#include "optimized/moe/moe_transformer_layer.h"
#include "optimized/moe/moe_transformer_layer_plan.h"
#include "optimized/runtime/collectives.h"

namespace twin::opt {

struct MoETransformerLayer::Impl {
  rt::Device* dev = nullptr;
  DType dt = DType::F32;
  int h = 0, np = 0, ng = 0, hn = 0;
  std::unique_ptr<rt::Communicator> ep_comm;  // ep > 1 (tp = 1): this rank's handle to the expert-parallel group
  std::unique_ptr<rt::Communicator>
      tp_comm;  // tp > 1: ... to the tensor-parallel group (at ep = tp the expert-parallel one too)
  std::vector<RankTap> attention_taps;  // tp > 1: this rank's part of the attention half's taps
  std::map<std::string, Tensor> full;
  DeviceWeights weights;
  BufferArena acts;  // activations of the current shape
  std::optional<rt::Stream> stream;
  MoEPlan plan;
  MoEMlpRank mlp;  // the MoE MLP's sizes, losses, counters and taps (moe_layer.h)
  // Buffers of the current shape, the inputs' device copies and the phases' graphs.
  BufferShape buffer_shape;
  rt::DeviceBuffer x_in, freqs, mask, pad;
  StreamGraph router_graph, postprocess_graph;
  // What backward() reads beyond the activations, kept by the last forward when it was asked to:
  // the attention's softmax statistics, linear_qkv's output before the qk-norms.
  rt::DeviceBuffer softmax_stats, qkv_pre_norm;
  bool kept = false;  // the last forward (all three phases) kept what backward() reads
  // The backward's buffers (for the shape grads_shape) and their pointers.
  BufferArena grad_bufs;
  BufferShape grads_shape;
  MoEGrads grads;
  // The backward's postprocess and router phases captured (use_graph), and the phase that ran last.
  StreamGraph backward_postprocess_graph, backward_router_graph;
  enum class BackwardPhase { None, Postprocess, ExpertCompute };
  BackwardPhase backward_done = BackwardPhase::None;
  // Drops every captured graph (their buffers or baked-in arguments changed).
  void reset_graphs() {
    router_graph.reset();
    postprocess_graph.reset();
    backward_postprocess_graph.reset();
    backward_router_graph.reset();
  }
  // What one forward carries from phase to phase: the phase that ran last (a phase runs only after
  // its predecessor), the options, the inputs the phases read on the host, the record so far.
  enum class Phase { None, Router, ExpertCompute };
  Phase done = Phase::None;
  ForwardOptions fo;
  std::vector<std::uint8_t> padding, recorded;  // [T] token order, [T, E]
  std::int64_t S = 0, B = 0;
  LayerOutput pending;

  Tensor download(const void* ptr, DType type, Shape shape) {
    return download_tensor(*dev, *stream, ptr, type, std::move(shape));
  }
  // Forgets a forward in flight (after the postprocess, or when a phase threw).
  void end_forward() {
    done = Phase::None;
    plan.attn.on_tap = nullptr;
    plan.on_tap = nullptr;
    plan.recorded_map = nullptr;
    plan.padding_host = nullptr;
  }
  // The router phase's steps (below).
  void ensure_buffers(const BufferShape& shape);
  // hidden_states, the mask and padding, and the RoPE angles [s, rot] (undefined: none).
  void upload_inputs(const Tensor& hidden_states, const MoEForwardInputs& in, const Tensor& angles);
  void attention_tap(TapPoint t);
  // The kept buffers of this forward (null unless fo.keep_for_backward; the softmax statistics
  // also with taps); true if a pointer a graph bakes in changed.
  bool set_kept_buffers(bool keep, bool record_taps);
  // The backward's buffers for the current shape.
  void ensure_grad_buffers(rt::Backend backend);
};

}  // namespace twin::opt
