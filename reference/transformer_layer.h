// megatron/core/transformer/transformer_layer.py: TransformerLayerSubmodules, BaseTransformerLayer,
// TransformerLayer; spec_utils.py ModuleSpec / build_module; identity_op.py IdentityOp /
// IdentityFuncOp; models/gpt/gpt_layer_specs.py get_gpt_layer_local_spec.
//
// A spec decides which modules exist. Each submodule slot holds a builder (the ModuleSpec); an
// EMPTY builder is IdentityOp (norms, attentions, mlp: the input passes through unchanged) or
// IdentityFuncOp (bda slots: the function returns its first argument's output and discards the
// bias and the residual), exactly as Megatron's defaults.
//
// forward(hidden_states [s, b, h], ...) -> (hidden_states, context):
//   _forward_attention:
//     residual = hidden_states
//     input_layernorm_output = input_layernorm(hidden_states)                 tap input_layernorm
//     attention_output_with_bias = self_attention(input_layernorm_output,     taps self_attention.*
//         attention_mask, rotary_pos_emb)
//     hidden_states = self_attn_bda(training, fused)(attention_output_with_bias, residual, hidden_dropout)
//     residual = hidden_states
//     pre_cross_attn_layernorm_output = pre_cross_attn_layernorm(hidden_states) tap pre_cross_attn_layernorm
//     attention_output_with_bias = cross_attention(..., attention_mask=context_mask,
//         key_value_states=context)                                            taps cross_attention.*
//     context = attention_output_with_bias.context if the module returns one (Retro)
//     hidden_states = cross_attn_bda(...)(attention_output_with_bias, residual, hidden_dropout)
//   _forward_mlp:
//     residual = hidden_states
//     pre_mlp_layernorm_output = pre_mlp_layernorm(hidden_states)             tap pre_mlp_layernorm
//     mlp_output_with_bias = mlp(pre_mlp_layernorm_output, padding_mask)      taps mlp.*
//     _forward_post_mlp: hidden_states = mlp_bda(...)(mlp_output_with_bias, residual, hidden_dropout)
//
// Config flags the layer does NOT read at this Megatron commit (mirrored, not guessed):
//   apply_residual_connection_post_layernorm: only a TransformerConfig field; Megatron-Core's
//     TransformerLayer always takes the residual before the norm. The reference does the same.
//   fp32_residual_connection: read by the embedding (which hands the layer fp32 hidden states),
//     not by the layer; the residual keeps the input's values and bias_dropout_add casts it to
//     x.dtype (residual.to(x.dtype)), as Megatron's does.
//
// Dropout streams (philox.h): with DropoutRng {seed, offset} on the layer, each call draws at
//   rng.at(DropoutSite::...) (core/dropout_site.h: self-attention core_attention, self_attn_bda,
//   cross-attention core_attention, cross_attn_bda, mlp_bda); a block's layer i at block_layer_offset.
//
// Plugging in (MoE, Retro): set the slot's builder in the spec. `mlp` takes any MlpModule (an
// MoELayer returns (output, bias) and records its taps under "mlp."); `cross_attention` takes any
// AttentionModule (a dict-style output puts "context" in AttentionOutput::context and its payload
// in ::extra); the bda slots take any BdaBuilder (Retro's bda reads ::extra).
//
// Backward (SelfAttention, MLP, torch norms, get_bias_dropout_add's bda or IdentityFuncOp, and
// a cross-attention with CrossAttentionBackward): forward(..., &saved) runs the forward and keeps every
// activation the backward needs in one TransformerLayerSaved; backward(grad_output, saved) runs
// the forward's steps in reverse:
//   mlp_bda:  d residual = d out; d mlp output = dropout's backward (the forward's mask)
//   mlp, pre_mlp_layernorm backward; d hidden = d norm input + d residual (autograd's sum of the
//     two uses of hidden_states, stored in the activation dtype)
//   self_attn_bda, self_attention, input_layernorm the same way -> d hidden_states (input).
//   A cross-attention slot (Retro's decoder / encoder cross-attention) runs its backward together
//   with its bda's (CrossAttentionBackward, attention.h), between the two: d of the hidden states
//   after cross_attn_bda -> d of the module's input -> pre_cross_attn_layernorm backward, summed
//   with the residual's gradient when the bda reads the residual (Retro's encoder bda does not).
//   The context: backward's grad_context is the gradient of the context forward returned; a
//   layer whose cross-attention returns no context passes the context through (d context in =
//   d context out), one that returns one hands grad_context to the module. TransformerLayerGrads::
//   context is the gradient of inputs.context (none when the layer had no context).
// Each parameter's gradient is listed under its state_dict key. The mlp slot's forward-with-saving
// and backward are virtual (forward_mlp_saving, backward_mlp, mlp_backward_unsupported): a subclass
// with another module there (MoETransformerLayer's MoELayer) supplies its own and keeps what its
// backward needs in TransformerLayerSaved::mlp_module. A layer with a module that has no backward
// (a cross-attention without CrossAttentionBackward) throws std::logic_error naming it from forward
// with `saved`, before computing anything.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/config.h"
#include "core/tensor.h"
#include "reference/attention.h"
#include "reference/multi_latent_attention.h"
#include "reference/fused_bias_dropout.h"
#include "reference/mlp.h"
#include "reference/philox.h"
#include "reference/precision.h"
#include "reference/state_dict.h"
#include "reference/taps.h"
#include "reference/torch_norm.h"

