// Fuzzes the TransformerConfig JSON parser: configs arrive in fixture files and on the command
// line, and the parser is strict by contract (core/config.h): invalid JSON, unknown fields and
// wrongly typed values are a ConfigError, nothing else. A config that parses must keep every value
// it accepted (to_json gives back the input's value for each field the input sets: no silent
// narrowing) and survive to_json -> text -> parse unchanged (the tools print configs and fixtures
// store them).
#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "core/config.h"
#include "fuzz/fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  twin::TransformerConfig c;
  try {
    c = twin::parse_transformer_config(text);
  } catch (const twin::ConfigError&) {
    return 0;  // the documented answer to a bad config
  } catch (const std::exception& e) {
    twin::fuzz::unexpected_exception(e);
  }
  try {
    const nlohmann::json j = twin::to_json(c);
    const nlohmann::json input = nlohmann::json::parse(text);
    for (const auto& [key, value] : input.items())
      if (j.at(key) != value)
        twin::fuzz::finding(
            ("config field '" + key + "' changed value: " + value.dump() + " became " + j.at(key).dump()).c_str());
    const twin::TransformerConfig back = twin::parse_transformer_config(j.dump());
    if (twin::to_json(back) != j) twin::fuzz::finding("config changed through to_json -> dump -> parse");
    (void)c.query_groups();
    (void)c.head_dim();
    (void)c.ffn();
  } catch (const std::exception& e) {
    // A parsed config must print and parse back: any exception here is a finding.
    twin::fuzz::unexpected_exception(e);
  }
  return 0;
}
