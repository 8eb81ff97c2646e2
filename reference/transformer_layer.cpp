#include "reference/transformer_layer.h"

#include <stdexcept>

#include "core/progress.h"
#include "reference/transformer_layer_offset.h"

namespace twin::reference {

// ---- builders of the local spec ---------------------------------------------------------------
NormBuilder wrapped_torch_norm_builder() {
  return [](const TransformerConfig& c, int hidden, double eps, Precision p) {
    return wrapped_torch_norm(c, hidden, eps, p);
  };
}
NormBuilder l2_norm_builder() {
  return [](const TransformerConfig&, int hidden, double eps, Precision p) -> std::unique_ptr<Norm> {
    return std::make_unique<L2Norm>(hidden, eps, p);
  };
}
AttentionBuilder self_attention_builder(const SelfAttentionSubmodules& submodules, AttnMaskType attn_mask_type) {
  return [submodules, attn_mask_type](const TransformerConfig& c, int layer_number,
                                      Precision p) -> std::unique_ptr<AttentionModule> {
    return std::make_unique<SelfAttention>(c, submodules, layer_number, attn_mask_type, p);
  };
}
AttentionBuilder mla_self_attention_builder(const MLASelfAttentionSubmodules& submodules, AttnMaskType attn_mask_type) {
  return [submodules, attn_mask_type](const TransformerConfig& c, int layer_number,
                                      Precision p) -> std::unique_ptr<AttentionModule> {
    return std::make_unique<MLASelfAttention>(c, submodules, layer_number, attn_mask_type, p);
  };
}
AttentionBuilder cross_attention_builder(AttnMaskType attn_mask_type) {
  return
      [attn_mask_type](const TransformerConfig& c, int layer_number, Precision p) -> std::unique_ptr<AttentionModule> {
        return std::make_unique<CrossAttention>(c, layer_number, attn_mask_type, p);
      };
}
MlpBuilder mlp_builder() {
  return [](const TransformerConfig& c, int, Precision p) -> std::unique_ptr<MlpModule> {
    return std::make_unique<MLP>(c, p);
  };
}
BdaBuilder get_bias_dropout_add() {
  return [](bool training, bool /*fused: same math*/, DropoutRng rng, Precision p) -> BdaFunc {
    return [training, rng, p](const AttentionOutput& x_with_bias, const Mat& residual, double prob) {
      return bias_dropout_add(x_with_bias.output, x_with_bias.bias, residual, prob, training, rng, p);
    };
  };
}

std::unique_ptr<BaseTransformerLayer> ModuleSpec::build(const TransformerConfig& config, int layer_number,
                                                        Precision p) const {
  if (!module) throw std::logic_error("ModuleSpec: no module to build");
  return module(config, submodules, layer_number, p);
}

ModuleSpec get_gpt_layer_local_spec(std::optional<int> num_experts, bool qk_layernorm, const std::string& normalization,
                                    bool qk_l2_norm, AttnMaskType attn_mask_type, bool multi_latent_attention) {
  if (num_experts)
    throw std::invalid_argument(
        "get_gpt_layer_local_spec: num_experts is set; the MoE spec (reference/moe) "
        "provides the MoELayer for submodules.mlp");
  // LocalSpecProvider.layer_norm(rms_norm=...) is WrappedTorchNorm either way (it reads
  // config.normalization when built); `normalization` only picks Megatron's branch.
  (void)normalization;
  const NormBuilder layer_norm = wrapped_torch_norm_builder();
  const NormBuilder qk_norm = wrapped_torch_norm_builder();
  SelfAttentionSubmodules attn;
  attn.q_layernorm = qk_l2_norm ? l2_norm_builder() : (qk_layernorm ? qk_norm : NormBuilder());
  attn.k_layernorm = qk_l2_norm ? l2_norm_builder() : (qk_layernorm ? qk_norm : NormBuilder());

  ModuleSpec spec;
  spec.module = [](const TransformerConfig& c, const TransformerLayerSubmodules& s, int layer_number,
                   Precision p) -> std::unique_ptr<BaseTransformerLayer> {
    return std::make_unique<TransformerLayer>(c, s, layer_number, std::nullopt, p);
  };
  spec.submodules.input_layernorm = layer_norm;
  if (multi_latent_attention) {
    MLASelfAttentionSubmodules mla;
    mla.q_layernorm = qk_layernorm ? qk_norm : NormBuilder();
    mla.kv_layernorm = qk_layernorm ? qk_norm : NormBuilder();
    spec.submodules.self_attention = mla_self_attention_builder(mla, attn_mask_type);
  } else {
    spec.submodules.self_attention = self_attention_builder(attn, attn_mask_type);
  }
  spec.submodules.self_attn_bda = get_bias_dropout_add();
  spec.submodules.pre_mlp_layernorm = layer_norm;
  spec.submodules.mlp = mlp_builder();
  spec.submodules.mlp_bda = get_bias_dropout_add();
  return spec;
}

// ---- TransformerLayer -------------------------------------------------------------------------
TransformerLayer::TransformerLayer(const TransformerConfig& config_, const TransformerLayerSubmodules& submodules,
                                   int layer_number_, std::optional<double> hidden_dropout_, Precision precision_)
    : config(config_),
      // layer_number + get_transformer_layer_offset(config, vp_stage, pp rank 0): the twins run world size 1
      layer_number(layer_number_ + static_cast<int>(get_transformer_layer_offset(config_, std::nullopt, 0))),
      hidden_dropout(hidden_dropout_.value_or(config_.hidden_dropout)),
      precision(precision_),
      submodules_config(submodules) {
  if (config.hidden_size <= 0)
    throw ConfigError("hidden_size must be positive, got " + std::to_string(config.hidden_size));
  const double eps = config.layernorm_epsilon;
  // [Module 1: Input Layernorm]
  if (submodules.input_layernorm)
    input_layernorm = submodules.input_layernorm(config, config.hidden_size, eps, precision);
  // [Module 2: SelfAttention]
  if (submodules.self_attention) self_attention = submodules.self_attention(config, layer_number, precision);
  // [Module 3: BiasDropoutFusion]
  self_attn_bda = submodules.self_attn_bda;
  // [Module 4: Post SelfAttention] Optional Layernorm after self-attn
  if (submodules.pre_cross_attn_layernorm)
    pre_cross_attn_layernorm = submodules.pre_cross_attn_layernorm(config, config.hidden_size, eps, precision);
  // [Module 5: CrossAttention]
  if (submodules.cross_attention) cross_attention = submodules.cross_attention(config, layer_number, precision);
  // [Module 6: BiasDropoutFusion]
  cross_attn_bda = submodules.cross_attn_bda;
  // [Module 7: Pre MLP] Optional Layernorm before MLP
  if (submodules.pre_mlp_layernorm)
    pre_mlp_layernorm = submodules.pre_mlp_layernorm(config, config.hidden_size, eps, precision);
  // [Module 8: MLP block]
  if (submodules.mlp) mlp = submodules.mlp(config, layer_number, precision);
  // [Module 9: BiasDropoutFusion]
  mlp_bda = submodules.mlp_bda;
}

void TransformerLayer::load_state_dict(const StateDict& sd) {
  if (input_layernorm) input_layernorm->load_state_dict(sd, "input_layernorm.");
  if (self_attention) self_attention->load_state_dict(sd, "self_attention.");
  if (pre_cross_attn_layernorm) pre_cross_attn_layernorm->load_state_dict(sd, "pre_cross_attn_layernorm.");
  if (cross_attention) cross_attention->load_state_dict(sd, "cross_attention.");
  if (pre_mlp_layernorm) pre_mlp_layernorm->load_state_dict(sd, "pre_mlp_layernorm.");
  if (mlp) mlp->load_state_dict(sd, "mlp.");
  sd.expect_all_used("TransformerLayer.load_state_dict");
}

void TransformerLayer::load_state_dict(const std::map<std::string, Tensor>& sd) { load_state_dict(StateDict(sd)); }

Mat TransformerLayer::apply_norm(const std::unique_ptr<Norm>& norm, const Mat& x, const std::string& name, int s, int b,
                                 const Taps& taps) const {
  if (!norm) return x;  // IdentityOp
  const Mat y = norm->forward(x);
  const Mat out = taps.record(name, y, {s, b, y.cols()}, precision);
  if (taps.enabled()) taps.set_magnitude(norm->error_magnitude(x));
  return out;
}

Mat TransformerLayer::apply_bda(const BdaBuilder& bda, const AttentionOutput& x_with_bias, const Mat& residual,
                                const RoundingCount& residual_rounding, DropoutSite site) const {
  if (!bda) return x_with_bias.output;  // IdentityFuncOp: returns its first argument
  // The residual was taken before the module whose output meets it here: its rounding points
  // count as well (a no-op end to end, where the count only grows; in isolation the count was
  // reset to the module's substituted input, which the residual did not come through).
  rounding_join(residual_rounding);
  return bda(training, config.bias_dropout_fusion, rng.at(site), precision)(x_with_bias, residual, hidden_dropout);
}

std::optional<std::string> TransformerLayer::backward_unsupported() const {
  if (self_attention && !dynamic_cast<const SelfAttention*>(self_attention.get()) &&
      !dynamic_cast<const MLASelfAttention*>(self_attention.get()))
    return std::string("self_attention is neither a SelfAttention nor an MLASelfAttention");
  if (cross_attention) {
    const auto* ca = dynamic_cast<const CrossAttentionBackward*>(cross_attention.get());
    if (!ca) return std::string("cross_attention has no backward (not a CrossAttentionBackward)");
    if (!cross_attn_bda) return std::string("cross_attention without the cross_attn_bda built for it");
    if (auto why = ca->backward_unsupported()) return "cross_attention: " + *why;
  } else if (pre_cross_attn_layernorm || cross_attn_bda) {
    return std::string("pre_cross_attn_layernorm or cross_attn_bda without a cross_attention");
  }
  if (mlp)
    if (auto why = mlp_backward_unsupported()) return why;
  // Features whose backward is not implemented yet.
  if (self_attention && config.attention_output_gate)
    return std::string("attention_output_gate (the output gate's backward)");
  if (self_attention && config.softmax_type == "learnable")
    return std::string("softmax_type learnable (the softmax offset's gradient)");
  return std::nullopt;
}

std::optional<std::string> TransformerLayer::mlp_backward_unsupported() const {
  if (!dynamic_cast<const MLP*>(mlp.get())) return std::string("mlp is not an MLP");
  if (config.bias_activation_fusion) return std::string("bias_activation_fusion (the fused activation's backward)");
  return std::nullopt;
}

OutputWithBias TransformerLayer::forward_mlp_saving(const Mat& hidden_states, const MlpArgs& args, const Taps& taps,
                                                    TransformerLayerSaved& saved) {
  return static_cast<MLP&>(*mlp).forward(hidden_states, args, taps, &saved.mlp);
}

MlpGrads TransformerLayer::backward_mlp(const Mat& doutput, TransformerLayerSaved& saved, const MlpArgs& args) const {
  return static_cast<const MLP&>(*mlp).backward(doutput, std::move(saved.mlp), args);
}

std::pair<Tensor, std::optional<Tensor>> TransformerLayer::forward(const Tensor& hidden_states,
                                                                   const LayerInputs& inputs, const Taps& taps,
                                                                   TransformerLayerSaved* saved) {
  if (saved) {
    if (const auto why = backward_unsupported()) throw std::logic_error("TransformerLayer has no backward: " + *why);
    *saved = TransformerLayerSaved{};
    saved->inputs = inputs;
    if (inputs.context) saved->context_shape = inputs.context->shape();
  }
  struct Reset {
    TransformerLayerSaved*& p;
    ~Reset() { p = nullptr; }
  } reset{saving_};
  saving_ = saved;
  return forward(hidden_states, inputs, taps);
}

std::pair<Tensor, std::optional<Tensor>> TransformerLayer::forward(const Tensor& hidden_states,
                                                                   const LayerInputs& inputs, const Taps& taps) {
  if (hidden_states.dim() != 3 || hidden_states.size(2) != config.hidden_size)
    throw ShapeError("hidden_states: expected shape [s, b, " + std::to_string(config.hidden_size) + "], got " +
                     shape_str(hidden_states.shape()));
  const int s = static_cast<int>(hidden_states.size(0)), b = static_cast<int>(hidden_states.size(1));
  if (s <= 0 || b <= 0)
    throw ShapeError("hidden_states: empty sequence or batch, got " + shape_str(hidden_states.shape()));
  const Mat x = to_mat(hidden_states, static_cast<std::int64_t>(s) * b, config.hidden_size, "hidden_states");
  if (saving_) {
    saving_->s = s;
    saving_->b = b;
  }
  auto [h, context] = _forward_attention(x, s, b, inputs, taps);
  const Mat output = _forward_mlp(h, s, b, inputs, taps);
  return {precision.to_tensor(output, {s, b, config.hidden_size}), context};
}

std::pair<Mat, std::optional<Tensor>> TransformerLayer::_forward_attention(const Mat& hidden_states_in, int s, int b,
                                                                           const LayerInputs& inputs,
                                                                           const Taps& taps) {
  // Residual connection.
  Mat residual = hidden_states_in;
  RoundingCount residual_rounding = rounding_now();
  if (saving_) saving_->hidden_states = hidden_states_in;
  // Optional Input Layer norm
  const Mat input_layernorm_output = apply_norm(input_layernorm, hidden_states_in, "input_layernorm", s, b, taps);

  // Self attention.
  // The attention's arguments: its mask and its dropout stream.
  auto attention_args = [&](const Tensor* mask, DropoutSite site) {
    AttentionArgs args;
    args.s = s;
    args.b = b;
    args.attention_mask = mask;
    args.training = training;
    args.rng = rng.at(site);
    return args;
  };
  AttentionOutput attention_output_with_bias;
  if (self_attention) {
    AttentionArgs args = attention_args(inputs.attention_mask, DropoutSite::SelfAttention);
    args.rotary_pos_emb = inputs.rotary_pos_emb;
    auto* mla = dynamic_cast<MLASelfAttention*>(self_attention.get());
    if (saving_ && mla)
      attention_output_with_bias =
          mla->forward(input_layernorm_output, args, taps.child("self_attention"), &saving_->mla_self_attention);
    else if (saving_)
      attention_output_with_bias =
          static_cast<SelfAttention&>(*self_attention)
              .forward(input_layernorm_output, args, taps.child("self_attention"), &saving_->self_attention);
    else
      attention_output_with_bias = self_attention->forward(input_layernorm_output, args, taps.child("self_attention"));
  } else {
    attention_output_with_bias.output = input_layernorm_output;  // IdentityOp
  }
  Mat hidden_states =
      apply_bda(self_attn_bda, attention_output_with_bias, residual, residual_rounding, DropoutSite::SelfAttnBda);

  // Residual connection.
  residual = hidden_states;
  residual_rounding = rounding_now();
  if (saving_) saving_->pre_cross_attn_layernorm_input = hidden_states;
  // Optional Layer norm after self-attention
  const Mat pre_cross_attn_layernorm_output =
      apply_norm(pre_cross_attn_layernorm, hidden_states, "pre_cross_attn_layernorm", s, b, taps);

  // Cross attention.
  std::optional<Tensor> context;
  if (inputs.context) context = *inputs.context;
  if (cross_attention) {
    AttentionArgs args = attention_args(inputs.context_mask, DropoutSite::CrossAttention);
    args.key_value_states = inputs.context;
    if (saving_)
      attention_output_with_bias = dynamic_cast<CrossAttentionBackward&>(*cross_attention)
                                       .forward_saving(pre_cross_attn_layernorm_output, args,
                                                       taps.child("cross_attention"), &saving_->cross_attention);
    else
      attention_output_with_bias =
          cross_attention->forward(pre_cross_attn_layernorm_output, args, taps.child("cross_attention"));
    if (attention_output_with_bias.context) context = attention_output_with_bias.context;
    if (saving_) saving_->cross_attention_context = attention_output_with_bias.context.has_value();
  } else {
    attention_output_with_bias = AttentionOutput();
    attention_output_with_bias.output = pre_cross_attn_layernorm_output;  // IdentityOp
  }
  hidden_states =
      apply_bda(cross_attn_bda, attention_output_with_bias, residual, residual_rounding, DropoutSite::CrossAttnBda);
  return {hidden_states, context};
}

Mat TransformerLayer::_forward_pre_mlp_layernorm(const Mat& hidden_states, int s, int b, const Taps& taps) {
  return apply_norm(pre_mlp_layernorm, hidden_states, "pre_mlp_layernorm", s, b, taps);
}

Mat TransformerLayer::_forward_mlp(const Mat& hidden_states, int s, int b, const LayerInputs& inputs,
                                   const Taps& taps) {
  // Residual connection.
  const Mat residual = hidden_states;
  const RoundingCount residual_rounding = rounding_now();
  if (saving_) saving_->pre_mlp_layernorm_input = hidden_states;
  // Optional Layer norm post the cross-attention.
  const Mat pre_mlp_layernorm_output = _forward_pre_mlp_layernorm(hidden_states, s, b, taps);
  OutputWithBias mlp_output_with_bias;
  if (mlp) {
    MlpArgs args;
    args.lead = {s, b};
    args.padding_mask = inputs.padding_mask;
    args.recorded_routing_map = inputs.recorded_routing_map;
    args.training = training;
    if (saving_)
      mlp_output_with_bias = forward_mlp_saving(pre_mlp_layernorm_output, args, taps.child("mlp"), *saving_);
    else
      mlp_output_with_bias = mlp->forward(pre_mlp_layernorm_output, args, taps.child("mlp"));
  } else {
    mlp_output_with_bias.output = pre_mlp_layernorm_output;  // IdentityOp
  }
  return _forward_post_mlp(mlp_output_with_bias, residual, residual_rounding);
}

Mat TransformerLayer::_forward_post_mlp(const OutputWithBias& mlp_output_with_bias, const Mat& residual,
                                        const RoundingCount& residual_rounding) {
  AttentionOutput x_with_bias;
  static_cast<OutputWithBias&>(x_with_bias) = mlp_output_with_bias;
  return apply_bda(mlp_bda, x_with_bias, residual, residual_rounding, DropoutSite::MlpBda);
}

TransformerLayerGrads TransformerLayer::backward(const Tensor& grad_output, TransformerLayerSaved&& saved,
                                                 const Tensor* grad_context) const {
  if (const auto why = backward_unsupported()) throw std::logic_error("TransformerLayer has no backward: " + *why);
  const int s = saved.s, b = saved.b, h = config.hidden_size;
  if (s <= 0 || saved.hidden_states.rows() != static_cast<Eigen::Index>(s) * b)
    throw std::logic_error("TransformerLayer::backward: `saved` was not filled by forward(..., &saved)");
  if (grad_output.dim() != 3 || grad_output.size(0) != s || grad_output.size(1) != b || grad_output.size(2) != h)
    throw ShapeError("grad_output: expected the output's shape " + shape_str(Shape{s, b, h}) + ", got " +
                     shape_str(grad_output.shape()));
  std::optional<Mat> dcontext;  // d of the context forward returned, rows of h
  if (grad_context) {
    const bool module_context = cross_attention && saved.cross_attention_context;
    if (!saved.context_shape && !module_context)
      throw ShapeError("grad_context: the layer returned no context, got " + shape_str(grad_context->shape()));
    if (grad_context->dim() != 3 || grad_context->size(2) != h ||
        (!module_context && grad_context->shape() != *saved.context_shape))
      throw ShapeError("grad_context: expected the returned context's shape" +
                       (module_context ? std::string(" [.., .., ") + std::to_string(h) + "]"
                                       : " " + shape_str(*saved.context_shape)) +
                       ", got " + shape_str(grad_context->shape()));
    dcontext = to_mat(*grad_context, grad_context->numel() / h, h, "grad_context");
  }
  const Eigen::Index n = static_cast<Eigen::Index>(s) * b;
  const Mat dout = to_mat(grad_output, n, h, "grad_output");  // [s*b, h]
  TransformerLayerGrads g;
  auto add = [&g](const std::string& prefix, const ParamGrads& params) {
    for (const ParamGrad& p : params) g.params.push_back({prefix + p.name, p.value, p.shape, p.magnitude});
  };
  // bda's backward: (d x, d residual); IdentityFuncOp passes d out to x and nothing to the residual.
  auto bda_backward = [&](const BdaBuilder& bda, const Mat& d, DropoutSite site) {
    if (!bda) return BiasDropoutAddGrads{d, Mat::Zero(d.rows(), d.cols())};
    return bias_dropout_add_backward(d, hidden_dropout, training, rng.at(site), precision);
  };
  // Where hidden_states fed both a norm and the residual, autograd sums the two gradients (stored).
  auto sum_uses = [&](const Mat& a, const Mat& r) {
    Mat d = precision.act(a + r);  // rounds: the accumulated gradient, activation dtype
    precision.count_act();
    return d;
  };

  // [Module 9 .. 7] mlp_bda, mlp, pre_mlp_layernorm
  const BiasDropoutAddGrads mlp_bda_grads = bda_backward(mlp_bda, dout, DropoutSite::MlpBda);
  Mat d = mlp_bda_grads.x;
  if (mlp) {
    const progress::Step step("mlp");
    MlpArgs args;
    args.lead = {s, b};
    args.training = training;
    MlpGrads mg = backward_mlp(d, saved, args);
    add("mlp.", mg.params);
    d = std::move(mg.hidden_states);
  }
  if (pre_mlp_layernorm) {
    const NormGrads ng = pre_mlp_layernorm->backward(d, saved.pre_mlp_layernorm_input);
    add_param_grads(g.params, "pre_mlp_layernorm.", ng);
    d = ng.input;
  }
  d = sum_uses(d, mlp_bda_grads.residual);

  // [Module 6 .. 4] cross_attn_bda with cross_attention, pre_cross_attn_layernorm
  std::optional<Mat> dcontext_in;  // d inputs.context
  if (cross_attention) {
    const progress::Step step("cross_attention");
    AttentionArgs args;
    args.s = s;
    args.b = b;
    args.attention_mask = saved.inputs.context_mask;
    args.training = training;
    args.rng = rng.at(DropoutSite::CrossAttention);
    const CrossAttentionBdaArgs bda{hidden_dropout, training, rng.at(DropoutSite::CrossAttnBda)};
    const bool module_context = saved.cross_attention_context;
    CrossAttentionWithBdaGrads cg = dynamic_cast<const CrossAttentionBackward&>(*cross_attention)
                                        .backward_with_bda(d, module_context && dcontext ? &*dcontext : nullptr,
                                                           saved.cross_attention.get(), args, bda);
    add("cross_attention.", cg.params);
    Mat dn = std::move(cg.hidden_states);
    if (pre_cross_attn_layernorm) {
      const NormGrads ng = pre_cross_attn_layernorm->backward(dn, saved.pre_cross_attn_layernorm_input);
      add_param_grads(g.params, "pre_cross_attn_layernorm.", ng);
      dn = ng.input;
    }
    d = cg.residual ? sum_uses(dn, *cg.residual) : dn;
    dcontext_in = std::move(cg.key_value_states);
    // A module that returns no context: the layer passes inputs.context through as its context.
    if (!module_context && dcontext) dcontext_in = dcontext_in ? sum_uses(*dcontext_in, *dcontext) : *dcontext;
  } else if (dcontext) {
    dcontext_in = dcontext;  // the context passes through the layer
  }
  if (saved.context_shape) {
    const Shape& cs = *saved.context_shape;
    g.context = precision.to_tensor(dcontext_in ? *dcontext_in : Mat::Zero(shape_numel(cs) / h, h), cs);
  }

  // [Module 3 .. 1] self_attn_bda, self_attention, input_layernorm
  const BiasDropoutAddGrads attn_bda_grads = bda_backward(self_attn_bda, d, DropoutSite::SelfAttnBda);
  d = attn_bda_grads.x;
  if (self_attention) {
    const progress::Step step("self_attention");
    AttentionArgs args;
    args.s = s;
    args.b = b;
    args.attention_mask = saved.inputs.attention_mask;
    args.rotary_pos_emb = saved.inputs.rotary_pos_emb;
    args.training = training;
    args.rng = rng.at(DropoutSite::SelfAttention);
    const auto* mla = dynamic_cast<const MLASelfAttention*>(self_attention.get());
    AttentionGrads ag =
        mla ? mla->backward(d, saved.mla_self_attention, args)
            : static_cast<const SelfAttention&>(*self_attention).backward(d, saved.self_attention, args);
    add("self_attention.", ag.params);
    d = std::move(ag.hidden_states);
  }
  if (input_layernorm) {
    const NormGrads ng = input_layernorm->backward(d, saved.hidden_states);
    add_param_grads(g.params, "input_layernorm.", ng);
    d = ng.input;
  }
  d = sum_uses(d, attn_bda_grads.residual);
  g.hidden_states = precision.to_tensor(d, {s, b, h});
  return g;
}

std::optional<std::vector<RowVec>> TransformerLayer::get_layer_norm_weights() const { return std::nullopt; }

RowVec TransformerLayer::get_mlp_layer_norm_weights() const {
  if (!pre_mlp_layernorm || pre_mlp_layernorm->weight().size() == 0)
    throw std::logic_error(
        "get_mlp_layer_norm_weights: linear_fc1 has no layer norm weight (pre_mlp_layernorm is "
        "IdentityOp or has no weight)");
  return pre_mlp_layernorm->weight();
}

RowVec TransformerLayer::get_qkv_layer_norm_weights() const {
  if (!input_layernorm || input_layernorm->weight().size() == 0)
    throw std::logic_error(
        "get_qkv_layer_norm_weights: linear_qkv has no layer norm weight (input_layernorm is "
        "IdentityOp or has no weight)");
  return input_layernorm->weight();
}

}  // namespace twin::reference