namespace twin::reference {

// ---- ModuleSpec builders (an empty builder is IdentityOp / IdentityFuncOp) ----------------------
using NormBuilder =
    std::function<std::unique_ptr<Norm>(const TransformerConfig&, int hidden_size, double eps, Precision)>;
using AttentionBuilder =
    std::function<std::unique_ptr<AttentionModule>(const TransformerConfig&, int layer_number, Precision)>;
using MlpBuilder = std::function<std::unique_ptr<MlpModule>(const TransformerConfig&, int layer_number, Precision)>;
// bias-dropout-add: bda(x_with_bias, residual, prob) -> hidden_states
using BdaFunc = std::function<Mat(const AttentionOutput& x_with_bias, const Mat& residual, double prob)>;
// get_bias_dropout_add(training, fused) with the call's dropout stream and the precision policy
using BdaBuilder = std::function<BdaFunc(bool training, bool fused, DropoutRng rng, Precision p)>;

// The builders Megatron's local spec names.
NormBuilder wrapped_torch_norm_builder();  // WrappedTorchNorm (LayerNorm / RMSNorm by config)
NormBuilder l2_norm_builder();             // L2Norm (qk_l2_norm)
AttentionBuilder self_attention_builder(const SelfAttentionSubmodules& submodules,
                                        AttnMaskType attn_mask_type = AttnMaskType::causal);
AttentionBuilder mla_self_attention_builder(const MLASelfAttentionSubmodules& submodules,
                                            AttnMaskType attn_mask_type = AttnMaskType::causal);
AttentionBuilder cross_attention_builder(AttnMaskType attn_mask_type = AttnMaskType::padding);
MlpBuilder mlp_builder();           // MLP with ColumnParallelLinear / RowParallelLinear
BdaBuilder get_bias_dropout_add();  // fused_bias_dropout.py

struct TransformerLayerSubmodules {
  NormBuilder input_layernorm;      // IdentityOp
  AttentionBuilder self_attention;  // IdentityOp
  BdaBuilder self_attn_bda;         // IdentityFuncOp

  NormBuilder pre_cross_attn_layernorm;  // IdentityOp
  AttentionBuilder cross_attention;      // IdentityOp
  BdaBuilder cross_attn_bda;             // IdentityFuncOp

  NormBuilder pre_mlp_layernorm;  // IdentityOp
  MlpBuilder mlp;                 // IdentityOp
  BdaBuilder mlp_bda;             // IdentityFuncOp

