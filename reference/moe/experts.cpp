#include "reference/moe/experts.h"

namespace twin::reference::moe {

SequentialMLP::SequentialMLP(int num_local_experts, const TransformerConfig& config, Precision p, DType probs_dtype)
    : config_(config), p_(p), probs_dtype_(probs_dtype) {
  // SequentialMLP overrides ffn_hidden_size with moe_ffn_hidden_size (default ffn_hidden_size).
  const int ffn = config.moe_ffn_hidden_size.value_or(config.ffn());
  for (int i = 0; i < num_local_experts; ++i) local_experts.emplace_back(config, p, std::nullopt, ffn);
}

void SequentialMLP::load_state_dict(const StateDict& sd, const std::string& prefix) {
  for (std::size_t i = 0; i < local_experts.size(); ++i)
    local_experts[i].load_state_dict(sd, prefix + "local_experts." + std::to_string(i) + ".");
}

Mat SequentialMLP::forward(const Mat& permuted_local_hidden_states, const std::vector<Index>& tokens_per_expert,
                           const std::vector<double>& permuted_probs_in, const Taps& taps) const {
  if (tokens_per_expert.size() != local_experts.size())
    throw ShapeError("SequentialMLP: tokens_per_expert has " + std::to_string(tokens_per_expert.size()) +
                     " entries for " + std::to_string(local_experts.size()) + " local experts");
  Index total = 0;
  for (Index c : tokens_per_expert) total += c;
  if (total != permuted_local_hidden_states.rows() || static_cast<Index>(permuted_probs_in.size()) != total)
    throw ShapeError("SequentialMLP: tokens_per_expert sums to " + std::to_string(total) + ", hidden states have " +
                     std::to_string(permuted_local_hidden_states.rows()) + " rows, probs " +
                     std::to_string(permuted_probs_in.size()));

  Mat hidden = permuted_local_hidden_states;  // [N, h]
  std::vector<double> permuted_probs = permuted_probs_in;
  if (config_.moe_apply_probs_on_input) {
    if (config_.moe_router_topk != 1) throw MoEError("`moe_apply_probs_on_input` only works with `moe_router_topk`=1.");
    for (Index t = 0; t < hidden.rows(); ++t)
      for (Index j = 0; j < hidden.cols(); ++j)
        hidden(t, j) = p_.act(permuted_probs[t] * hidden(t, j));  // rounds: (probs * x).to(original_dtype)
    permuted_probs.assign(permuted_probs.size(), 1.0);            // probs already applied
  }

  // torch.split by tokens_per_expert; each expert on its slice; torch.cat.
  Mat output_local(hidden.rows(), hidden.cols());  // [N, h]
  const Taps local_taps = taps.child("local_experts");
  Index start = 0;
  // Each expert is a branch from the dispatched input: none inherits another's roundings.
  const RoundingCount at_input = rounding_now();
  RoundingCount experts_end = at_input;
  for (std::size_t i = 0; i < local_experts.size(); ++i) {
    rounding_set(at_input);
    const Index n = tokens_per_expert[i];
    const Taps expert_taps = local_taps.child(std::to_string(i));
    const std::vector<double> probs(permuted_probs.begin() + start, permuted_probs.begin() + start + n);
    MlpArgs args;  // expert(tokens, probs)
    args.lead = {n};
    args.per_token_scale = &probs;
    args.per_token_scale_dtype = probs_dtype_;
    const Mat output = local_experts[i].forward_inner(hidden.middleRows(start, n), args, expert_taps).output;
    output_local.middleRows(start, n) = expert_taps.record("0", output, {n, output.cols()}, p_);
    start += n;
    experts_end.join(rounding_now());
  }
  rounding_set(experts_end);
  return taps.record("0", output_local, {output_local.rows(), output_local.cols()}, p_);
}

}  // namespace twin::reference::moe
