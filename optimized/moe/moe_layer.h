// MoELayer's host side on one expert-parallel rank (megatron/core/transformer/moe/moe_layer.py:
// TopKRouter, the token dispatcher, the experts and the shared experts): its parameters, its
// MoELayerPlan (moe_layer_plan.h) and its buffers, the router's losses and expert-bias counter, its inputs
// and taps. Its kernel sequence is moe_layer.cuh; MoETransformerLayer (moe_transformer_layer.cpp)
// runs it after the attention half, in Megatron's three phases.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/record.h"
#include "core/tensor.h"
#include "optimized/layer/buffer_arena.h"
#include "optimized/layer/options.h"
#include "optimized/moe/moe_layer_plan.h"

namespace twin::opt {

// The MoE MLP's state-dict keys for `c`: the router, every expert, the shared experts.
std::vector<std::string> moe_mlp_param_keys(const TransformerConfig& c);

// padding_mask [b, s] (True = padding) in token order t = s_idx * b + b_idx; empty without one.
std::vector<std::uint8_t> token_padding(const std::string& who, const Tensor* padding_mask, int s, int b);
// The recorded routing map [T, E] as bytes; empty without one.
std::vector<std::uint8_t> recorded_map(const std::string& who, const Tensor* map, std::int64_t T, std::int64_t E);

struct MoEMlpRank {
  std::string who;  // the layer's name, for errors
  DType dt = DType::F32, rdt = DType::F32;
  int h = 0, E = 0, topk = 1, ffn = 0, shared_ffn = 0;
  int e0 = 0, local_E = 0;         // this rank's experts: [e0, e0 + local_E)
  int tp = 1;                      // tensor-parallel size (sequence parallel: this rank's tokens are s / tp * b)
  rt::DeviceBuffer global_tokens;  // global_aux_loss accumulator
  double ga_steps = 0;
  std::vector<double> local_tokens;  // expert-bias counter
  bool has_expert_bias = false;
  std::optional<AuxLossKind> graph_aux_kind;  // the router graph's loss kernel arguments
  bool graph_z_loss = false;
  double max_logit = 0.0;  // this forward's largest |router logit| (the probabilities' magnitude)

  // The sizes of `c` and this rank's experts; ConfigError for sizes the layer cannot run.
  void configure(const TransformerConfig& c, int rank);
  // The MoE MLP's parameter shapes (the expert bias aside) into `shapes`.
  void add_param_shapes(const TransformerConfig& c, std::map<std::string, Shape>& shapes) const;
  // The MoE fields of `P` from `c` and the full params, this rank's weights uploaded (expert-
  // parallel rank `rank`'s experts; tensor-parallel rank tp_rank of tp's shard of the shared experts).
  void bind(MoELayerPlan& P, const TransformerConfig& c, const std::map<std::string, Tensor>& full, int rank,
            rt::Communicator* ep_comm, DeviceWeights& weights, rt::Device& dev, int tp_rank = 0, int tp = 1);
  // Its buffers for s x b tokens as rows of `arena`: T = s * b, or at tp > 1 (sequence parallel)
  // the rank's s / tp * b, the shared experts' MLP over all s * b with its shared_ffn / tp columns.
  void add_buffers(MoELayerPlan& P, BufferArena& arena, rt::Device& dev, int s, int b, int tp = 1) const;
  // The router's losses of this forward (only while training, as Megatron's router) and the
  // expert-bias counter. Returns whether a loss kernel's argument a captured router graph bakes
  // in changed.
  bool set_losses(MoELayerPlan& P, const TransformerConfig& c, const ForwardOptions& fo);
  // The expert-bias counter after a graph replay (the replay skips the host's count): every
  // non-padding token's routed experts from the routing map [T, E].
  void count_routed_tokens(const Tensor& routing_map, const std::vector<std::uint8_t>& padding);
  // The taps, inputs, losses and state at `t` of the forward of this rank's S x B tokens into
  // `rec`; `download(ptr, dtype, shape)` reads a device buffer. At tp > 1 each rank's part, which
  // gather_tensor_parallel_moe_records puts together.
  void tap(MoETapPoint t, const MoELayerPlan& P, std::int64_t S, std::int64_t B,
           const std::function<Tensor(const void*, DType, Shape)>& download, Record& rec);
};

// The MoE MLP's record of the whole layer from its tensor-parallel ranks' (each recorded by
// MoEMlpRank::tap over the rank's slice of the sequence, the same entries in the same order;
// tokens_per_expert: each rank's routed rows per expert), as a one-rank layer records it:
//   token-major tensors ([s_l, b, ...], [s_l * b, E]) and each expert's rows: the ranks' in rank
//     order (the sequence's order, so each expert's rows stay in token order);
//   the experts' rows in expert-major order (mlp.experts.0, the dispatched input and
//     probabilities): for each expert, rank 0's rows, rank 1's, ...;
//   the shared experts' linear_fc1 output: each rank's columns (both GLU halves);
//   tokens per expert, the expert-bias counts and the load-balancing losses summed (Megatron's
//     tracker sums the ranks' parts); the z-loss averaged (each rank's is the mean over its tokens).
// Each entry's rounding count is the join of the ranks', its magnitude the largest.
Record gather_tensor_parallel_moe_records(const std::vector<Record>& ranks,
                                          const std::vector<std::vector<std::int64_t>>& tokens_per_expert, bool glu);

}  // namespace twin::opt