  // Mapping for sharded tensor keys (kept for the spec's shape; the reference has no checkpoints)
  std::map<std::string, std::string> sharded_state_dict_keys_map;
};

// A common parent of TransformerLayer-like layers: a block fans a spec whose module is one of
// these out over all its layers (transformer_block.py _get_block_submodules).
class BaseTransformerLayer {
 public:
  virtual ~BaseTransformerLayer() = default;
};

class TransformerLayer;
// ModuleSpec(module=TransformerLayer, submodules=...): `module` builds the layer.
struct ModuleSpec {
  std::function<std::unique_ptr<BaseTransformerLayer>(const TransformerConfig&, const TransformerLayerSubmodules&,
                                                      int layer_number, Precision)>
      module;
  TransformerLayerSubmodules submodules;
  // build_module(spec, config, layer_number)
  std::unique_ptr<BaseTransformerLayer> build(const TransformerConfig& config, int layer_number, Precision p) const;
};

// get_gpt_layer_local_spec(num_experts=None, qk_layernorm, normalization, qk_l2_norm).
// normalization "RMSNorm" or anything else (LayerNorm: Megatron's else-branch); both resolve to
// WrappedTorchNorm, which reads config.normalization when built. num_experts must be unset here:
// the MoE spec puts an MoELayer builder into submodules.mlp (reference/moe).
// attn_mask_type is the self_attention ModuleSpec's params={"attn_mask_type": causal}; a caller
// may override that param as a ModuleSpec allows (the fixtures record it as config.attn_mask_type).
// multi_latent_attention: self_attention is an MLASelfAttention, its q / kv layernorms the qk
// norm under qk_layernorm (IdentityOp otherwise), as Megatron's spec builds it.
ModuleSpec get_gpt_layer_local_spec(std::optional<int> num_experts = std::nullopt, bool qk_layernorm = false,
                                    const std::string& normalization = "LayerNorm", bool qk_l2_norm = false,
                                    AttnMaskType attn_mask_type = AttnMaskType::causal,
                                    bool multi_latent_attention = false);

// forward's keyword arguments (all optional).
struct LayerInputs {
  const Tensor* attention_mask = nullptr;  // BOOL [b, 1, s, s], True = masked; replaces the causal mask
  const Tensor* context = nullptr;         // cross-attention key_value_states
  const Tensor* context_mask = nullptr;
  const Tensor* rotary_pos_emb = nullptr;  // [s, 1, 1, rot_dim] angles
  const Tensor* padding_mask = nullptr;    // MoE [b, s], True = padding
  // MoE: BOOL [T, E], Megatron's routing map from a golden (TopKRouter::forward): with capacity
  // dropping the post-drop map where torch.topk's order among tied values decides which tokens an
  // expert drops (checked to be a valid outcome); without, the top-k choice itself.
  const Tensor* recorded_routing_map = nullptr;
};

// What another module in the mlp slot keeps for its backward (a subclass's own type).
struct MlpModuleSaved {
  virtual ~MlpModuleSaved() = default;
};

// Every activation TransformerLayer's backward reads, saved by forward(..., &saved).
struct TransformerLayerSaved {
  int s = 0, b = 0;
  // The forward's masks and RoPE angles (pointers: the caller's tensors, which must outlive backward;
  // backward does not read inputs.context, whose shape is context_shape).
  LayerInputs inputs;
  Mat hidden_states;                  // [s*b, h] the layer's input (input_layernorm's input, first residual)
  SelfAttentionSaved self_attention;  // linear_qkv / linear_proj inputs, q, k, v, q/k layernorm inputs, RoPE angles
  MLASelfAttentionSaved mla_self_attention;    // instead, for an MLASelfAttention
  Mat pre_cross_attn_layernorm_input;          // [s*b, h] hidden_states after self_attn_bda (the second residual)
  std::shared_ptr<void> cross_attention;       // the cross-attention module's own saved activations
  bool cross_attention_context = false;        // the cross-attention returned a context (Retro decoder)
  std::optional<Shape> context_shape;          // inputs.context's shape, when there was one
  Mat pre_mlp_layernorm_input;                 // [s*b, h] hidden_states after cross_attn_bda (the last residual)
  MlpSaved mlp;                                // linear_fc1 / linear_fc2 inputs, the activation's input
  std::shared_ptr<MlpModuleSaved> mlp_module;  // instead of `mlp` for another module (MoE)
};

struct TransformerLayerGrads {
  Tensor hidden_states;           // [s, b, h] in the activation dtype (F64 in Exact mode)
  std::optional<Tensor> context;  // d inputs.context, its shape, when the layer had a context
  ParamGrads params;              // by full state_dict key ("self_attention.linear_qkv.weight", ...)
};

class TransformerLayer : public BaseTransformerLayer {
 public:
  TransformerLayer(const TransformerConfig& config, const TransformerLayerSubmodules& submodules, int layer_number = 1,
                   std::optional<double> hidden_dropout = std::nullopt, Precision precision = Precision{});

  // Loads every parameter by its state_dict key ("self_attention.linear_qkv.weight", ...).
  // Strict: a missing key, a wrong shape (naming expected and actual) or a key the spec does not
  // own throws ShapeError.
  void load_state_dict(const StateDict& sd);
  void load_state_dict(const std::map<std::string, Tensor>& sd);

