// Where each twin plugs in its support for a fixture kind. A handler builds its twin's layer from
// the golden's config and params, runs it on the golden's inputs and returns what the twin
// computed (a Record); compare_fixture turns that into comparison rows with the one comparison
// (parity/golden.h), so adding a kind or a twin adds no comparison code.
//
// Two ways to run a layer golden: end to end (the default: the twin runs the whole layer on the
// golden's inputs, each tap inheriting the error of everything before it) and isolated (each
// module runs on the golden's own recorded input to it, the previous tap, so each row shows the
// error that module introduces; reference/taps.h says how).
#pragma once

#include <functional>
#include <map>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/record.h"
#include "fixtures/fixture.h"
#include "optimized/transformer_layer.h"  // LayerGradients
#include "parity/compare.h"
#include "parity/golden.h"

namespace twin {

enum class TwinKind { Reference, Optimized };
const char* twin_kind_name(TwinKind t);  // "reference" | "optimized"

struct TwinRun {
  Record record;
  // True when the record holds the twin's gradients (Role::Grad: grad.input.*, grad.param.*) from a
  // backward run on the golden's grad_in.output; the golden's grad.* tensors are then compared.
  bool backward = false;
  // Without a backward: why the golden's gradients are not compared (empty: the twin has no
  // backward for the kind).
  std::string no_backward_reason;
  // JSON table goldens: the expected columns the handler read from the table. Unset: the golden's
  // own tensors (parity::expected_of).
  std::optional<parity::Expected> expected;
};

struct RunMode {
  bool isolate = false;  // each module on the golden's own input to it (see above)
  // The optimized twin's tensor-parallel size over simulated ranks, and sequence parallelism: the
  // golden's full state dict sharded as Megatron shards it, taps gathered across the ranks. A
  // golden is the unsharded layer's run, so the reference always runs it at tp = 1; a handler
  // that cannot shard is not found for tp > 1.
  int tp = 1;
  bool sp = false;
  // The optimized twin's expert-parallel size over simulated ranks (the MoE layer's experts split
  // among them, the alltoall dispatcher between them); a handler that cannot is not found for ep > 1.
  int ep = 1;
  // Run the MoE router on the golden's routing map (tap.mlp.router.1) instead of its own top-k
  // choice: set by the engine when the twin's choice flipped on near ties (parity/routing_ties.h).
  bool golden_routing = false;
  // The reference in fast mode (its GEMMs accumulated in fp32 by a BLAS, reference/precision.h):
  // the same rounding points and bound, several times faster at real sizes. The optimized twin
  // ignores it.
  bool fast = false;
};

// A twin's handler finds, before running anything, that the golden's config asks for something the
// twin does not implement: the golden is reported `unsupported` (never a wrong answer).
struct FixtureUnsupported : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Throws FixtureError / ConfigError / ShapeError for bad input, FixtureUnsupported (above).
using FixtureHandler = TwinRun (*)(const Fixture&, const RunMode&);

// nullptr when that twin does not support the kind (yet), or not in that mode.
FixtureHandler find_fixture_handler(const std::string& kind, TwinKind twin, const RunMode& mode = {});

// Runs the handler and compares its record with the golden: the one path from a golden to rows.
// `grads`, when given, receives what happened to the golden's grad.* tensors: "compared", "none in
// the golden", or "not compared: ..." with the reason (no backward for this kind in this twin).
// Gradients are never dropped silently: a run that did not produce them says so there.
// Routing decided on near ties (parity/routing_ties.h) runs the handler again on the golden's
// routing; `routing`, when given, receives what happened ("" when the twin's routing map is the
// golden's): the near-tie tokens, or the first token far from a tie.
std::vector<Comparison> compare_fixture(FixtureHandler handler, const Fixture& f, TwinKind twin,
                                        const RunMode& mode = {}, std::string* grads = nullptr,
                                        std::string* routing = nullptr);
// The same with the handler of the golden's kind; FixtureError when that twin has none.
std::vector<Comparison> compare_fixture(const Fixture& f, TwinKind twin, const RunMode& mode = {});

namespace parity {

// What the handlers share: reading a layer golden's inputs, and in isolation its taps.
// Throws FixtureError naming any input.* tensor outside `known` (bad input, not something to ignore).
void check_inputs(const Fixture& f, const std::set<std::string>& known);
// The MoE router's map the golden fixes (tap.mlp.router.1), or null: where the golden says a tie
// decided it (tie_break_dependent: torch.topk's order among tied values at the capacity cut or the
// top-k) or the engine runs on the golden's routing (RunMode::golden_routing).
const Tensor* golden_routing_map(const Fixture& f, const RunMode& mode);
// param.<key> tensors under their state-dict keys.
std::map<std::string, Tensor> params_of(const Fixture& f, const std::string& prefix = "param.");
// input.<name>, checked to have `rank` dimensions (-1: any), or null when the golden has none.
const Tensor* optional_input(const Fixture& f, const std::string& name, int rank = -1);
const Tensor& input(const Fixture& f, const std::string& name, int rank = -1);
// Isolation's substitutes (reference/taps.h Substitutes): the golden's tap.* and tap_in.* tensors
// by key; null for every other key. The lookup refers to f.
std::function<const Tensor*(const std::string& key)> golden_substitutes(const Fixture& f);

// Why a golden's gradients are not compared (parity/reference_handlers.cpp): std::nullopt when they
// are, "" when it has none; else the reason: the activation kinks' rule, what the twin's backward
// does not cover (`unsupported`, named for `twin`), an isolated run.
std::optional<std::string> no_backward_reason(const Fixture& f, const RunMode& mode,
                                              const std::optional<std::string>& unsupported, TwinKind twin);

// An optimized layer's gradients into its run's record (after the forward's entries, so their
// rounding points are counted on from the forward's, as the reference's handler records them).
void record_gradients(TwinRun& run, const opt::LayerGradients& grads);

// The handlers of each twin (parity/reference_handlers.cpp, parity/table_handlers.cpp,
// parity/dense_run.cpp).
TwinRun run_reference_dense_layer(const Fixture& f, const RunMode& mode);
TwinRun run_reference_moe_layer(const Fixture& f, const RunMode& mode);
TwinRun run_reference_retro_decoder_layer_first(const Fixture& f, const RunMode& mode);
TwinRun run_reference_retro_decoder_layer(const Fixture& f, const RunMode& mode);
TwinRun run_reference_retro_block(const Fixture& f, const RunMode& mode);
TwinRun run_reference_layer_offset_table(const Fixture& f, const RunMode& mode);
TwinRun run_reference_retro_layout_table(const Fixture& f, const RunMode& mode);
TwinRun run_optimized_dense_layer(const Fixture& f, const RunMode& mode);
TwinRun run_optimized_moe_layer(const Fixture& f, const RunMode& mode);
// parity/retro_run.cpp
TwinRun run_optimized_retro_decoder_layer_first(const Fixture& f, const RunMode& mode);
TwinRun run_optimized_retro_decoder_layer(const Fixture& f, const RunMode& mode);
TwinRun run_optimized_retro_block(const Fixture& f, const RunMode& mode);

}  // namespace parity
}  // namespace twin
