// The reference twin's handlers of the layer goldens: dense_layer (TransformerLayer from
// get_gpt_layer_local_spec), moe_layer (the same spec with num_experts: an MoETransformerLayer),
// retro_decoder_layer_first / retro_decoder_layer (a Retro decoder layer owning the retriever
// encoder, or not) and retro_block (a decoder TransformerBlock from get_retro_decoder_block_spec).
// Each builds the layer from the golden's config and params, runs it on the golden's inputs while
// counting rounding points, and returns the record; parity/golden.h compares. Every handler also
// runs the backward on the golden's grad_in.output where it can (no_backward_reason says why not).
// Isolated (RunMode::isolate), the taps continue from the golden's own tap tensors
// (golden_substitutes).
#include <memory>
#include <string>
#include <optional>

#include "parity/fixture_kinds.h"
#include "core/progress.h"
#include "reference/moe/moe_transformer_layer.h"
#include "reference/retro/decoder_layer_spec.h"
#include "reference/retro/decoder_spec.h"
#include "reference/transformer_block.h"
#include "reference/transformer_config.h"
#include "reference/transformer_layer.h"

namespace twin::parity {

using namespace twin::reference;

namespace {

// relu / squared_relu / the GLU clamps have kinks where the gradient jumps; in bf16 / fp16 two
// correct implementations put a pre-activation on different sides of a kink often enough that a
// counted rounding bound does not hold there (seen against live Megatron: relu + clamp 1.0 in
// bf16). Until the comparison can exclude elements whose pre-activation lies within rounding of
// a kink, those gradients are reported as not compared rather than failed or passed.
std::optional<std::string> activation_kinks(const TransformerConfig& cfg, const Precision& p) {
  const bool kinks = cfg.activation_func == "relu" || cfg.activation_func == "squared_relu" ||
                     (cfg.gated_linear_unit && cfg.activation_func_clamp_value);
  if (!kinks || p.params_dtype == DType::F32) return std::nullopt;
  return "a " + std::string(twin::dtype_name(p.params_dtype)) +
         " layer with activation kinks (relu, squared_relu or the GLU clamp): its gradients jump where roundings move "
         "a pre-activation across a kink, which the rounding bound does not cover yet";
}

}  // namespace

std::optional<std::string> no_backward_reason(const Fixture& f, const RunMode& mode,
                                              const std::optional<std::string>& unsupported, TwinKind twin) {
  if (!f.has("grad_in.output")) return std::string();
  if (const auto why = activation_kinks(f.config, Precision::from_config(f.config))) return why;
  if (unsupported)
    return std::string(twin == TwinKind::Reference ? "the reference's" : "the optimized twin's") +
           " backward does not cover " + *unsupported + " yet";
  // Isolation restarts each module from the golden's own input to it; the golden records no
  // intermediate gradients for a module's backward to restart from, so gradients are compared end to
  // end only.
  if (mode.isolate)
    return std::string("an isolated run compares the forward only (the golden has no intermediate gradients)");
  return std::nullopt;
}

namespace {

LayerInputs layer_inputs(const Fixture& f) {
  LayerInputs in;
  in.attention_mask = optional_input(f, "attention_mask");
  in.rotary_pos_emb = optional_input(f, "rotary_pos_emb");
  // Multi-latent attention computes its own rotary embedding (the golden has none as an input).
  if (f.config.position_embedding_type == "rope" && !in.rotary_pos_emb && !f.config.multi_latent_attention)
    throw FixtureError(f.path + ": position_embedding_type is rope but input.rotary_pos_emb is missing");
  return in;
}

// Runs `layer` (a TransformerLayer or a subclass) on the golden's hidden states.
TwinRun run_layer(TransformerLayer& layer, const Fixture& f, const LayerInputs& in, const RunMode& mode) {
  layer.load_state_dict(StateDict(params_of(f)));
  layer.training = f.training;
  TwinRun run;
  const Substitutes substitutes = mode.isolate ? golden_substitutes(f) : nullptr;
  CountRoundings counting;
  const progress::Step step("forward");
  auto [hidden_states, context] = layer.forward(input(f, "hidden_states", 3), in, Taps(&run.record, "", &substitutes));
  run.record.add(Role::Output, "hidden_states", hidden_states);
  if (context) run.record.add(Role::Output, "context", *context);
  return run;
}

// The gradients follow the forward entries (Role::Grad), the backward's rounding points counted
// on from the forward's (a gradient depends on every forward activation it reads).
void add_grads(TwinRun& run, const Precision& p, const ParamGrads& params, const Tensor& hidden_states,
               const std::optional<Tensor>& context) {
  for (const ParamGrad& g : params)
    run.record.add(Role::Grad, "param." + g.name, g.stored(p.storage_dtype())).magnitude = g.magnitude;
  run.record.add(Role::Grad, "input.hidden_states", hidden_states);
  if (context) run.record.add(Role::Grad, "input.context", *context);
  run.backward = true;
}

// Runs forward and, when the golden's gradients can be compared, backward on its grad_in.output:
// the gradients follow the forward entries in the record (Role::Grad), the backward's rounding
// points counted on from the forward's (a gradient depends on every forward activation it reads).
TwinRun run_layer_with_backward(TransformerLayer& layer, const Fixture& f, const LayerInputs& in, const RunMode& mode) {
  if (const auto why = no_backward_reason(f, mode, layer.backward_unsupported(), TwinKind::Reference)) {
    TwinRun run = run_layer(layer, f, in, mode);  // strict: every param.* key must be owned by the spec
    run.no_backward_reason = *why;
    return run;
  }
  layer.load_state_dict(StateDict(params_of(f)));  // strict, as above
  layer.training = f.training;
  TwinRun run;
  CountRoundings counting;
  TransformerLayerSaved saved;
  std::optional<progress::Step> step(std::in_place, "forward");
  auto [hidden_states, context] = layer.forward(input(f, "hidden_states", 3), in, Taps(&run.record), &saved);
  run.record.add(Role::Output, "hidden_states", hidden_states);
  if (context) run.record.add(Role::Output, "context", *context);
  // output.context is not in the golden's loss (sum(output.hidden_states * grad_in.output)).
  step.emplace("backward");
  const TransformerLayerGrads grads = layer.backward(f.tensor("grad_in.output"), std::move(saved));
  add_grads(run, layer.precision, grads.params, grads.hidden_states, grads.context);
  return run;
}

// FP32 mode (Megatron's rounding points, fp64 sums), or with RunMode::fast fast mode (the same
// points, the GEMMs accumulated in fp32 by a BLAS: another correct implementation, within the same
// counted bound; reference/precision.h).
Precision reference_precision(const TransformerConfig& c, const RunMode& mode) {
  return Precision::from_config(c, mode.fast ? ComputeMode::Fast : ComputeMode::FP32);
}

TwinRun run_retro_layer(const Fixture& f, bool with_encoder, const RunMode& mode) {
  const TransformerConfig& config = f.config;
  validate_retro_config(config);
  check_inputs(f, {"hidden_states", "context", "context_mask"});
  const ModuleSpec spec =
      retro::get_retro_decoder_layer_local_spec(
          with_encoder ? std::optional<TransformerBlockSubmodules>(retro::get_retro_encoder_block_spec(config, false))
                       : std::nullopt)
          .spec;
  std::unique_ptr<BaseTransformerLayer> built = spec.build(config, f.layer_number, reference_precision(config, mode));
  auto& layer = dynamic_cast<TransformerLayer&>(*built);
  LayerInputs in;
  in.context = &input(f, "context", 3);
  in.context_mask = optional_input(f, "context_mask");
  return run_layer_with_backward(layer, f, in, mode);
}

}  // namespace

// The dense layer: forward and backward (run_layer_with_backward).
TwinRun run_reference_dense_layer(const Fixture& f, const RunMode& mode) {
  const TransformerConfig& cfg = f.config;
  validate_transformer_config(cfg);
  check_inputs(f, {"hidden_states", "attention_mask", "rotary_pos_emb"});
  const ModuleSpec spec =
      get_gpt_layer_local_spec(std::nullopt, cfg.qk_layernorm, cfg.normalization, cfg.qk_l2_norm,
                               attn_mask_type_from_name(cfg.attn_mask_type), cfg.multi_latent_attention);
  TransformerLayer layer(cfg, spec.submodules, f.layer_number, std::nullopt, reference_precision(cfg, mode));
  const LayerInputs in = layer_inputs(f);
  return run_layer_with_backward(layer, f, in, mode);
}

TwinRun run_reference_moe_layer(const Fixture& f, const RunMode& mode) {
  TransformerConfig cfg = f.config;
  cfg.expert_model_parallel_size = 1;  // a golden is the whole layer: a capture gathers every rank's experts
  if (!cfg.num_moe_experts) throw FixtureError(f.path + ": kind moe_layer but config.num_moe_experts is None");
  check_inputs(f, {"hidden_states", "attention_mask", "rotary_pos_emb", "padding_mask"});
  const ModuleSpec spec =
      moe::get_gpt_layer_local_moe_spec(*cfg.num_moe_experts, cfg.moe_grouped_gemm, cfg.qk_layernorm, cfg.normalization,
                                        cfg.qk_l2_norm, cfg.multi_latent_attention);
  moe::MoETransformerLayer layer(cfg, spec.submodules, f.layer_number, std::nullopt, reference_precision(cfg, mode));
  LayerInputs in = layer_inputs(f);
  in.padding_mask = optional_input(f, "padding_mask");
  in.recorded_routing_map = golden_routing_map(f, mode);
  return run_layer_with_backward(layer, f, in, mode);
}

TwinRun run_reference_retro_decoder_layer_first(const Fixture& f, const RunMode& mode) {
  return run_retro_layer(f, true, mode);
}
TwinRun run_reference_retro_decoder_layer(const Fixture& f, const RunMode& mode) {
  return run_retro_layer(f, false, mode);
}

TwinRun run_reference_retro_block(const Fixture& f, const RunMode& mode) {
  const TransformerConfig& config = f.config;
  check_inputs(f, {"hidden_states", "context", "context_mask"});
  TransformerBlock block(config, retro::get_retro_decoder_block_spec(config, false), reference_precision(config, mode));
  const StateDict sd(params_of(f));
  block.load_state_dict(sd);
  sd.expect_all_used("TransformerBlock.load_state_dict (" + f.path + ")");
  LayerInputs in;
  in.context = &input(f, "context", 3);
  in.context_mask = optional_input(f, "context_mask");
  TwinRun run;
  const auto why = no_backward_reason(f, mode, block.backward_unsupported(), TwinKind::Reference);
  const Substitutes substitutes = mode.isolate ? golden_substitutes(f) : nullptr;
  CountRoundings counting;
  TransformerBlockSaved saved;
  std::optional<progress::Step> step(std::in_place, "forward");
  const Tensor hidden_states = block.forward(input(f, "hidden_states", 3), in, f.training, DropoutRng{},
                                             Taps(&run.record, "", &substitutes), nullptr, why ? nullptr : &saved);
  run.record.add(Role::Output, "hidden_states", hidden_states);
  if (why) {
    run.no_backward_reason = *why;
    return run;
  }
  step.emplace("backward");
  const TransformerBlockGrads grads = block.backward(f.tensor("grad_in.output"), std::move(saved));
  add_grads(run, block.precision, grads.params, grads.hidden_states, grads.context);
  return run;
}

}  // namespace twin::parity
