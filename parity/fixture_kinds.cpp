#include "parity/fixture_kinds.h"

#include <map>
#include <utility>

#include "parity/dense_run.h"
#include "reference/fixture_handlers.h"

namespace twin {

const char* twin_kind_name(TwinKind t) { return t == TwinKind::Reference ? "reference" : "optimized"; }

FixtureHandler find_fixture_handler(const std::string& kind, TwinKind twin) {
  // One line per supported (kind, twin); the twins add theirs as they learn a kind.
  static const std::map<std::pair<std::string, TwinKind>, FixtureHandler> handlers = {
      {{"layer_offset_table", TwinKind::Reference}, reference::run_layer_offset_table_fixture},
      {{"retro_layout_table", TwinKind::Reference}, reference::run_retro_layout_table_fixture},
      {{"retro_decoder_layer_first", TwinKind::Reference}, reference::run_retro_decoder_layer_first_fixture},
      {{"retro_decoder_layer", TwinKind::Reference}, reference::run_retro_decoder_layer_fixture},
      {{"retro_block", TwinKind::Reference}, reference::run_retro_block_fixture},
      {{"dense_layer", TwinKind::Reference}, reference::run_dense_layer_fixture},
      {{"dense_layer", TwinKind::Optimized}, parity::run_optimized_dense_layer_fixture},
      {{"moe_layer", TwinKind::Reference}, reference::run_moe_layer_fixture},
  };
  auto it = handlers.find({kind, twin});
  return it == handlers.end() ? nullptr : it->second;
}

}  // namespace twin
