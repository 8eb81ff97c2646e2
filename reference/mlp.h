// megatron/core/transformer/mlp.py: MLP (linear_fc1 -> activation -> linear_fc2).
// With bias_activation_fusion (and no per_token_scale) Megatron calls the fused functions, whose
// math differs from the unfused path and is mirrored as such:
//   gelu, no GLU:  bias_gelu_impl  (fusions/fused_bias_gelu.py):  tanh gelu of (y + bias),
//                  x * 0.5 * (1 + tanh(0.79788456 x (1 + 0.044715 x^2)))
//   gelu, GLU:     bias_geglu_impl (fused_bias_geglu.py): the same tanh gelu of the first half
//                  times the second half (no clamp, no glu_linear_offset)
//   silu, GLU:     bias_swiglu_impl (fused_bias_swiglu.py): silu(y1) * y2 (no clamp, no offset)
//   otherwise:     ValueError "Only support fusion of gelu and swiglu" (ConfigError here).
//
//   intermediate_parallel, bias_parallel = linear_fc1(hidden_states)   # [s, b, ffn (x2 GLU)]
//   intermediate_parallel = intermediate_parallel + bias_parallel      # if bias
//   intermediate_parallel = glu(...) if gated_linear_unit else activation_func(...)
//   output, output_bias = linear_fc2(intermediate_parallel)            # [s, b, h], bias separate
//
// Both linears have bias = add_bias_linear and skip_bias_add = True. Taps (relative to the
// module's prefix, e.g. "mlp."): linear_fc1.0, linear_fc1.1, linear_fc2.0, linear_fc2.1, then the
// module's own output 0 and 1 (".1" only when a bias exists, as the hooks drop None).
//
// MlpModule is the interface of the layer's `mlp` slot: the MoE layer implements it too.
//
// MLP's backward (the unfused path): linear_fc2's backward, the activation's or GLU's backward on
// the saved fc1 output (+ bias), linear_fc1's backward; both biases' grads are the column sums of
// the gradients where they are added. With per_token_scale (MoE experts) the product
// (act * scale).to(dtype) is differentiated first: d act = (d * scale).to(act dtype) and
// d scale = sum over the row of d * act, in the scale's (promoted) dtype. The fused
// bias-activation backward, and an fc2 bias together with per_token_scale, are not implemented
// (ConfigError).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "reference/activations.h"
#include "reference/linear.h"
#include "reference/precision.h"
#include "reference/state_dict.h"
#include "reference/taps.h"

namespace twin::reference {

struct MlpArgs {
  Shape lead;                                    // leading dims of the input for tap shapes: {s, b} or {tokens}
  const Tensor* padding_mask = nullptr;          // [b, s] True = padding (MoE only; MLP ignores it)
  const Tensor* recorded_routing_map = nullptr;  // MoE only: LayerInputs::recorded_routing_map
  bool training = false;
  // MLP.forward's per_token_scale (MoE experts: the routing probability of each row, [n], stored
  // in per_token_scale_dtype): multiplies the activation before linear_fc2; an fc2 bias is then
  // added scaled by it and returned as none.
  const std::vector<double>* per_token_scale = nullptr;
  DType per_token_scale_dtype = DType::F32;
};

class MlpModule {
 public:
  virtual ~MlpModule() = default;
  // hidden_states [n, h] -> (output [n, h], bias [h] or none). Records its taps under `taps`
  // (whose prefix is the module path, e.g. "mlp."), its own output last as "0" / "1".
  virtual OutputWithBias forward(const Mat& hidden_states, const MlpArgs& args, const Taps& taps) = 0;
  virtual void load_state_dict(const StateDict& sd, const std::string& prefix) = 0;
};

// Records a (output, bias) pair as <prefix>0 / <prefix>1 with shape lead + [cols] ("linear_fc1." or
// "" for the module's own output); o.output becomes the value to continue with (Taps::record).
void record_output_with_bias(const Taps& taps, const std::string& prefix, OutputWithBias& o, const Shape& lead,
                             const Precision& p);

// What MLP's backward needs from its forward.
struct MlpSaved {
  LinearSaved linear_fc1;
  Mat activation_input;   // [n, ffn (x2 GLU)]: fc1's output plus its bias
  Mat activation_output;  // [n, ffn]: the activation's output before per_token_scale (only with one)
  LinearSaved linear_fc2;
};

struct MlpGrads {
  Mat hidden_states;                    // [n, input_size]
  ParamGrads params;                    // relative to the module ("linear_fc1.weight", ...)
  std::vector<double> per_token_scale;  // [n] with MlpArgs::per_token_scale: its gradient, in its dtype
};

class MLP : public MlpModule {
 public:
  // input_size defaults to hidden_size, ffn_hidden_size to config.ffn_hidden_size (MoE experts
  // pass moe_ffn_hidden_size; SequentialMLP overrides config.ffn_hidden_size the same way, so
  // fc2's input is ffn_hidden_size in both).
  MLP(const TransformerConfig& config, Precision p, std::optional<int> input_size = std::nullopt,
      std::optional<int> ffn_hidden_size = std::nullopt);

  OutputWithBias forward(const Mat& hidden_states, const MlpArgs& args, const Taps& taps) override;
  // Without recording its own output (for callers that record it under another name).
  OutputWithBias forward_inner(const Mat& hidden_states, const MlpArgs& args, const Taps& taps,
                               MlpSaved* saved = nullptr) const;
  // The module's forward, filling `saved` (when given) for backward.
  OutputWithBias forward(const Mat& hidden_states, const MlpArgs& args, const Taps& taps, MlpSaved* saved);
  // doutput [n, h]: the gradient of linear_fc2's output (plus its bias). ConfigError for the
  // fused bias-activation and per_token_scale paths.
  // Consumes `saved`: each activation is released once the step that reads it has run.
  MlpGrads backward(const Mat& doutput, MlpSaved&& saved, const MlpArgs& args) const;
  void load_state_dict(const StateDict& sd, const std::string& prefix) override;

  Linear linear_fc1;  // [ffn (x2 GLU), input_size]
  Linear linear_fc2;  // [hidden, ffn]
  ActivationFunc activation_func;
  bool gated_linear_unit;
  double glu_linear_offset;
  std::optional<double> activation_func_clamp_value;
  bool bias_activation_fusion;

 private:
  Precision p_;
};

}  // namespace twin::reference