  // hidden_states [s, b, h] -> (output [s, b, h] in the activation dtype, context or none).
  // ShapeError for hidden_states not [s, b, hidden_size], a bad mask or rotary_pos_emb.
  std::pair<Tensor, std::optional<Tensor>> forward(const Tensor& hidden_states, const LayerInputs& inputs = {},
                                                   const Taps& taps = {});
  // The same, keeping what backward needs in `saved`. std::logic_error for a layer with no backward
  // (see above).
  std::pair<Tensor, std::optional<Tensor>> forward(const Tensor& hidden_states, const LayerInputs& inputs,
                                                   const Taps& taps, TransformerLayerSaved* saved);
  // grad_output [s, b, h] (the gradient of forward's output) and grad_context (of the context it
  // returned; nullptr: none) -> gradients of the inputs and of every parameter. ShapeError for
  // grad_output or grad_context of another shape than the saved forward's output / context.
  // Consumes `saved`: each module's activations are released as soon as its backward has run (a
  // real-size layer's saved activations are as large as its weights). After an error `saved` may be
  // partly consumed: run forward again.
  TransformerLayerGrads backward(const Tensor& grad_output, TransformerLayerSaved&& saved,
                                 const Tensor* grad_context = nullptr) const;
  // Whether backward supports this layer's modules (else the reason, e.g. "mlp is not an MLP").
  std::optional<std::string> backward_unsupported() const;
  // The mlp slot's part of the three above: the module's forward keeping what its backward needs in
  // `saved`, its backward from the gradient of its output (params relative to "mlp."), and why it
  // has none. TransformerLayer's: an MLP.
  virtual OutputWithBias forward_mlp_saving(const Mat& hidden_states, const MlpArgs& args, const Taps& taps,
                                            TransformerLayerSaved& saved);
  virtual MlpGrads backward_mlp(const Mat& doutput, TransformerLayerSaved& saved, const MlpArgs& args) const;
  virtual std::optional<std::string> mlp_backward_unsupported() const;

  // The steps of forward on (s * b) x h matrices.
  std::pair<Mat, std::optional<Tensor>> _forward_attention(const Mat& hidden_states, int s, int b,
                                                           const LayerInputs& inputs, const Taps& taps);
  Mat _forward_pre_mlp_layernorm(const Mat& hidden_states, int s, int b, const Taps& taps);
  Mat _forward_mlp(const Mat& hidden_states, int s, int b, const LayerInputs& inputs, const Taps& taps);
  // residual_rounding: the rounding points counted before the residual was taken.
  Mat _forward_post_mlp(const OutputWithBias& mlp_output_with_bias, const Mat& residual,
                        const RoundingCount& residual_rounding = {});

  // Megatron's get_layer_norm_weights returns None at this commit: so does this (nullopt).
  std::optional<std::vector<RowVec>> get_layer_norm_weights() const;
  // The weight of the norm feeding linear_fc1 / linear_qkv. TE specs fuse it into the linear
  // (layer_norm_weight); in the local spec it is pre_mlp_layernorm / input_layernorm's weight.
  // std::logic_error when that norm is an IdentityOp or has no weight.
  RowVec get_mlp_layer_norm_weights() const;
  RowVec get_qkv_layer_norm_weights() const;

  const TransformerConfig config;
  const int layer_number;
  const double hidden_dropout;
  const Precision precision;
  bool training = false;
  DropoutRng rng;

  std::unique_ptr<Norm> input_layernorm;  // null: IdentityOp
  std::unique_ptr<AttentionModule> self_attention;
  BdaBuilder self_attn_bda;  // empty: IdentityFuncOp
  std::unique_ptr<Norm> pre_cross_attn_layernorm;
  std::unique_ptr<AttentionModule> cross_attention;
  BdaBuilder cross_attn_bda;
  std::unique_ptr<Norm> pre_mlp_layernorm;
  std::unique_ptr<MlpModule> mlp;
  BdaBuilder mlp_bda;
  const TransformerLayerSubmodules submodules_config;

 private:
  Mat apply_norm(const std::unique_ptr<Norm>& norm, const Mat& x, const std::string& name, int s, int b,
                 const Taps& taps) const;
  Mat apply_bda(const BdaBuilder& bda, const AttentionOutput& x_with_bias, const Mat& residual,
                const RoundingCount& residual_rounding, DropoutSite site) const;
  TransformerLayerSaved* saving_ = nullptr;  // set while forward(..., saved) runs
};

}  // namespace twin::reference
