#include "parity/check.h"

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "parity/fixture_kinds.h"

namespace twin::cli {

const std::vector<std::string>& known_fixture_kinds() {
  static const std::vector<std::string> kinds = {
      "dense_layer", "moe_layer", "retro_decoder_layer_first", "retro_decoder_layer",
      "retro_block", "layer_offset_table", "retro_layout_table"};
  return kinds;
}

int run_check(const CheckOptions& opt, std::ostream& out, std::ostream& /*err*/) {
  nlohmann::json kinds = nlohmann::json::array();
  if (!opt.json) {
    out << "twin check: no checks run yet; fixture kinds and the twins that support them:\n";
    out << fmt::format("  {:<27}  {:<11}  {:<11}\n", "kind", "reference", "optimized");
  }
  for (const auto& k : known_fixture_kinds()) {
    const bool ref = find_fixture_handler(k, TwinKind::Reference) != nullptr;
    const bool opt_twin = find_fixture_handler(k, TwinKind::Optimized) != nullptr;
    kinds.push_back({{"kind", k}, {"reference", ref}, {"optimized", opt_twin}});
    if (!opt.json)
      out << fmt::format("  {:<27}  {:<11}  {:<11}\n", k, ref ? "yes" : "not yet", opt_twin ? "yes" : "not yet");
  }
  if (opt.json)
    out << nlohmann::json{{"command", "check"}, {"status", "pass"}, {"message", "no checks run yet"}, {"kinds", kinds}}.dump()
        << "\n";
  return 0;
}

}  // namespace twin::cli
