#include "reference/moe/token_dispatcher.h"

namespace twin::reference::moe {

namespace {

// torch.arange(n).reshape(rows, -1).T.ravel()
std::vector<Index> reshape_transpose_ravel(Index n, Index rows) {
  const Index cols = n / rows;
  std::vector<Index> out;
  for (Index j = 0; j < cols; ++j)
    for (Index i = 0; i < rows; ++i) out.push_back(i * cols + j);
  return out;
}

Mat probs_column(const std::vector<double>& v) {
  return Eigen::Map<const Mat>(v.data(), static_cast<Index>(v.size()), 1);
}

}  // namespace

MoETokenDispatcher::MoETokenDispatcher(const TransformerConfig& config, Precision p) : config_(config), p_(p) {
  if (!config.num_moe_experts || *config.num_moe_experts <= 0)
    throw MoEError("token dispatcher: num_moe_experts must be set and positive");
  num_experts_ = *config.num_moe_experts;
  num_local_experts_ = num_experts_ / ep_size_;  // one rank holds every expert
  for (int i = 0; i < num_local_experts_; ++i) local_expert_indices_.push_back(i);
}

// ---------------------------------------------------------------- MoEAllGatherTokenDispatcher

DispatchTensors MoEAllGatherTokenDispatcher::dispatch_preprocess(const Mat& hidden_states, Index seq_length, Index bsz,
                                                                 const BoolMat& routing_map, const Mat& probs) {
  // [S/TP, B, H] -> [S*B/TP, H]
  state = DispatcherState{};
  state.seq_length = seq_length;
  state.bsz = bsz;
  state.hidden = hidden_states.cols();
  state.routing_map = routing_map;
  return {hidden_states, probs};
}

DispatchTensors MoEAllGatherTokenDispatcher::token_dispatch(DispatchTensors x) {
  return x;  // all-gather over TP*EP: identity at one rank
}

ExpertInputs MoEAllGatherTokenDispatcher::dispatch_postprocess(DispatchTensors x) {
  // The routing map and probs of the local experts (every expert at one rank).
  const Index first = local_expert_indices_.front();
  state.local_map = state.routing_map.middleCols(first, num_local_experts_);  // [T, local E]
  const Mat local_probs = x.probs.middleCols(first, num_local_experts_);      // [T, local E]

  ExpertInputs out;
  for (Index e = 0; e < num_local_experts_; ++e) out.tokens_per_expert.push_back(state.local_map.col(e).count());
  Permuted permuted = permute(x.hidden_states, state.local_map, &local_probs, std::nullopt, /*drop_and_pad=*/false);
  state.reversed_local_input_permutation_mapping = permuted.sorted_indices;
  out.dispatched_input = std::move(permuted.tokens);
  // local_probs.T.masked_select(local_map.T): expert-major, like the tokens.
  out.permuted_probs = std::move(permuted.probs);
  state.routing_map = BoolMat();
  return out;
}

Mat MoEAllGatherTokenDispatcher::combine_preprocess(const Mat& expert_output) {
  // Reverse the permutation: scatter-add each expert row back to its token.
  return unpermute(expert_output, state.reversed_local_input_permutation_mapping, state.seq_length * state.bsz,
                   p_.params_dtype, Rounding::of(p_));
}

Mat MoEAllGatherTokenDispatcher::token_combine(Mat hidden_states) {
  return hidden_states;  // reduce-scatter over TP*EP: identity at one rank
}

Mat MoEAllGatherTokenDispatcher::combine_postprocess(Mat hidden_states) {
  return hidden_states;  // view(hidden_shape): [T, h] is the [s, b, h] memory
}

// ---------------------------------------------------------------- MoEAlltoAllTokenDispatcher

MoEAlltoAllTokenDispatcher::MoEAlltoAllTokenDispatcher(const TransformerConfig& config, Precision p)
    : MoETokenDispatcher(config, p), drop_and_pad_(config.moe_pad_expert_input_to_capacity) {
  if (drop_and_pad_ && !config.moe_expert_capacity_factor)
    throw MoEError("moe_pad_expert_input_to_capacity needs moe_expert_capacity_factor");
  const Index chunks = static_cast<Index>(num_experts_) * tp_size_;
  // [num_local_experts, tp_size * ep_size]: sort the input chunks by local experts, and back.
  sort_input_by_local_experts_ = reshape_transpose_ravel(chunks, chunks / num_local_experts_);
  restore_output_by_local_experts_ = reshape_transpose_ravel(chunks, num_local_experts_);
}

std::vector<Index> MoEAlltoAllTokenDispatcher::preprocess(const BoolMat& routing_map) {
  if (drop_and_pad_) {
    // Every expert processes exactly `capacity` rows.
    const Index num_tokens = routing_map.rows() * config_.moe_router_topk;
    state.capacity = get_capacity(num_tokens, num_experts_, *config_.moe_expert_capacity_factor);
    if (state.capacity > routing_map.rows())  // Megatron's permute fails here too (view to [E, capacity])
      throw MoEError("alltoall drop-and-pad: expert capacity " + std::to_string(state.capacity) + " exceeds the " +
                     std::to_string(routing_map.rows()) +
                     " tokens (moe_expert_capacity_factor too large for moe_pad_expert_input_to_capacity)");
    state.num_out_tokens = state.capacity * num_experts_;
    state.num_global_tokens_per_local_expert.assign(static_cast<std::size_t>(num_experts_ * tp_size_), state.capacity);
    return std::vector<Index>(num_local_experts_, state.capacity * tp_size_ * ep_size_);
  }
  // [num_experts]: tokens this rank routes to each expert.
  std::vector<Index> num_local_tokens_per_expert;
  for (Index e = 0; e < routing_map.cols(); ++e) num_local_tokens_per_expert.push_back(routing_map.col(e).count());
  if (config_.moe_expert_capacity_factor) {
    state.num_out_tokens = 0;  // dropped tokens leave: the routed count
    for (Index c : num_local_tokens_per_expert) state.num_out_tokens += c;
  } else {
    state.num_out_tokens = routing_map.rows() * config_.moe_router_topk;
  }
  // ep = tp = 1: the global counts are the local ones.
  state.num_global_tokens_per_local_expert = num_local_tokens_per_expert;
  return num_local_tokens_per_expert;
}

DispatchTensors MoEAlltoAllTokenDispatcher::dispatch_preprocess(const Mat& hidden_states, Index seq_length, Index bsz,
                                                                const BoolMat& routing_map, const Mat& probs) {
  state = DispatcherState{};
  state.seq_length = seq_length;
  state.bsz = bsz;
  state.hidden = hidden_states.cols();
  state.routing_map = routing_map;
  state.tokens_per_expert = preprocess(routing_map);
  // Permutation 1: input to AlltoAll input.
  Permuted permuted = permute(hidden_states, routing_map, &probs, state.num_out_tokens, drop_and_pad_);
  state.reversed_local_input_permutation_mapping = permuted.sorted_indices;
  return {std::move(permuted.tokens), probs_column(permuted.probs)};
}

DispatchTensors MoEAlltoAllTokenDispatcher::token_dispatch(DispatchTensors x) {
  return x;  // all-to-all over EP with input_splits == output_splits: identity at one rank
}

ExpertInputs MoEAlltoAllTokenDispatcher::dispatch_postprocess(DispatchTensors x) {
  // (all-gather over TP: identity.) Permutation 2: sort the chunks by local expert.
  std::vector<double> probs(x.probs.data(), x.probs.data() + x.probs.size());
  Mat tokens = std::move(x.hidden_states);
  if (num_local_experts_ > 1) {
    // drop_and_pad: view(tp*ep, local E, capacity, h).transpose(0, 1) is this same chunk sort
    // with every chunk `capacity` rows long.
    tokens =
        sort_chunks_by_idxs(tokens, state.num_global_tokens_per_local_expert, sort_input_by_local_experts_, &probs);
  }
  ExpertInputs out;
  out.dispatched_input = std::move(tokens);
  out.tokens_per_expert = state.tokens_per_expert;
  out.permuted_probs = std::move(probs);
  return out;
}

Mat MoEAlltoAllTokenDispatcher::combine_preprocess(const Mat& expert_output) {
  // Unpermutation 2: unsort the chunks by local expert. (Reduce-scatter over TP: identity.)
  if (num_local_experts_ <= 1) return expert_output;
  // num_global_tokens_per_local_expert.T.ravel(): [local E, tp*ep] transposed, flattened.
  const Index ranks = static_cast<Index>(state.num_global_tokens_per_local_expert.size()) / num_local_experts_;
  std::vector<Index> split_sizes;
  for (Index l = 0; l < num_local_experts_; ++l)
    for (Index r = 0; r < ranks; ++r)
      split_sizes.push_back(state.num_global_tokens_per_local_expert[r * num_local_experts_ + l]);
  return sort_chunks_by_idxs(expert_output, split_sizes, restore_output_by_local_experts_);
}

Mat MoEAlltoAllTokenDispatcher::token_combine(Mat hidden_states) {
  return hidden_states;  // all-to-all over EP: identity at one rank
}

Mat MoEAlltoAllTokenDispatcher::combine_postprocess(Mat hidden_states) {
  // Unpermutation 1: AlltoAll output to output (scatter-add, no probs: the experts applied them).
  return unpermute(hidden_states, state.reversed_local_input_permutation_mapping, state.seq_length * state.bsz,
                   p_.params_dtype, Rounding::of(p_));
}

std::unique_ptr<MoETokenDispatcher> make_token_dispatcher(const TransformerConfig& config, Precision p) {
  if (config.moe_token_dispatcher_type == "allgather") return std::make_unique<MoEAllGatherTokenDispatcher>(config, p);
  if (config.moe_token_dispatcher_type == "alltoall") return std::make_unique<MoEAlltoAllTokenDispatcher>(config, p);
  throw MoEError("moe_token_dispatcher_type '" + config.moe_token_dispatcher_type +
                 "' is not supported by the reference (allgather | alltoall; flex needs DeepEP/HybridEP)");
}

}  // namespace twin::reference::moe
