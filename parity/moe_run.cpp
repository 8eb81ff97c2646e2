// The optimized twin's `moe_layer` fixture handler: an optimized MoETransformerLayer built from the
// golden's config and params, run on its inputs while counting rounding points. A config the twin
// does not implement (opt::moe_layer_unsupported) is reported unsupported before anything runs.
#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <optional>

#include "optimized/layer/rank_runner.h"  // ranks_as_processes
#include "optimized/moe/moe_transformer_layer.h"
#include "core/progress.h"
#include "parity/fixture_kinds.h"

namespace twin::parity {

TwinRun run_optimized_moe_layer(const Fixture& f, const RunMode& mode) {
  if (mode.isolate) throw FixtureError(f.path + ": the optimized twin does not run modules isolated yet");
  // The golden's whole layer over mode.ep expert-parallel ranks, with its own dispatcher (a capture
  // of an expert-parallel job holds every rank's experts: its recorded size is where it ran), or
  // over mode.tp tensor-parallel ranks (with sequence parallelism, as Megatron trains MoE at tp > 1).
  TransformerConfig cfg = f.config;
  cfg.expert_model_parallel_size = mode.ep;
  cfg.tensor_model_parallel_size = mode.tp;
  cfg.sequence_parallel = mode.sp;
  if (!cfg.num_moe_experts) throw FixtureError(f.path + ": kind moe_layer but config.num_moe_experts is None");
  check_inputs(f, {"hidden_states", "attention_mask", "rotary_pos_emb", "padding_mask"});
  const char* be = std::getenv("TWIN_BACKEND");
  opt::LayerOptions lo;
  lo.backend = be && std::string(be) == "cuda" ? rt::Backend::Cuda : rt::Backend::Sim;
  lo.tp = mode.tp;
  lo.sp = mode.sp;
  lo.processes = opt::ranks_as_processes(std::max(mode.ep, mode.tp));
  lo.layer_number = f.layer_number;
  lo.attn_mask_type = cfg.attn_mask_type;
  if (const std::string why = opt::moe_layer_unsupported(cfg, lo); !why.empty())
    throw FixtureUnsupported("the optimized twin does not implement " + why);
  // What the layer refuses of its inputs at tp > 1 (a ConfigError / ShapeError at forward), named first.
  if (mode.tp > 1 && optional_input(f, "padding_mask"))
    throw FixtureUnsupported("the optimized twin does not implement a padding_mask at tp > 1");
  if (const std::int64_t s = f.tensor("input.hidden_states").size(0); mode.sp && s % mode.tp != 0)
    throw FixtureUnsupported(
        fmt::format("sequence parallelism at tp {} does not split the sequence of {}", mode.tp, s));
  const Tensor* rope = optional_input(f, "rotary_pos_emb");
  if (cfg.position_embedding_type == "rope" && !rope && !cfg.multi_latent_attention)  // MLA: its own
    throw FixtureError(f.path + ": position_embedding_type is rope but input.rotary_pos_emb is missing");
  opt::MoETransformerLayer layer(cfg, params_of(f), lo);
  // The backward runs where the golden has gradients and the layer's backward covers them.
  const std::optional<std::string> no_backward =
      no_backward_reason(f, mode, layer.backward_unsupported(), TwinKind::Optimized);
  opt::MoEForwardInputs in;
  in.attention_mask = optional_input(f, "attention_mask");
  in.rotary_pos_emb = rope;
  in.padding_mask = optional_input(f, "padding_mask");
  in.recorded_routing_map = golden_routing_map(f, mode);
  opt::ForwardOptions fo;
  fo.training = f.training;  // the fixtures' dropout probabilities are 0
  fo.record_taps = true;
  fo.keep_for_backward = !no_backward;
  TwinRun run;
  CountRoundings counting;
  std::optional<progress::Step> step(std::in_place, "forward");
  auto out = layer.forward(input(f, "hidden_states", 3), in, fo);
  run.record = std::move(out.record);
  run.record.add(Role::Output, "hidden_states", out.hidden_states);
  if (no_backward) {
    run.no_backward_reason = *no_backward;
    return run;
  }
  step.emplace("backward");
  record_gradients(run, layer.backward(f.tensor("grad_in.output"), /*with_magnitudes=*/true));
  return run;
}

}  // namespace twin::parity
