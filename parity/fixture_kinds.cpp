#include "parity/fixture_kinds.h"

#include <fmt/format.h>

#include <map>
#include <utility>

#include "parity/routing_ties.h"

namespace twin {

const char* twin_kind_name(TwinKind t) { return t == TwinKind::Reference ? "reference" : "optimized"; }

FixtureHandler find_fixture_handler(const std::string& kind, TwinKind twin, const RunMode& mode) {
  using namespace parity;
  struct Entry {
    FixtureHandler handler;
    bool isolates;                 // runs each module on the golden's own input to it (RunMode::isolate)
    bool shards = false;           // runs at RunMode::tp > 1
    bool expert_parallel = false;  // runs at RunMode::ep > 1
  };
  // One line per supported (kind, twin); the twins add theirs as they learn a kind. A table has
  // no modules to isolate: its run is the same in both modes.
  static const std::map<std::pair<std::string, TwinKind>, Entry> handlers = {
      {{"layer_offset_table", TwinKind::Reference}, {run_reference_layer_offset_table, true}},
      {{"retro_layout_table", TwinKind::Reference}, {run_reference_retro_layout_table, true}},
      {{"retro_decoder_layer_first", TwinKind::Reference}, {run_reference_retro_decoder_layer_first, true}},
      {{"retro_decoder_layer", TwinKind::Reference}, {run_reference_retro_decoder_layer, true}},
      {{"retro_block", TwinKind::Reference}, {run_reference_retro_block, true}},
      {{"dense_layer", TwinKind::Reference}, {run_reference_dense_layer, true}},
      {{"dense_layer", TwinKind::Optimized}, {run_optimized_dense_layer, false, true}},
      // The optimized block is built in the layout of the shared spec code: the table is the same run.
      {{"retro_layout_table", TwinKind::Optimized}, {run_reference_retro_layout_table, true}},
      {{"retro_decoder_layer_first", TwinKind::Optimized}, {run_optimized_retro_decoder_layer_first, false, true}},
      {{"retro_decoder_layer", TwinKind::Optimized}, {run_optimized_retro_decoder_layer, false, true}},
      {{"retro_block", TwinKind::Optimized}, {run_optimized_retro_block, false, true}},
      {{"moe_layer", TwinKind::Reference}, {run_reference_moe_layer, true}},
      {{"moe_layer", TwinKind::Optimized}, {run_optimized_moe_layer, false, true, true}},
  };
  auto it = handlers.find({kind, twin});
  if (it == handlers.end() || (mode.isolate && !it->second.isolates) || (mode.tp > 1 && !it->second.shards) ||
      (mode.ep > 1 && !it->second.expert_parallel))
    return nullptr;
  return it->second.handler;
}

namespace {

// A golden held to another commit's semantics than its own (`twin fixture --megatron`): the twin
// run under the golden's own commit, and the first tensor (in computation order) where the two runs
// differ, as a failing row. The differences are often below the rounding bound, so the bound alone
// cannot say which Megatron-Core a golden came from; the twin's two runs, on the same inputs with
// only the switches apart, can. None when the commits agree on this layer (or the golden's own
// commit is unknown).
std::optional<Comparison> semantics_change(FixtureHandler handler, const Fixture& f, const RunMode& mode,
                                           const Record& held, TwinKind twin) {
  const MegatronSemantics* own =
      f.megatron_commit.empty() ? &pinned_megatron() : find_megatron_semantics(f.megatron_commit);
  if (!own || own == f.megatron) return std::nullopt;
  Fixture as_own = f;
  as_own.hold_to(own);
  const Record base = handler(as_own, mode).record;
  for (const RecordEntry& e : held.entries) {
    const Tensor* b = base.find(e.name, e.role);
    if (!b) continue;
    Comparison c = compare_exact(e.key(), e.value, *b);
    if (c.pass) continue;
    c.pass = false;
    c.message = fmt::format("semantics differ between Megatron-Core {} and the golden's {}: the {} twin's {} changes",
                            f.megatron->name, own->name, twin_kind_name(twin), e.key());
    return c;
  }
  return std::nullopt;
}

}  // namespace

std::vector<Comparison> compare_fixture(FixtureHandler handler, const Fixture& f, TwinKind twin, const RunMode& mode,
                                        std::string* grads, std::string* routing) {
  // The Megatron-Core semantics the golden is held to, before anything runs.
  if (!f.megatron)
    throw FixtureError(f.path + ": " + unknown_megatron_commit(f.megatron_commit) +
                       " (twin fixture --megatron COMMIT holds it to one of them)");
  if (f.file) check_config_fields(*f.megatron, f.config_json);
  if (const std::string why = unimplemented_semantics(*f.megatron, f.config, f.kind); !why.empty())
    throw FixtureUnsupported("the twins do not implement " + why + " yet");
  TwinRun run = handler(f, mode);
  RunMode ran = mode;
  std::string routing_note;
  if (const auto flips = parity::routing_flips(f, run.record)) {
    routing_note = flips->describe();
    if (flips->all_near() && flips->takes_golden_routing) {
      RunMode on_golden = mode;
      on_golden.golden_routing = true;
      run = handler(f, on_golden);
      ran = on_golden;
      routing_note += ": compared downstream on the golden's routing";
    } else if (flips->all_near()) {
      routing_note += "; not continued on the golden's routing: " + flips->why_not;
    }
  }
  if (routing) *routing = routing_note;
  parity::Expected expected = run.expected ? *run.expected : parity::expected_of(f);
  const bool golden_has_grads = !f.names_with_prefix("grad.").empty();
  if (run.backward) {
    const parity::Expected g = parity::grads_of(f);
    expected.insert(expected.end(), g.begin(), g.end());
  }
  if (grads)
    *grads = !golden_has_grads ? "none in the golden"
             : run.backward    ? "compared"
             : !run.no_backward_reason.empty()
                 ? "not compared: " + run.no_backward_reason
                 : fmt::format("not compared: the {} twin has no backward for fixture kind '{}'", twin_kind_name(twin),
                               f.kind);
  std::vector<Comparison> rows = parity::compare_record(run.record, expected, twin_kind_name(twin));
  if (auto changed = semantics_change(handler, f, ran, run.record, twin))
    rows.insert(rows.begin(), std::move(*changed));
  return rows;
}

std::vector<Comparison> compare_fixture(const Fixture& f, TwinKind twin, const RunMode& mode) {
  const FixtureHandler h = find_fixture_handler(f.kind, twin, mode);
  if (!h)
    throw FixtureError(f.path + ": the " + twin_kind_name(twin) + " twin does not support fixture kind '" + f.kind +
                       "'" + (mode.isolate ? " isolated" : ""));
  return compare_fixture(h, f, twin, mode);
}

namespace parity {

void check_inputs(const Fixture& f, const std::set<std::string>& known) {
  for (const auto& n : f.names_with_prefix("input."))
    if (!known.count(n.substr(6)))
      throw FixtureError(f.path + ": unexpected input tensor " + n + " for kind " + f.kind);
}

const Tensor* golden_routing_map(const Fixture& f, const RunMode& mode) {
  const std::string tie = f.meta("tie_break_dependent", "false");
  if (tie != "true" && tie != "false")
    throw FixtureError(f.path + ": __metadata__.tie_break_dependent must be \"true\" or \"false\", got \"" + tie +
                       "\"");
  return tie == "true" || mode.golden_routing ? &f.tensor("tap.mlp.router.1") : nullptr;
}

std::map<std::string, Tensor> params_of(const Fixture& f, const std::string& prefix) {
  std::map<std::string, Tensor> out;
  for (const auto& n : f.names_with_prefix(prefix)) out.emplace(n.substr(prefix.size()), f.tensor(n));
  return out;
}

const Tensor* optional_input(const Fixture& f, const std::string& name, int rank) {
  if (!f.has("input." + name)) return nullptr;
  const Tensor& t = f.tensor("input." + name);
  if (rank >= 0 && t.dim() != rank)
    throw FixtureError(f.path + ": input." + name + " must have rank " + std::to_string(rank) + ", got " +
                       shape_str(t.shape()));
  return &t;
}

std::function<const Tensor*(const std::string& key)> golden_substitutes(const Fixture& f) {
  return [&f](const std::string& key) -> const Tensor* {
    const bool tap = key.rfind("tap.", 0) == 0 || key.rfind("tap_in.", 0) == 0;
    return tap && f.has(key) ? &f.tensor(key) : nullptr;
  };
}

const Tensor& input(const Fixture& f, const std::string& name, int rank) {
  const Tensor* t = optional_input(f, name, rank);
  if (!t) throw FixtureError(f.path + ": input." + name + " is missing");
  return *t;
}

}  // namespace parity
}  // namespace twin
