// The optimized twin of Megatron-Core's MoETransformerLayer (the local GPT spec with num_experts):
// the dense layer's attention half, then an MoELayer (TopKRouter, token dispatcher, the experts as
// grouped GEMMs, shared experts), on the GPU (Backend::Cuda) or the CUDA simulator (Backend::Sim),
// (moe_layer.cuh says how each step runs).
//
// Tensor parallelism: options.tp > 1 (with options.sp: Megatron trains an MoE layer at tp > 1 only
// with sequence parallelism) runs tp simulated ranks, the attention half sharded as the dense
// layer's; each rank's MoE MLP routes its slice of the sequence through every expert whole
// (expert_tensor_parallel_size 1: no dispatch between the ranks), the router's load-balancing
// counts all-reduced and the z-loss coefficient divided by tp as Megatron's router does, the
// shared experts a tensor-parallel MLP. The output, taps and gradients are the ranks' put together
// as the whole layer's. Tensor and expert parallelism together run at ep = tp, one group of ranks
// as Megatron forms them at expert tensor-parallel size 1 (the expert-parallel groups of
// consecutive ranks, inside the tensor-parallel ones): each rank's slice of the tokens goes to the
// experts' owners through the config's dispatcher, and an expert's weight gradient is its owner's
// alone (no 1 / ep: the ranks hold different tokens, not replicas).
//
// Expert parallelism: config.expert_model_parallel_size = ep (dividing num_moe_experts) runs ep
// simulated ranks (threads, the threaded collectives), rank r holding the local experts
// [r * E / ep, (r + 1) * E / ep), with the config's dispatcher between them (Megatron's alltoall
// or allgather). Every rank holds the same tokens (the layer's input, as data-parallel replicas of
// one batch), so each rank's router, routing_map and losses are the ep = 1 ones, and each token's
// expert rows come back to it computed by the experts' owners; the output and record are rank
// 0's. The alltoall dispatcher adds no rounding (the output is bitwise the ep = 1 one on the
// simulator); the allgather dispatcher's reduce-scatter adds the ranks' partial sums (its
// rounding points are counted). On the GPU ep must be 1 (one device here).
//
// What it does not implement is named by moe_layer_unsupported() before anything runs (the feature
// table's refusal, optimized/layer/features.h, or what the MoE layer cannot run of a valid config),
// so a caller reports `unsupported` instead of computing a wrong answer.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/record.h"
#include "core/tensor.h"
#include "optimized/layer/sharding.h"  // ShardLayout
#include "optimized/transformer_layer.h"

namespace twin::opt {

// Empty when this twin supports `config` (an MoE layer config); else why not, in one line.
std::string moe_layer_unsupported(const TransformerConfig& config, const LayerOptions& options = {});

// Megatron's state-dict keys the MoE layer needs for `config`.
std::vector<std::string> moe_layer_param_keys(const TransformerConfig& config);

struct MoEForwardInputs {
  const Tensor* attention_mask = nullptr;  // BOOL [b or 1, 1 or np, s, s]
  const Tensor* rotary_pos_emb = nullptr;  // F32 [s, 1, 1, rot_dim]
  const Tensor* padding_mask = nullptr;    // BOOL [b, s], True = padding
  // Megatron's routing map [T, E] from a golden: with capacity dropping, the post-drop map a golden
  // fixes where the capacity cut depends on torch.topk's order among ties (checked to be a valid
  // outcome, then used); without, the top-k choice itself (k experts per token).
  const Tensor* recorded_routing_map = nullptr;
};

class MoETransformerLayer {
 public:
  // params: the full state dict under Megatron's keys. Throws ConfigError naming an unsupported
  // feature (moe_layer_unsupported), ShapeError for a missing or misshapen parameter.
  MoETransformerLayer(const TransformerConfig& config, const std::map<std::string, Tensor>& params,
                      LayerOptions options = {});
  ~MoETransformerLayer();
  MoETransformerLayer(const MoETransformerLayer&) = delete;
  MoETransformerLayer& operator=(const MoETransformerLayer&) = delete;

  // hidden_states [s, b, h]. With record_taps the record holds the taps (the reference's names),
  // the tap_in.mlp.experts.* inputs, the aux losses (loss / coeff) and the expert-bias counter.
  // Exactly _forward_mlp_router, _forward_mlp_expert_compute, _forward_mlp_postprocess in turn (at
  // ep > 1 each rank's thread runs its three phases in turn, started once per forward).
  LayerOutput forward(const Tensor& hidden_states, const MoEForwardInputs& inputs, const ForwardOptions& options = {});

