#include "reference/moe/experts.h"

#include "reference/activations.h"

namespace twin::reference::moe {

namespace {

// Result dtype of torch's `a * b` for the float dtypes here.
DType promote(DType a, DType b) {
  if (a == DType::F64 || b == DType::F64) return DType::F64;
  if (a == DType::F32 || b == DType::F32) return DType::F32;
  return a;
}

}  // namespace

Mat expert_mlp_forward(const MLP& expert, const Mat& hidden_states, const std::vector<double>& per_token_scale,
                       DType probs_dtype, const Precision& p, const Taps& taps) {
  const Rounding rnd = Rounding::of(p);
  const DType act_dt = p.params_dtype;
  const DType product_dt = promote(act_dt, probs_dtype);
  const Shape lead = {hidden_states.rows()};
  if (static_cast<Index>(per_token_scale.size()) != hidden_states.rows())
    throw ShapeError("expert MLP: " + std::to_string(per_token_scale.size()) + " probabilities for " +
                     std::to_string(hidden_states.rows()) + " tokens");

  // [n, ffn (x2 GLU)]
  OutputWithBias fc1 = expert.linear_fc1.forward(hidden_states);
  record_output_with_bias(taps, "linear_fc1", fc1, lead, p);
  Mat intermediate_parallel = fc1.output;
  if (fc1.bias) {
    intermediate_parallel.rowwise() += *fc1.bias;
    p.act_inplace(intermediate_parallel);  // rounds: intermediate_parallel + bias_parallel
  }
  if (expert.gated_linear_unit)
    intermediate_parallel = glu(expert.activation_func, intermediate_parallel, expert.glu_linear_offset,
                                expert.activation_func_clamp_value, p);
  else
    intermediate_parallel = apply_activation(expert.activation_func, intermediate_parallel, p);

  // intermediate_parallel * per_token_scale.unsqueeze(-1), then .to(original_dtype)
  for (Index t = 0; t < intermediate_parallel.rows(); ++t)
    for (Index j = 0; j < intermediate_parallel.cols(); ++j)
      intermediate_parallel(t, j) = rnd(act_dt, rnd(product_dt, intermediate_parallel(t, j) * per_token_scale[t]));

  // [n, h]
  OutputWithBias out = expert.linear_fc2.forward(intermediate_parallel);
  record_output_with_bias(taps, "linear_fc2", out, lead, p);
  if (out.bias) {
    // output += output_bias.unsqueeze(0) * per_token_scale.unsqueeze(-1); output_bias = None
    for (Index t = 0; t < out.output.rows(); ++t)
      for (Index j = 0; j < out.output.cols(); ++j)
        out.output(t, j) = rnd(act_dt, out.output(t, j) + rnd(product_dt, (*out.bias)[j] * per_token_scale[t]));
  }
  return out.output;
}

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
  const Rounding rnd = Rounding::of(p_);
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
    if (config_.moe_router_topk != 1)
      throw MoEError("`moe_apply_probs_on_input` only works with `moe_router_topk`=1.");
    const DType product_dt = probs_dtype_ == DType::F64 || p_.params_dtype == DType::F64 ? DType::F64
                             : probs_dtype_ == DType::F32 || p_.params_dtype == DType::F32 ? DType::F32
                                                                                           : p_.params_dtype;
    for (Index t = 0; t < hidden.rows(); ++t)
      for (Index j = 0; j < hidden.cols(); ++j)
        hidden(t, j) = rnd(p_.params_dtype, rnd(product_dt, permuted_probs[t] * hidden(t, j)));
    permuted_probs.assign(permuted_probs.size(), 1.0);  // probs already applied
  }

  // torch.split by tokens_per_expert; each expert on its slice; torch.cat.
  Mat output_local(hidden.rows(), hidden.cols());  // [N, h]
  const Taps local_taps = taps.child("local_experts");
  Index start = 0;
  for (std::size_t i = 0; i < local_experts.size(); ++i) {
    const Index n = tokens_per_expert[i];
    const Taps expert_taps = local_taps.child(std::to_string(i));
    const std::vector<double> probs(permuted_probs.begin() + start, permuted_probs.begin() + start + n);
    const Mat output = expert_mlp_forward(local_experts[i], hidden.middleRows(start, n), probs, probs_dtype_, p_,
                                          expert_taps);
    if (expert_taps.enabled()) expert_taps.record("0", p_.to_tensor(output, {n, output.cols()}));
    output_local.middleRows(start, n) = output;
    start += n;
  }
  if (taps.enabled()) taps.record("0", p_.to_tensor(output_local, {output_local.rows(), output_local.cols()}));
  return output_local;
}

}  // namespace twin::reference::moe
