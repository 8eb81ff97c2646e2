#include "reference/moe/experts.h"

#include "core/progress.h"

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
                           const std::vector<double>& permuted_probs_in, const Taps& taps,
                           SequentialMLPSaved* saved) const {
  if (tokens_per_expert.size() != local_experts.size())
    throw ShapeError("SequentialMLP: tokens_per_expert has " + std::to_string(tokens_per_expert.size()) +
                     " entries for " + std::to_string(local_experts.size()) + " local experts");
  Index total = 0;
  for (Index c : tokens_per_expert) total += c;
  if (total != permuted_local_hidden_states.rows() || static_cast<Index>(permuted_probs_in.size()) != total)
    throw ShapeError("SequentialMLP: tokens_per_expert sums to " + std::to_string(total) + ", hidden states have " +
                     std::to_string(permuted_local_hidden_states.rows()) + " rows, probs " +
                     std::to_string(permuted_probs_in.size()));

  if (saved) {
    if (config_.moe_apply_probs_on_input)
      throw MoEError("SequentialMLP: moe_apply_probs_on_input has no backward in the reference");
    *saved = SequentialMLPSaved{};
    saved->local_experts.resize(local_experts.size());
    saved->tokens_per_expert = tokens_per_expert;
    saved->permuted_probs = permuted_probs_in;
  }
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
    const Mat output =
        local_experts[i]
            .forward_inner(hidden.middleRows(start, n), args, expert_taps, saved ? &saved->local_experts[i] : nullptr)
            .output;
    output_local.middleRows(start, n) = expert_taps.record("0", output, {n, output.cols()}, p_);
    start += n;
    experts_end.join(rounding_now());
  }
  rounding_set(experts_end);
  return taps.record("0", output_local, {output_local.rows(), output_local.cols()}, p_);
}

SequentialMLPGrads SequentialMLP::backward(const Mat& doutput, SequentialMLPSaved&& saved) const {
  if (saved.local_experts.size() != local_experts.size())
    throw std::logic_error("SequentialMLP::backward: `saved` was not filled by forward(..., saved)");
  const Index N = static_cast<Index>(saved.permuted_probs.size());
  if (doutput.rows() != N || doutput.cols() != config_.hidden_size)
    throw ShapeError("SequentialMLP backward: grad_output is [" + std::to_string(doutput.rows()) + ", " +
                     std::to_string(doutput.cols()) + "], the forward's output [" + std::to_string(N) + ", " +
                     std::to_string(config_.hidden_size) + "]");
  SequentialMLPGrads g;
  g.permuted_local_hidden_states.resize(N, config_.hidden_size);
  g.permuted_probs.assign(static_cast<std::size_t>(N), 0.0);
  // torch.cat's backward splits the gradient; each expert's backward is a branch of its own: the
  // count goes on with the largest.
  const RoundingCount at_output = rounding_now();
  RoundingCount experts_end = at_output;
  Index start = 0;
  for (std::size_t i = 0; i < local_experts.size(); ++i) {
    rounding_set(at_output);
    const Index n = saved.tokens_per_expert[i];
    const std::vector<double> probs(saved.permuted_probs.begin() + start, saved.permuted_probs.begin() + start + n);
    MlpArgs args;
    args.lead = {n};
    args.per_token_scale = &probs;
    args.per_token_scale_dtype = probs_dtype_;
    // An expert without tokens still ran (on [0, h]): its weights' gradients are zeros.
    const progress::Step step("local_experts." + std::to_string(i));
    const MlpGrads eg =
        local_experts[i].backward(doutput.middleRows(start, n), std::move(saved.local_experts[i]), args);
    g.permuted_local_hidden_states.middleRows(start, n) = eg.hidden_states;
    for (Index r = 0; r < n; ++r) g.permuted_probs[start + r] = eg.per_token_scale[r];
    for (const ParamGrad& p : eg.params)
      g.params.push_back({"local_experts." + std::to_string(i) + "." + p.name, p.value, p.shape, p.magnitude});
    start += n;
    experts_end.join(rounding_now());
  }
  rounding_set(experts_end);
  return g;
}

}  // namespace twin::reference::moe
