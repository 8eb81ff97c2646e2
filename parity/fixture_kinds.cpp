#include "parity/fixture_kinds.h"

#include <map>
#include <utility>

namespace twin {

const char* twin_kind_name(TwinKind t) { return t == TwinKind::Reference ? "reference" : "optimized"; }

FixtureHandler find_fixture_handler(const std::string& kind, TwinKind twin) {
  using namespace parity;
  // One line per supported (kind, twin); the twins add theirs as they learn a kind.
  static const std::map<std::pair<std::string, TwinKind>, FixtureHandler> handlers = {
      {{"layer_offset_table", TwinKind::Reference}, run_reference_layer_offset_table},
      {{"retro_layout_table", TwinKind::Reference}, run_reference_retro_layout_table},
      {{"retro_decoder_layer_first", TwinKind::Reference}, run_reference_retro_decoder_layer_first},
      {{"retro_decoder_layer", TwinKind::Reference}, run_reference_retro_decoder_layer},
      {{"retro_block", TwinKind::Reference}, run_reference_retro_block},
      {{"dense_layer", TwinKind::Reference}, run_reference_dense_layer},
      {{"dense_layer", TwinKind::Optimized}, run_optimized_dense_layer},
      {{"moe_layer", TwinKind::Reference}, run_reference_moe_layer},
  };
  auto it = handlers.find({kind, twin});
  return it == handlers.end() ? nullptr : it->second;
}

std::vector<Comparison> compare_fixture(FixtureHandler handler, const Fixture& f, TwinKind twin) {
  const TwinRun run = handler(f);
  return parity::compare_record(run.record, run.expected ? *run.expected : parity::expected_of(f),
                                twin_kind_name(twin));
}

std::vector<Comparison> compare_fixture(const Fixture& f, TwinKind twin) {
  const FixtureHandler h = find_fixture_handler(f.kind, twin);
  if (!h)
    throw FixtureError(f.path + ": the " + twin_kind_name(twin) + " twin does not support fixture kind '" + f.kind +
                       "'");
  return compare_fixture(h, f, twin);
}

namespace parity {

void check_inputs(const Fixture& f, const std::set<std::string>& known) {
  for (const auto& n : f.names_with_prefix("input."))
    if (!known.count(n.substr(6)))
      throw FixtureError(f.path + ": unexpected input tensor " + n + " for kind " + f.kind);
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

const Tensor& input(const Fixture& f, const std::string& name, int rank) {
  const Tensor* t = optional_input(f, name, rank);
  if (!t) throw FixtureError(f.path + ": input." + name + " is missing");
  return *t;
}

}  // namespace parity
}  // namespace twin
