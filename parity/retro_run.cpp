// The optimized twin's handlers of the Retro goldens: retro_decoder_layer_first /
// retro_decoder_layer (optimized/retro/retro_layer.h RetroDecoderLayer, with or without the
// retriever encoder), retro_block (RetroDecoderBlock in the layout of the shared spec code,
// reference/retro/decoder_spec.h) and retro_layout_table (that layout itself: the optimized block
// is built from it, so the table's run is the reference's). On the simulator (TWIN_BACKEND=cuda:
// the GPU). A config Megatron-Core runs but the twin does not implement is reported unsupported
// (FixtureUnsupported) before anything runs; bad input is an error.
#include <cstdlib>
#include <string>

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

void reject_unsupported(const Fixture& f) {
  if (const std::string why = opt::retro::retro_decoder_unsupported(f.config); !why.empty())
    throw FixtureUnsupported("the optimized twin does not implement " + why);
  // A golden is the unsharded layer's run with its taps; the twin records taps unsharded only.
  if (f.config.tensor_model_parallel_size != 1)
    throw FixtureUnsupported("the optimized twin records the Retro taps at tensor_model_parallel_size 1 only, not " +
                             std::to_string(f.config.tensor_model_parallel_size));
}

TwinRun finish(opt::retro::RetroOutput out) {
  TwinRun run;
  run.record = std::move(out.record);
  run.record.add(Role::Output, "hidden_states", out.hidden_states);
  if (out.context) run.record.add(Role::Output, "context", *out.context);
  return run;
}

TwinRun run_retro_layer(const Fixture& f, bool with_encoder, const RunMode& mode) {
  reject_isolated(f, mode);
  reference::validate_retro_config(f.config);
  check_inputs(f, {"hidden_states", "context", "context_mask"});
  reject_unsupported(f);
  opt::retro::RetroDecoderLayer layer(
      f.config, params_of(f),
      with_encoder ? opt::retro::RetroLayerKind::RetroWithEncoder : opt::retro::RetroLayerKind::Retro, f.layer_number,
      backend_of_env());
  opt::retro::RetroForwardOptions o;
  o.training = f.training;
  o.record_taps = true;
  CountRoundings counting;
  return finish(
      layer.forward(input(f, "hidden_states", 3), &input(f, "context", 3), optional_input(f, "context_mask", 4), o));
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
  reject_unsupported(f);
  opt::retro::RetroDecoderBlock block(f.config, params_of(f), layout, backend_of_env());
  opt::retro::RetroForwardOptions o;
  o.training = f.training;
  o.record_taps = true;
  CountRoundings counting;
  opt::retro::RetroOutput out =
      block.forward(input(f, "hidden_states", 3), &input(f, "context", 3), optional_input(f, "context_mask", 4), o);
  out.context.reset();  // a block hands back its hidden states only
  return finish(std::move(out));
}

}  // namespace twin::parity
