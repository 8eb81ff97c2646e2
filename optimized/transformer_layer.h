// The optimized twin of Megatron-Core's dense TransformerLayer (the local GPT layer spec):
// input_layernorm -> SelfAttention (linear_qkv, qk-layernorm, RoPE, core_attention, linear_proj)
// -> bias-dropout-add -> pre_mlp_layernorm -> MLP (linear_fc1, activation / GLU, linear_fc2)
// -> bias-dropout-add, on the GPU (Backend::Cuda) or the CUDA simulator (Backend::Sim).
//
// It loads the FULL (unsharded) Megatron state dict and shards it itself for a tensor-parallel size
// tp (1, 2, 4, ...), with or without sequence parallelism, as Megatron shards it: linear_qkv rows
// by query groups, linear_fc1 rows by columns of both GLU halves, linear_proj / linear_fc2 columns
// (row parallel). Ranks are simulated in one process (one thread per rank, the threaded
// collectives) on the simulator; on the GPU, tp must be 1 (one device here).
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/config.h"
#include "core/record.h"
#include "core/tensor.h"
#include "optimized/layer/features.h"
#include "optimized/layer/options.h"
#include "optimized/runtime/device.h"

namespace twin::opt {

// One parameter's gradient under its Megatron state-dict key, with the magnitude its rounding
// error scales with (RecordEntry::magnitude: a weight's max_ij sum_rows |dy_i x_j|, a bias's
// max_i sum_rows |dy_i|, a norm's max_i sum_rows |dy_i x_hat_i| / |dy_i|: the sums the gradient
// is an fp32 accumulation of, as the reference's ParamGrad names them).
struct ParamGradient {
  std::string name;
  Tensor value;
  double magnitude = -1.0;
};

struct LayerGradients {
  Tensor hidden_states;               // d input [s, b, h] in the params dtype
  std::vector<ParamGradient> params;  // every parameter of the layer
};

class DenseTransformerLayer {
 public:
  // params: full state dict under Megatron's keys ("self_attention.linear_qkv.weight", ...), in
  // the params dtype. Throws ConfigError / ShapeError / std::invalid_argument naming the problem.
  DenseTransformerLayer(const TransformerConfig& config, const std::map<std::string, Tensor>& params,
                        LayerOptions options = {});
  ~DenseTransformerLayer();
  DenseTransformerLayer(const DenseTransformerLayer&) = delete;
  DenseTransformerLayer& operator=(const DenseTransformerLayer&) = delete;

  // hidden_states [s, b, h]; attention_mask BOOL [b or 1, 1 or np, s, s] (True = masked) or null;
  // rotary_pos_emb [s, 1, 1, rot_dim] fp32 angles or null (required with RoPE).
  LayerOutput forward(const Tensor& hidden_states, const Tensor* attention_mask, const Tensor* rotary_pos_emb,
                      const ForwardOptions& options = {});

  // Why backward() does not cover this layer, or none.
  std::optional<std::string> backward_unsupported() const;
  // The gradients of the last forward (run with keep_for_backward) for grad_output [s, b, h] (its
  // shape and dtype): the input's and every parameter's, each the full tensor (the ranks' shards
  // gathered in rank order; a replicated parameter's grad summed over the ranks where each computed
  // a part, as finalize_model_grads does). Rounding points are counted on from the running count
  // (a gradient depends on every forward activation it reads), the collectives' sums included. with_magnitudes: each
  // parameter grad's magnitude (ParamGradient), computed on the host from the gradients and
  // activations the run leaves in its buffers (a host pass of O(tokens x in x out) per linear, for
  // comparisons with a counted bound; else -1). use_graph: the first such call after a forward
  // captures the backward's kernels and GEMMs into a CUDA graph and every later one replays it
  // (rounding points are counted at the capture only; tp = 1, else std::invalid_argument).
  // std::logic_error when unsupported or when the last forward kept nothing.
  LayerGradients backward(const Tensor& grad_output, bool with_magnitudes = false, bool use_graph = false);

  // Device time of one forward (ms), averaged over `iters` replays of the layer captured by the
  // last forward() call with use_graph (tp == 1): the kernels and GEMMs only, no host copies.
  // Throws std::logic_error when no graph has been captured.
  double time_forward_ms(int iters);
  // The same for the backward captured by the last backward() call with use_graph.
  double time_backward_ms(int iters);

  const TransformerConfig& config() const { return config_; }
  const LayerOptions& options() const { return options_; }

 private:
  struct Impl;
  TransformerConfig config_;
  LayerOptions options_;
  std::unique_ptr<Impl> impl_;
};

// Megatron's state-dict keys the dense layer needs for `config` (biases and norms included or not).
std::vector<std::string> dense_layer_param_keys(const TransformerConfig& config);

}  // namespace twin::opt
