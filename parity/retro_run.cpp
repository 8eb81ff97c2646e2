// The optimized twin's handlers of the Retro goldens: retro_decoder_layer_first /
// retro_decoder_layer (optimized/retro/retro_layer.h RetroDecoderLayer, with or without the
// retriever encoder), retro_block (RetroDecoderBlock in the layout of the shared spec code,
// reference/retro/decoder_spec.h) and retro_layout_table (that layout itself: the optimized block
// is built from it, so the table's run is the reference's). On the simulator (TWIN_BACKEND=cuda:
// the GPU). A config Megatron-Core runs but the twin does not implement is reported unsupported
// (FixtureUnsupported) before anything runs; bad input is an error. Where the golden has gradients
// the backward runs too and its gradients are compared.
#include <cstdlib>
#include <string>
#include <optional>

#include "optimized/layer/sharding.h"
#include "core/progress.h"
#include "optimized/retro/retro_layer.h"
#include "parity/fixture_kinds.h"
#include "reference/retro/decoder_spec.h"
#include "reference/transformer_config.h"

namespace twin::parity {

namespace {

opt::retro::RetroLayerKind kind_of(reference::retro::RetroLayerKind k) {
  switch (k) {
    case reference::retro::RetroLayerKind::Gpt:
      return opt::retro::RetroLayerKind::Gpt;
    case reference::retro::RetroLayerKind::Retro:
      return opt::retro::RetroLayerKind::Retro;
    case reference::retro::RetroLayerKind::RetroWithEncoder:
      return opt::retro::RetroLayerKind::RetroWithEncoder;
  }
  throw std::logic_error("unknown Retro layer kind");
}

rt::Backend backend_of_env() {
  const char* be = std::getenv("TWIN_BACKEND");
  return be && std::string(be) == "cuda" ? rt::Backend::Cuda : rt::Backend::Sim;
}

void reject_isolated(const Fixture& f, const RunMode& mode) {
  if (mode.isolate) throw FixtureError(f.path + ": the optimized twin does not run modules isolated yet");
}

// The config the optimized twin runs: the golden's at the mode's tensor-parallel size (a golden is
// the unsharded layer's run; the twin's ranks shard its full state dict and gather their taps
// and gradients). FixtureUnsupported for what it does not implement or a size that does not
// divide the layer.
TransformerConfig twin_config(const Fixture& f, const RunMode& mode) {
  if (const std::string why = opt::retro::retro_decoder_unsupported(f.config); !why.empty())
    throw FixtureUnsupported("the optimized twin does not implement " + why);
  TransformerConfig c = f.config;
  c.tensor_model_parallel_size = mode.tp;
  if (mode.sp) throw FixtureUnsupported("the optimized Retro decoder has no sequence parallelism");
  try {
    opt::check_tensor_parallel_sizes("--tp", c, mode.tp, "the tensor-parallel size");
  } catch (const ConfigError& e) {
    throw FixtureUnsupported(e.what());
  }
  return c;
}

TwinRun finish(opt::retro::RetroOutput out) {
  TwinRun run;
  run.record = std::move(out.record);
  run.record.add(Role::Output, "hidden_states", out.hidden_states);
  if (out.context) run.record.add(Role::Output, "context", *out.context);
  return run;
}

// The gradients after the forward's entries (counted on from the forward's rounding points).
void record_retro_gradients(TwinRun& run, const opt::retro::RetroGradients& g) {
  opt::LayerGradients layer;
  layer.hidden_states = g.hidden_states;
  layer.params = g.params;
  parity::record_gradients(run, layer);
  if (g.context) run.record.add(Role::Grad, "input.context", *g.context);
}

// Runs the golden's forward and, where it has gradients, the backward on its grad_in.output
// (output.context is not in the golden's loss), on `twin` (a layer or a block).
template <class Twin>
TwinRun run_with_backward(Twin& twin, const Fixture& f, const RunMode& mode, bool hand_back_context) {
  const std::optional<std::string> no_backward = no_backward_reason(f, mode, std::nullopt, TwinKind::Optimized);
  opt::retro::RetroForwardOptions o;
  o.training = f.training;
  o.record_taps = true;
  o.keep_for_backward = !no_backward;
  CountRoundings counting;
  std::optional<progress::Step> step(std::in_place, "forward");
  opt::retro::RetroOutput out =
      twin.forward(input(f, "hidden_states", 3), &input(f, "context", 3), optional_input(f, "context_mask", 4), o);
  if (!hand_back_context) out.context.reset();  // a block hands back its hidden states only
  TwinRun run = finish(std::move(out));
  if (no_backward) {
    run.no_backward_reason = *no_backward;
    return run;
  }
  step.emplace("backward");
  record_retro_gradients(run, twin.backward(f.tensor("grad_in.output")));
  return run;
}

TwinRun run_retro_layer(const Fixture& f, bool with_encoder, const RunMode& mode) {
  reject_isolated(f, mode);
  reference::validate_retro_config(f.config);
  check_inputs(f, {"hidden_states", "context", "context_mask"});
  opt::retro::RetroDecoderLayer layer(
      twin_config(f, mode), params_of(f),
      with_encoder ? opt::retro::RetroLayerKind::RetroWithEncoder : opt::retro::RetroLayerKind::Retro, f.layer_number,
      backend_of_env());
  return run_with_backward(layer, f, mode, true);
}

}  // namespace

TwinRun run_optimized_retro_decoder_layer_first(const Fixture& f, const RunMode& mode) {
  return run_retro_layer(f, true, mode);
}
TwinRun run_optimized_retro_decoder_layer(const Fixture& f, const RunMode& mode) {
  return run_retro_layer(f, false, mode);
}

TwinRun run_optimized_retro_block(const Fixture& f, const RunMode& mode) {
  reject_isolated(f, mode);
  check_inputs(f, {"hidden_states", "context", "context_mask"});
  std::vector<opt::retro::RetroLayerKind> layout;
  for (auto k : reference::retro::get_retro_decoder_block_layout(f.config)) layout.push_back(kind_of(k));
  opt::retro::RetroDecoderBlock block(twin_config(f, mode), params_of(f), layout, backend_of_env());
  return run_with_backward(block, f, mode, false);
}

}  // namespace twin::parity
