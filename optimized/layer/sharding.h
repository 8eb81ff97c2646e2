// Megatron's tensor-parallel sharding of a layer's full state dict, by parameter-key rules, for
// every layer kind: rank r of tp holds
//   column parallel (rows of the weight and its bias): self_attention.linear_qkv by query groups
//     (contiguous in the grouped layout), cross_attention.attn.linear_q / linear_kv by heads
//     (linear_kv's [np, 2 hn] rows), mlp.linear_fc1 by output columns of both GLU halves
//     ([its gate rows | its linear rows]);
//   row parallel (columns of the weight): the linear_proj and mlp.linear_fc2 weights by input
//     columns;
//   replicated: the norms and the row-parallel linears' biases;
//   the MoE layer's shared experts as mlp.linear_fc1 / fc2 (of moe_shared_expert_intermediate_size);
//   its router, shared-expert gate and experts replicated (expert tensor-parallel size 1).
// Expert parallelism keeps whole experts per rank (each MoE rank uploads its local experts).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/tensor.h"

namespace twin::opt {

// The parameters under `keys` of a full state dict, each present with its shape in `shapes` and
// dtype dt ("<who>: missing parameter '<key>'" / the shape or dtype, as ShapeErrors).
std::map<std::string, Tensor> checked_params(const std::string& who, const std::map<std::string, Tensor>& params,
                                             const std::vector<std::string>& keys,
                                             const std::map<std::string, Shape>& shapes, DType dt);

// Rows [r0, r1) of a [rows, ...] tensor.
Tensor take_rows(const Tensor& t, std::int64_t r0, std::int64_t r1);
// Columns [c0, c1) of a [rows, cols] tensor.
Tensor take_cols(const Tensor& t, std::int64_t c0, std::int64_t c1);

// ConfigError "<who>: ..." unless the layer's sizes are positive, its heads divide into its query
// groups, and tp (named `tp_name` in the message) divides the heads, the query groups and ffn.
void check_tensor_parallel_sizes(const std::string& who, const TransformerConfig& c, int tp,
                                 const std::string& tp_name);

// Rank r's shard of the parameter under layer-relative `key` (rules above; the whole tensor at tp 1).
Tensor tensor_parallel_shard(const TransformerConfig& c, const std::string& key, const Tensor& t, int r, int tp);

// How one rank holds its part of an activation: dim < 0, the whole tensor (the same on every
// rank); else each rank's tensor, its dims from `dim` on split into `blocks` equal consecutive
// blocks, holds one slice of each block along `dim` (blocks = 2: linear_fc1 with GLU, whose output
// is [gate | linear] both on a rank and in the full tensor).
struct ShardLayout {
  int dim = -1;
  int blocks = 1;
};

// How the ranks hold the parameter under layer-relative `key` (tensor_parallel_shard's rules as a
// layout): gather_shards of every rank's shard (or of its gradient) gives the full tensor.
ShardLayout tensor_parallel_layout(const TransformerConfig& c, const std::string& key);
// The full tensor from the ranks' shards in rank order: for each index before `dim`, for each
// block, rank 0's slice, rank 1's, ... (a concatenation along `dim` block by block).
Tensor gather_shards(const std::vector<const Tensor*>& shards, ShardLayout layout);

}  // namespace twin::opt