  // The forward as Megatron's MoETransformerLayer splits it for partial CUDA graphs, under its
  // method names (the reference's too), each phase callable alone (the router and postprocess
  // phases are the ones captured with use_graph):
  //   _forward_mlp_router: the attention half (Megatron's _forward_attention, which the twin's router
  //     graph covers too), pre_mlp_layernorm, the shared experts, the router and its losses, the
  //     dispatch preprocess (row-id map, permute) [N, h]; starts a new forward, dropping an unfinished one;
  //   _forward_mlp_expert_compute: the tokens per expert to the host, the grouped experts [N, h];
  //   _forward_mlp_postprocess: combine (unpermute), + shared experts, mlp_bda: the output [s, b, h]
  //     and the record of the whole forward.
  // A phase called before its predecessor throws std::logic_error naming the missing phase, and
  // leaves the forward in flight as it was. A phase that throws otherwise drops the forward. The
  // inputs are copied by _forward_mlp_router (they need not outlive it). At ep > 1 each phase
  // runs every rank (one thread each) and returns when all are done.
  void _forward_mlp_router(const Tensor& hidden_states, const MoEForwardInputs& inputs,
                           const ForwardOptions& options = {});
  void _forward_mlp_expert_compute();
  LayerOutput _forward_mlp_postprocess();

  // Why backward() does not cover this layer, or none.
  std::optional<std::string> backward_unsupported() const;
  // The gradients of the last forward (all three phases, run with keep_for_backward) for
  // grad_output [s, b, h]: the input's and every parameter's under Megatron's keys, with the
  // magnitudes their rounding error scales with when asked. std::logic_error when unsupported or
  // when the last forward kept nothing. Runs MoELayer's backward (moe_layer_backward.cuh) after
  // mlp_bda's and before pre_mlp_layernorm's and the attention half's, on every expert-parallel
  // rank: each holds a replica of the batch, so an expert's weight gradient is scaled by 1 / ep as
  // Megatron's DDP scales it (the gradient of the ranks' mean loss).
  // Exactly _backward_mlp_postprocess, _backward_mlp_expert_compute, _backward_mlp_router in turn.
  LayerGradients backward(const Tensor& grad_output, bool with_magnitudes = false, bool use_graph = false);

  // The backward in three phases, the forward's in reverse (moe_layer_backward.cuh says what each
  // runs), each callable alone, in turn after a forward kept for backward:
  //   _backward_mlp_postprocess: mlp_bda's, the combine's and the shared experts' backward;
  //   _backward_mlp_expert_compute: the experts' (at ep > 1 between the dispatcher's duals);
  //   _backward_mlp_router: the dispatch's, the router's, pre_mlp_layernorm's and the attention
  //     half's; returns the gradients.
  // With use_graph the postprocess and router phases are captured as graphs once (for this
  // forward's shape and arguments) and replayed; the expert phase is always eager. A phase called
  // before its predecessor throws std::logic_error naming the missing phase.
  void _backward_mlp_postprocess(const Tensor& grad_output, bool use_graph = false);
  void _backward_mlp_expert_compute();
  LayerGradients _backward_mlp_router(bool with_magnitudes = false, bool use_graph = false);

  // Tokens per expert of the last forward over all E experts: rank 0's tokens at ep > 1 (every
  // rank's are the same), every rank's at tp > 1.
  std::vector<std::int64_t> tokens_per_expert() const;

 private:
  struct Impl;  // one expert-parallel rank
  static void init_rank(Impl& m, const TransformerConfig& config, const std::map<std::string, Tensor>& params,
                        const LayerOptions& options, int ep_rank, int tp_rank);
  // At tp > 1: the ranks' outputs and records put together as the whole layer's.
  LayerOutput gather_tensor_parallel(std::vector<LayerOutput> outs);
  // With ranks as processes: what each rank's forward left on the host (its output and record,
  // attention taps, token counts) on every process, as threaded ranks leave it.
  void share_forward_results(std::vector<LayerOutput>& outs);
  // The rank whose host state this process keeps current: 0, or (processes) its own.
  Impl& local() const;
  enum class PhaseKind { Router, ExpertCompute, Postprocess };
  enum class BackwardPhaseKind { Postprocess, ExpertCompute, Router };
  // `before` (if any) first on each rank, in its phase.
  void run_backward_phase(BackwardPhaseKind kind, bool use_graph, const std::function<void(Impl&)>& before = {});
  void on_every_rank(const std::function<void(int)>& phase);
  ForwardOptions rank_options(const ForwardOptions& options, int rank) const;
  void set_gather_expert_taps(const ForwardOptions& options);
  void router_rank(int rank, const Tensor& hidden_states, const MoEForwardInputs& inputs,
                   const ForwardOptions& options);
  void router_rank_body(Impl& m, const Tensor& hidden_states, const MoEForwardInputs& inputs,
                        const ForwardOptions& options);
  void expert_compute_rank(int rank);
  LayerOutput postprocess_rank(int rank);
  void run_graph_phase(Impl& m, PhaseKind kind);
  void set_magnitudes(LayerGradients& out) const;
  Tensor gathered(const std::function<const void*(const Impl&)>& ptr_of, const Shape& part, ShardLayout layout,
                  DType as, int first = 0) const;
  TransformerConfig config_;
  LayerOptions options_;
  std::vector<std::unique_ptr<Impl>> ranks_;
};

}  // namespace twin::opt
