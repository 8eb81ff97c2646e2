#include "parity/dense_run.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <fmt/format.h>
#include <map>
#include <set>
#include <optional>

#include "core/progress.h"
#include "optimized/layer/rank_runner.h"  // ranks_as_processes
#include "optimized/transformer_layer.h"
#include "parity/bounds.h"
#include "parity/fixture_kinds.h"
#include "reference/transformer_layer.h"

namespace twin::parity {

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

Tensor reference_forward(const DenseCase& c, const DenseInputs& in, bool exact, Record* record) {
  return reference_forward(c, in, exact ? reference::ComputeMode::Exact : reference::ComputeMode::FP32, record);
}

Tensor reference_forward(const DenseCase& /*c: the inputs carry it*/, const DenseInputs& in,
                         reference::ComputeMode mode, Record* record) {
  using namespace twin::reference;
  TransformerConfig cfg = in.config;
  cfg.tensor_model_parallel_size = 1;  // the reference is the unsharded layer
  cfg.sequence_parallel = false;
  const Precision p = Precision::from_config(cfg, mode);
  // The spec's attn_mask_type param: causal, or no_mask / padding / arbitrary for the other cases.
  const ModuleSpec spec = get_gpt_layer_local_spec(std::nullopt, cfg.qk_layernorm, cfg.normalization, cfg.qk_l2_norm,
                                                   attn_mask_type_from_name(cfg.attn_mask_type));
  TransformerLayer layer(cfg, spec.submodules, in.layer_number, std::nullopt, p);
  layer.load_state_dict(in.params);
  layer.training = in.training;
  layer.rng = DropoutRng{in.dropout_seed, 0};
  LayerInputs li;
  li.attention_mask = in.attention_mask.defined() ? &in.attention_mask : nullptr;
  li.rotary_pos_emb = in.rotary_pos_emb.defined() ? &in.rotary_pos_emb : nullptr;
  CountRoundings counting;
  auto [out, ctx] = layer.forward(in.hidden_states, li, record ? Taps(record) : Taps());
  if (record) record->add(Role::Output, "hidden_states", out);
  return out;
}

opt::LayerOptions optimized_layer_options(const DenseCase& c, const DenseInputs& in, rt::Backend backend) {
  opt::LayerOptions lo;
  lo.tp = c.tp;
  lo.sp = c.sp;
  lo.processes = opt::ranks_as_processes(c.tp);
  lo.backend = backend;
  lo.attn_mask_type = in.config.attn_mask_type;
  lo.layer_number = in.layer_number;
  return lo;
}

Tensor optimized_forward(const DenseCase& c, const DenseInputs& in, const RunOptions& o, Record* record) {
  opt::DenseTransformerLayer layer(in.config, in.params, optimized_layer_options(c, in, o.backend));
  opt::ForwardOptions fo;
  fo.training = in.training;
  fo.seed = in.dropout_seed;
  fo.record_taps = record != nullptr;
  fo.use_graph = o.use_graph;
  CountRoundings counting;
  auto out = layer.forward(in.hidden_states, in.attention_mask.defined() ? &in.attention_mask : nullptr,
                           in.rotary_pos_emb.defined() ? &in.rotary_pos_emb : nullptr, fo);
  if (record) {
    *record = std::move(out.record);
    record->add(Role::Output, "hidden_states", out.hidden_states);
  }
  return out.hidden_states;
}

CaseResult run_case(const DenseCase& c, const RunOptions& o) {
  CaseResult r;
  r.id = to_id(c);
  const DenseInputs in = make_inputs(c);
  const bool want_taps = o.taps && !o.use_graph;
  Record ref_rec, exact_rec, opt_rec;
  auto t0 = std::chrono::steady_clock::now();
  const Tensor ref = reference_forward(c, in, false, want_taps ? &ref_rec : nullptr);
  const Tensor exact = reference_forward(c, in, true, want_taps ? &exact_rec : nullptr);
  r.seconds_reference = seconds_since(t0);
  r.reference_error = max_abs_diff(ref, exact);
  t0 = std::chrono::steady_clock::now();
  const Tensor got = optimized_forward(c, in, o, want_taps ? &opt_rec : nullptr);
  r.seconds_optimized = seconds_since(t0);
  r.output = compare("output.hidden_states", got, ref, reference_error_bound(c.dtype, r.reference_error, max_abs(ref)));
  if (want_taps) {
    // Each tap gets the same rule from its own reference error; a parameter tap (a bias: no
    // rounding point before it) must match exactly.
    r.taps = diff_taps(opt_rec, ref_rec, [&](const RecordEntry& e, const Tensor& expected) {
      const Tensor* ex = exact_rec.find(e.name, e.role);
      if (e.rounding.none() || !ex) return Tolerance{0.0, 0.0, "a parameter (bias) tap: exact"};
      return reference_error_bound(c.dtype, max_abs_diff(expected, *ex), max_abs(expected));
    });
  }
  return r;
}

std::string CaseResult::report() const {
  std::string s = fmt::format(
      "{}\n  output: max abs {:.3e} (bound atol {:.3e} + rtol {:.2e}|e|, share {:.3f}) reference error vs exact "
      "{:.3e}{}\n",
      id, output.max_abs, output.tol.atol, output.tol.rtol, output.share_used, reference_error,
      output.message.empty() ? "" : " : " + output.message);
  if (!output.pass)
    s += fmt::format("  worst at {}: optimized {:.7g} reference {:.7g}\n", output.worst_index_str(),
                     output.worst_actual, output.worst_expected);
  if (!taps.rows.empty() && (!taps.pass() || !output.pass)) {
    s += taps.format();
    if (taps.first_divergence >= 0) s += "  first divergence: " + taps.first_divergence_name() + "\n";
  }
  return s;
}

// ---- the optimized twin's dense_layer fixture handler -------------------------------------------

TwinRun run_optimized_dense_layer(const Fixture& f, const RunMode& mode) {
  // Its layer records taps but does not continue from substitutes (reference/taps.h) yet.
  if (mode.isolate) throw FixtureError(f.path + ": the optimized twin does not run modules isolated yet");
  const TransformerConfig& cfg = f.config;
  check_inputs(f, {"hidden_states", "attention_mask", "rotary_pos_emb"});
  const char* be = std::getenv("TWIN_BACKEND");
  opt::LayerOptions lo;
  lo.backend = be && std::string(be) == "cuda" ? rt::Backend::Cuda : rt::Backend::Sim;
  lo.layer_number = f.layer_number;
  lo.tp = mode.tp;
  lo.sp = mode.sp;
  lo.processes = opt::ranks_as_processes(mode.tp);
  lo.attn_mask_type = cfg.attn_mask_type;  // the spec param the fixture ran with
  // What the twin does not implement is asked first (the feature table), reported unsupported.
  if (const std::string why = opt::layer_unsupported(opt::LayerKind::Dense, cfg, lo); !why.empty())
    throw FixtureUnsupported("the optimized twin does not implement " + why);
  const std::map<std::string, Tensor> params = params_of(f);
  const auto keys = opt::dense_layer_param_keys(cfg);
  for (const auto& [k, v] : params)
    if (std::find(keys.begin(), keys.end(), k) == keys.end())
      throw FixtureError(f.path + ": parameter '" + k + "' is not one the dense layer owns");
  opt::DenseTransformerLayer layer(cfg, params, lo);
  // The backward runs where the golden has gradients and the layer's backward covers them.
  const std::optional<std::string> no_backward =
      no_backward_reason(f, mode, layer.backward_unsupported(), TwinKind::Optimized);
  opt::ForwardOptions fo;
  fo.training = f.training;  // the fixtures' dropout probabilities are 0
  fo.record_taps = true;
  fo.keep_for_backward = !no_backward;
  const Tensor* rope = optional_input(f, "rotary_pos_emb");
  if (cfg.position_embedding_type == "rope" && !rope && !cfg.multi_latent_attention)  // MLA: its own
    throw FixtureError(f.path + ": position_embedding_type is rope but input.rotary_pos_emb is missing");
  TwinRun run;
  CountRoundings counting;
  std::optional<progress::Step> step(std::in_place, "forward");
  auto out = layer.forward(input(f, "hidden_states", 3), optional_input(f, "attention_mask"), rope, fo);
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

void record_gradients(TwinRun& run, const opt::LayerGradients& grads) {
  for (const opt::ParamGradient& g : grads.params)
    run.record.add(Role::Grad, "param." + g.name, g.value).magnitude = g.magnitude;
  run.record.add(Role::Grad, "input.hidden_states", grads.hidden_states);
  run.backward = true;
}

}  // namespace twin::parity
