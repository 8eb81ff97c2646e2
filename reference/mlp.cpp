#include "reference/mlp.h"

#include <cmath>

#include "core/progress.h"

namespace twin::reference {

void record_output_with_bias(const Taps& taps, const std::string& prefix, OutputWithBias& o, const Shape& lead,
                             const Precision& p) {
  if (!taps.enabled()) return;
  Shape shape = lead;
  shape.push_back(o.output.cols());
  o.output = taps.record(prefix + "0", o.output, shape, p);
  if (o.bias) taps.record_param(prefix + "1", p.to_tensor(*o.bias, {static_cast<std::int64_t>(o.bias->size())}));
}

static int fc1_out(const TransformerConfig& c, std::optional<int> ffn) {
  const int f = ffn.value_or(c.ffn());
  return c.gated_linear_unit ? 2 * f : f;  // GLU doubles fc1's output width
}

MLP::MLP(const TransformerConfig& config, Precision p, std::optional<int> input_size,
         std::optional<int> ffn_hidden_size)
    : linear_fc1(input_size.value_or(config.hidden_size), fc1_out(config, ffn_hidden_size), config.add_bias_linear,
                 /*skip_bias_add=*/true, p),
      linear_fc2(ffn_hidden_size.value_or(config.ffn()), config.hidden_size, config.add_bias_linear,
                 /*skip_bias_add=*/true, p),
      activation_func(activation_from_name(config.activation_func)),
      gated_linear_unit(config.gated_linear_unit),
      glu_linear_offset(config.glu_linear_offset),
      activation_func_clamp_value(config.activation_func_clamp_value),
      bias_activation_fusion(config.bias_activation_fusion),
      p_(p) {
  if (bias_activation_fusion) {
    const bool gelu = activation_func == ActivationFunc::Gelu, silu = activation_func == ActivationFunc::Silu;
    if (!(gelu || (silu && gated_linear_unit)))
      throw ConfigError("bias_activation_fusion: Only support fusion of gelu and swiglu (activation_func " +
                        std::string(activation_name(activation_func)) + ", gated_linear_unit " +
                        (gated_linear_unit ? "true" : "false") + ")");
    if (gelu && !gated_linear_unit && !config.add_bias_linear)
      throw ConfigError("bias_activation_fusion: the fused gelu requires add_bias_linear (bias_gelu_impl)");
  }
}

namespace {
// fused_bias_gelu.py bias_gelu / fused_bias_geglu.py geglu: the tanh form, one jit-fused store.
double tanh_gelu(double x) { return x * 0.5 * (1.0 + std::tanh(0.79788456 * x * (1 + 0.044715 * x * x))); }
}  // namespace

// The bias_activation_fusion branch of MLP.forward (no per_token_scale).
static Mat fused_bias_activation(const Mat& y_in, const std::optional<RowVec>& bias, ActivationFunc f, bool glu_unit,
                                 const Precision& p) {
  Mat y = y_in;
  if (bias) {
    y.rowwise() += *bias;
    p.act_inplace(y);  // rounds: y + bias
    p.count_act();
  }
  if (!glu_unit) {                                                                            // bias_gelu_impl
    for (Eigen::Index i = 0; i < y.size(); ++i) y.data()[i] = p.act(tanh_gelu(y.data()[i]));  // rounds: fused gelu
    p.count_act();
    return y;
  }
  const Eigen::Index half = y.cols() / 2;  // torch.chunk(y, 2, -1)
  Mat out(y.rows(), half);
  for (Eigen::Index r = 0; r < y.rows(); ++r)
    for (Eigen::Index c = 0; c < half; ++c) {
      const double y1 = y(r, c), y2 = y(r, c + half);
      const double a = f == ActivationFunc::Gelu ? p.act(tanh_gelu(y1))                // rounds: geglu's gelu
                                                 : p.act(y1 / (1.0 + std::exp(-y1)));  // rounds: F.silu(y_1)
      out(r, c) = p.act(a * y2);                                                       // rounds: * y_2
    }
  p.count_act(2);
  return out;
}

void MLP::load_state_dict(const StateDict& sd, const std::string& prefix) {
  linear_fc1.load_state_dict(sd, prefix + "linear_fc1.");
  linear_fc2.load_state_dict(sd, prefix + "linear_fc2.");
}

OutputWithBias MLP::forward_inner(const Mat& hidden_states, const MlpArgs& args, const Taps& taps,
                                  MlpSaved* saved) const {
  // [s, b, 4 * h/p]
  OutputWithBias fc1 = linear_fc1.forward(hidden_states, saved ? &saved->linear_fc1 : nullptr);
  record_output_with_bias(taps, "linear_fc1.", fc1, args.lead, p_);
  Mat intermediate_parallel = std::move(fc1.output);  // fc1's output is not read again
  bool weighted_fused = false;                        // the fused weighted swiglu already applied per_token_scale
  if (bias_activation_fusion && args.per_token_scale) {
    // weighted_bias_swiglu_impl: weighted_swiglu(y, w) = (swiglu(y) * w).to(y.dtype)
    if (!(activation_func == ActivationFunc::Silu && gated_linear_unit))
      throw ConfigError(
          "MLP: bias_activation_fusion with per_token_scale is mirrored for swiglu only "
          "(weighted_bias_quick_geglu_impl is not)");
    if (fc1.bias) throw ConfigError("MLP: Bias is not supported for weighted swiglu fusion");
    if (static_cast<Eigen::Index>(args.per_token_scale->size()) != intermediate_parallel.rows())
      throw ShapeError("MLP: per_token_scale has " + std::to_string(args.per_token_scale->size()) + " entries for " +
                       std::to_string(intermediate_parallel.rows()) + " rows");
    const bool scale_fp32 = args.per_token_scale_dtype == DType::F32 || args.per_token_scale_dtype == DType::F64;
    Mat sw = fused_bias_activation(intermediate_parallel, std::nullopt, activation_func, true, p_);
    for (Eigen::Index t = 0; t < sw.rows(); ++t)
      for (Eigen::Index j = 0; j < sw.cols(); ++j) {
        const double prod = sw(t, j) * (*args.per_token_scale)[t];
        sw(t, j) = p_.act(scale_fp32 ? p_.f32(prod) : p_.act(prod));  // rounds: promoted product, .to(dtype)
      }
    if (scale_fp32) p_.count_f32();
    p_.count_act();
    intermediate_parallel = sw;
    weighted_fused = true;
  } else if (bias_activation_fusion) {
    intermediate_parallel =
        fused_bias_activation(intermediate_parallel, fc1.bias, activation_func, gated_linear_unit, p_);
  } else if (fc1.bias) {
    intermediate_parallel.rowwise() += *fc1.bias;
    p_.act_inplace(intermediate_parallel);  // rounds: intermediate_parallel + bias_parallel
    p_.count_act();
  }
  if (saved && !bias_activation_fusion) saved->activation_input = intermediate_parallel;
  if (bias_activation_fusion) {
    // done above
  } else if (gated_linear_unit)
    intermediate_parallel =
        glu(activation_func, intermediate_parallel, glu_linear_offset, activation_func_clamp_value, p_);
  else
    intermediate_parallel = apply_activation(activation_func, intermediate_parallel, p_);
  const std::vector<double>* per_token_scale = args.per_token_scale;
  if (saved && per_token_scale) saved->activation_output = intermediate_parallel;
  if (per_token_scale && !weighted_fused) {
    if (static_cast<Eigen::Index>(per_token_scale->size()) != intermediate_parallel.rows())
      throw ShapeError("MLP: per_token_scale has " + std::to_string(per_token_scale->size()) + " entries for " +
                       std::to_string(intermediate_parallel.rows()) + " rows");
    for (Eigen::Index t = 0; t < intermediate_parallel.rows(); ++t)
      for (Eigen::Index j = 0; j < intermediate_parallel.cols(); ++j)  // rounds: (x * scale).to(original_dtype)
        intermediate_parallel(t, j) = p_.act(intermediate_parallel(t, j) * (*per_token_scale)[t]);
    p_.count_act();
  }

  // [s, b, h]
  OutputWithBias out = linear_fc2.forward(intermediate_parallel, saved ? &saved->linear_fc2 : nullptr);
  record_output_with_bias(taps, "linear_fc2.", out, args.lead, p_);
  if (per_token_scale && out.bias) {
    // output += output_bias.unsqueeze(0) * per_token_scale.unsqueeze(-1); output_bias = None.
    // The product is stored in the promoted dtype (fp32 scale: fp32), the sum in the output's.
    const bool scale_fp32 = args.per_token_scale_dtype == DType::F32 || args.per_token_scale_dtype == DType::F64;
    for (Eigen::Index t = 0; t < out.output.rows(); ++t)
      for (Eigen::Index j = 0; j < out.output.cols(); ++j) {
        const double b = (*out.bias)[j] * (*per_token_scale)[t];
        out.output(t, j) = p_.act(out.output(t, j) + (scale_fp32 ? p_.f32(b) : p_.act(b)));  // rounds: product, sum
      }
    p_.count_act();  // the sum (the product is a parallel branch from parameters and scales)
    out.bias.reset();
  }
  return out;
}

OutputWithBias MLP::forward(const Mat& hidden_states, const MlpArgs& args, const Taps& taps) {
  return forward(hidden_states, args, taps, nullptr);
}

OutputWithBias MLP::forward(const Mat& hidden_states, const MlpArgs& args, const Taps& taps, MlpSaved* saved) {
  OutputWithBias out = forward_inner(hidden_states, args, taps, saved);
  record_output_with_bias(taps, "", out, args.lead, p_);  // the module's own output: "0", "1"
  return out;
}

MlpGrads MLP::backward(const Mat& doutput, MlpSaved&& saved, const MlpArgs& args) const {
  if (bias_activation_fusion)
    throw ConfigError("MLP backward: the fused bias-activation's backward is not implemented");
  const std::vector<double>* scale = args.per_token_scale;
  if (scale && linear_fc2.has_bias())
    throw ConfigError("MLP backward: an fc2 bias with per_token_scale (output += bias * scale) is not implemented");
  MlpGrads g;
  progress::now("linear_fc2");
  LinearGrads fc2 = linear_fc2.backward(doutput, saved.linear_fc2);
  Mat dact = std::move(fc2.input);  // [n, ffn]
  saved.linear_fc2 = {};
  if (scale) {
    const Mat& act = saved.activation_output;
    if (static_cast<Eigen::Index>(scale->size()) != dact.rows() || act.rows() != dact.rows() ||
        act.cols() != dact.cols())
      throw ShapeError("MLP backward: per_token_scale has " + std::to_string(scale->size()) +
                       " entries, the saved activation [" + std::to_string(act.rows()) + ", " +
                       std::to_string(act.cols()) + "], the gradient [" + std::to_string(dact.rows()) + ", " +
                       std::to_string(dact.cols()) + "]");
    // (act * scale).to(dtype): the product is in the promoted dtype (fp32 for an fp32 / fp64 scale).
    const bool scale_fp32 = args.per_token_scale_dtype == DType::F32 || args.per_token_scale_dtype == DType::F64;
    auto rnd_scale = [&](double v) {
      if (p_.exact() || args.per_token_scale_dtype == DType::F64) return v;
      return scale_fp32 ? p_.f32(v) : p_.act(v);
    };
    g.per_token_scale.assign(scale->size(), 0.0);
    for (Eigen::Index t = 0; t < dact.rows(); ++t) {
      double ds = 0.0;
      for (Eigen::Index j = 0; j < dact.cols(); ++j) {
        ds += dact(t, j) * act(t, j);
        dact(t, j) = p_.act(dact(t, j) * (*scale)[t]);  // rounds: grad * scale, stored in the activation dtype
      }
      g.per_token_scale[t] = rnd_scale(ds);  // rounds: (grad * act).sum(-1), stored in the scale's dtype
    }
    p_.count_act();
    p_.count_reduce(dact.cols());
    p_.count_store(scale_fp32 ? DType::F32 : p_.params_dtype);
    saved.activation_output = Mat();
  }
  dact = gated_linear_unit ? glu_backward(activation_func, saved.activation_input, dact, glu_linear_offset,
                                          activation_func_clamp_value, p_)
                           : activation_backward(activation_func, saved.activation_input, dact, p_);
  saved.activation_input = Mat();
  progress::now("linear_fc1");
  const LinearGrads fc1 = linear_fc1.backward(dact, saved.linear_fc1);  // its bias: the column sums of dact
  g.hidden_states = fc1.input;
  add_param_grads(g.params, "linear_fc1.", fc1);
  add_param_grads(g.params, "linear_fc2.", fc2);
  return g;
}

}  // namespace twin::reference
