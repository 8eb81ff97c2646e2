#include "reference/mlp.h"

namespace twin::reference {

void record_output_with_bias(const Taps& taps, const std::string& name, const OutputWithBias& o,
                             const Shape& lead, const Precision& p) {
  if (!taps.enabled()) return;
  Shape shape = lead;
  shape.push_back(o.output.cols());
  taps.record(name + ".0", p.to_tensor(o.output, shape));
  if (o.bias) taps.record(name + ".1", p.to_tensor(*o.bias, {static_cast<std::int64_t>(o.bias->size())}));
}

static int fc1_out(const TransformerConfig& c, std::optional<int> ffn) {
  const int f = ffn.value_or(c.ffn());
  return c.gated_linear_unit ? 2 * f : f;  // GLU doubles fc1's output width
}

MLP::MLP(const TransformerConfig& config, Precision p, std::optional<int> input_size,
         std::optional<int> ffn_hidden_size)
    : linear_fc1(input_size.value_or(config.hidden_size), fc1_out(config, ffn_hidden_size),
                 config.add_bias_linear, /*skip_bias_add=*/true, p),
      linear_fc2(ffn_hidden_size.value_or(config.ffn()), config.hidden_size, config.add_bias_linear,
                 /*skip_bias_add=*/true, p),
      activation_func(activation_from_name(config.activation_func)),
      gated_linear_unit(config.gated_linear_unit),
      glu_linear_offset(config.glu_linear_offset),
      activation_func_clamp_value(config.activation_func_clamp_value),
      p_(p) {}

void MLP::load_state_dict(const StateDict& sd, const std::string& prefix) {
  linear_fc1.load_state_dict(sd, prefix + "linear_fc1.");
  linear_fc2.load_state_dict(sd, prefix + "linear_fc2.");
}

OutputWithBias MLP::forward_inner(const Mat& hidden_states, const MlpArgs& args, const Taps& taps) const {
  // [s, b, 4 * h/p]
  OutputWithBias fc1 = linear_fc1.forward(hidden_states);
  record_output_with_bias(taps, "linear_fc1", fc1, args.lead, p_);
  Mat intermediate_parallel = fc1.output;
  if (fc1.bias) {
    intermediate_parallel.rowwise() += *fc1.bias;
    p_.act_inplace(intermediate_parallel);  // rounds: intermediate_parallel + bias_parallel
  }
  if (gated_linear_unit)
    intermediate_parallel =
        glu(activation_func, intermediate_parallel, glu_linear_offset, activation_func_clamp_value, p_);
  else
    intermediate_parallel = apply_activation(activation_func, intermediate_parallel, p_);
  const std::vector<double>* per_token_scale = args.per_token_scale;
  if (per_token_scale) {
    if (static_cast<Eigen::Index>(per_token_scale->size()) != intermediate_parallel.rows())
      throw ShapeError("MLP: per_token_scale has " + std::to_string(per_token_scale->size()) + " entries for " +
                       std::to_string(intermediate_parallel.rows()) + " rows");
    for (Eigen::Index t = 0; t < intermediate_parallel.rows(); ++t)
      for (Eigen::Index j = 0; j < intermediate_parallel.cols(); ++j)  // rounds: (x * scale).to(original_dtype)
        intermediate_parallel(t, j) = p_.act(intermediate_parallel(t, j) * (*per_token_scale)[t]);
  }

  // [s, b, h]
  OutputWithBias out = linear_fc2.forward(intermediate_parallel);
  record_output_with_bias(taps, "linear_fc2", out, args.lead, p_);
  if (per_token_scale && out.bias) {
    // output += output_bias.unsqueeze(0) * per_token_scale.unsqueeze(-1); output_bias = None.
    // The product is stored in the promoted dtype (fp32 scale: fp32), the sum in the output's.
    const bool scale_fp32 = args.per_token_scale_dtype == DType::F32 || args.per_token_scale_dtype == DType::F64;
    for (Eigen::Index t = 0; t < out.output.rows(); ++t)
      for (Eigen::Index j = 0; j < out.output.cols(); ++j) {
        const double b = (*out.bias)[j] * (*per_token_scale)[t];
        out.output(t, j) = p_.act(out.output(t, j) + (scale_fp32 ? p_.f32(b) : p_.act(b)));  // rounds: product, sum
      }
    out.bias.reset();
  }
  return out;
}

OutputWithBias MLP::forward(const Mat& hidden_states, const MlpArgs& args, const Taps& taps) {
  OutputWithBias out = forward_inner(hidden_states, args, taps);
  if (taps.enabled()) {
    Shape shape = args.lead;
    shape.push_back(out.output.cols());
    taps.record("0", p_.to_tensor(out.output, shape));
    if (out.bias) taps.record("1", p_.to_tensor(*out.bias, {static_cast<std::int64_t>(out.bias->size())}));
  }
  return out;
}

}  // namespace twin::reference
