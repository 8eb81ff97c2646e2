// The reference twin's handlers of the JSON table goldens: layer_offset_table
// (get_transformer_layer_offset / get_num_layers_to_build / TransformerConfig validation) and
// retro_layout_table (get_retro_decoder_block_spec's layout). Each column of a table becomes one
// integer record entry (a label per row) beside the expected column read from the table, so the
// one comparison (parity/golden.h) checks every cell exactly and names the first mismatching row.
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "parity/fixture_kinds.h"
#include "reference/retro/decoder_spec.h"
#include "reference/transformer_config.h"
#include "reference/transformer_layer_offset.h"

namespace twin::parity {

namespace {

using namespace twin::reference;
using json = nlohmann::json;

// A cell is a number, or the Python exception Megatron raised. Exceptions are coded far outside
// any layer count so that an exception never equals a number.
constexpr std::int64_t kAssertionError = -1000001;
constexpr std::int64_t kZeroDivisionError = -1000002;
constexpr std::int64_t kOtherError = -1000003;
constexpr std::int64_t kNotComputed = -1000004;  // the twin rejected the config Megatron accepted

std::int64_t error_code(const std::string& python_type) {
  if (python_type == "AssertionError") return kAssertionError;
  if (python_type == "ZeroDivisionError") return kZeroDivisionError;
  return kOtherError;
}

std::string cell_str(std::int64_t v) {
  switch (v) {
    case kAssertionError:
      return "AssertionError";
    case kZeroDivisionError:
      return "ZeroDivisionError";
    case kOtherError:
      return "error";
    case kNotComputed:
      return "not computed (config rejected)";
    default:
      return std::to_string(v);
  }
}

[[noreturn]] void bad_table(const Fixture& f, const std::string& what) { throw FixtureError(f.path + ": " + what); }

// Expected cell: an integer, or {"error": "Type: message"}.
std::int64_t expected_cell(const Fixture& f, const json& v, const std::string& where) {
  if (v.is_number_integer()) return v.get<std::int64_t>();
  if (v.is_object() && v.contains("error") && v["error"].is_string()) {
    const std::string e = v["error"].get<std::string>();
    return error_code(e.substr(0, e.find(':')));
  }
  bad_table(f, where + ": expected an integer or {\"error\": ...}, got " + v.dump());
}

// Runs fn; a LayerOffsetError becomes its exception's code.
std::int64_t actual_cell(const std::function<std::int64_t()>& fn) {
  try {
    return fn();
  } catch (const LayerOffsetError& e) {
    return error_code(e.python_type);
  }
}

// One table column: values in row order with a label per row.
struct Column {
  explicit Column(std::string n) : name(std::move(n)) {}
  std::string name;
  std::vector<std::int64_t> actual, expected;
  std::vector<std::string> rows;

  void add(std::int64_t a, std::int64_t e, std::string row) {
    actual.push_back(a);
    expected.push_back(e);
    rows.push_back(std::move(row));
  }

  // The column into the run: the twin's cells as a record entry, Megatron's as the expected.
  void add_to(TwinRun& run, const std::function<std::string(std::int64_t)>& show = cell_str) const {
    const Shape shape{static_cast<std::int64_t>(actual.size())};
    RecordEntry& e = run.record.add_exact(Role::Column, name, Tensor::from_vector<std::int64_t>(shape, actual));
    e.row_labels = rows;
    e.show = [show](double v) { return show(static_cast<std::int64_t>(v)); };
    run.expected->emplace_back(name, Tensor::from_vector<std::int64_t>(shape, expected));
  }
};

std::string opt_str(const std::optional<int>& v) { return v ? std::to_string(*v) : "None"; }

// The table's config: TransformerConfig(hidden_size=64, num_attention_heads=4, **config)
// (see the table's notes). pipeline_dtype is not a twin field; a layout is not modelled.
TransformerConfig table_config(const Fixture& f, const json& entry_config, std::size_t i) {
  if (!entry_config.is_object()) bad_table(f, "entries[" + std::to_string(i) + "].config is not an object");
  json j = {{"hidden_size", 64}, {"num_attention_heads", 4}};
  for (const auto& [k, v] : entry_config.items()) {
    if (k == "pipeline_dtype") continue;
    if (k == "pipeline_model_parallel_layout") {
      if (!v.is_null())
        bad_table(f, "entries[" + std::to_string(i) + "]: pipeline_model_parallel_layout is not modelled");
      continue;
    }
    j[k] = v;
  }
  return parse_transformer_config(j);
}

}  // namespace

TwinRun run_reference_layer_offset_table(const Fixture& f, const RunMode& /*mode: a table has no modules*/) {
  const json& entries = f.table.contains("entries") ? f.table["entries"] : json();
  if (!entries.is_array() || entries.empty()) bad_table(f, "no 'entries' array");

  Column rejected{"config_error (rejected)"};
  Column offset{"offset"};
  Column num_layers_to_build{"num_layers_to_build"};
  Column raw_offset{"raw_offset"};

  for (std::size_t i = 0; i < entries.size(); ++i) {
    const json& entry = entries[i];
    if (!entry.is_object() || !entry.contains("config") || !entry.contains("results") || !entry["results"].is_array())
      bad_table(f, "entries[" + std::to_string(i) + "] needs 'config' and 'results'");
    const TransformerConfig config = table_config(f, entry["config"], i);
    const std::string entry_label = "entries[" + std::to_string(i) + "] " + entry["config"].dump();

    // Validation: Megatron's config_error (a message) or null.
    bool twin_rejected = false;
    std::string twin_message;
    try {
      validate_transformer_config(config);
    } catch (const ConfigError& e) {
      twin_rejected = true;
      twin_message = e.what();
    }
    const bool megatron_rejected = entry.contains("config_error") && !entry["config_error"].is_null();
    rejected.add(twin_rejected, megatron_rejected,
                 entry_label + " (twin: " + (twin_rejected ? twin_message : "accepted") +
                     "; Megatron: " + (megatron_rejected ? entry["config_error"].dump() : "accepted") + ")");

    for (std::size_t r = 0; r < entry["results"].size(); ++r) {
      const json& res = entry["results"][r];
      if (!res.contains("pp_rank") || !res["pp_rank"].is_number_integer())
        bad_table(f, "entries[" + std::to_string(i) + "].results[" + std::to_string(r) + "] has no integer pp_rank");
      const int pp_rank = res["pp_rank"].get<int>();
      std::optional<int> vp_stage;
      if (res.contains("vp_stage") && !res["vp_stage"].is_null()) {
        if (!res["vp_stage"].is_number_integer())
          bad_table(f,
                    "entries[" + std::to_string(i) + "].results[" + std::to_string(r) + "].vp_stage is not an integer");
        vp_stage = res["vp_stage"].get<int>();
      }
      const std::string where = "entries[" + std::to_string(i) + "].results[" + std::to_string(r) + "]";
      const std::string row = entry_label + " pp_rank=" + std::to_string(pp_rank) + " vp_stage=" + opt_str(vp_stage);

      // Validated config: offset and num_layers_to_build (absent where Megatron rejected it).
      if (res.contains("offset"))
        offset.add(twin_rejected ? kNotComputed
                                 : actual_cell([&] { return get_transformer_layer_offset(config, vp_stage, pp_rank); }),
                   expected_cell(f, res["offset"], where + ".offset"), row);
      if (res.contains("num_layers_to_build"))
        num_layers_to_build.add(twin_rejected ? kNotComputed : actual_cell([&] {
                                  return get_num_layers_to_build(config, vp_stage, pp_rank);
                                }),
                                expected_cell(f, res["num_layers_to_build"], where + ".num_layers_to_build"), row);
      // The same function on the unvalidated fields.
      if (res.contains("raw_offset"))
        raw_offset.add(actual_cell([&] { return get_transformer_layer_offset(config, vp_stage, pp_rank); }),
                       expected_cell(f, res["raw_offset"], where + ".raw_offset"), row);
    }
  }

  auto yes_no = [](std::int64_t v) -> std::string { return v ? "rejected" : "accepted"; };
  TwinRun run;
  run.expected.emplace();
  rejected.add_to(run, yes_no);
  for (const Column* c : {&offset, &num_layers_to_build, &raw_offset})
    if (!c->actual.empty()) c->add_to(run);
  return run;
}

TwinRun run_reference_retro_layout_table(const Fixture& f, const RunMode& /*mode: a table has no modules*/) {
  const json& entries = f.table.contains("entries") ? f.table["entries"] : json();
  if (!entries.is_array() || entries.empty()) bad_table(f, "no 'entries' array");

  using retro::RetroLayerKind;
  Column error{"error (no Retro layer)"};
  Column num_layers{"num_layers"};
  Column layers{"layers"};
  const std::int64_t kMissing = -1;  // a layer one side has and the other has not
  auto kind_code = [&](const std::string& name, const std::string& where) -> std::int64_t {
    for (RetroLayerKind k : {RetroLayerKind::Gpt, RetroLayerKind::Retro, RetroLayerKind::RetroWithEncoder})
      if (name == retro::retro_layer_kind_name(k)) return static_cast<std::int64_t>(k);
    bad_table(f, where + ": unknown layer kind '" + name + "'");
  };
  auto kind_str = [&](std::int64_t v) -> std::string {
    return v < 0 ? "missing" : retro::retro_layer_kind_name(static_cast<RetroLayerKind>(v));
  };

  for (std::size_t i = 0; i < entries.size(); ++i) {
    const json& entry = entries[i];
    const std::string where = "entries[" + std::to_string(i) + "]";
    if (!entry.is_object() || !entry.contains("num_layers") || !entry["num_layers"].is_number_integer())
      bad_table(f, where + " has no integer num_layers");
    const int n = entry["num_layers"].get<int>();
    const bool megatron_error = entry.contains("error");
    if (!megatron_error && !(entry.contains("layers") && entry["layers"].is_array()))
      bad_table(f, where + " has neither 'layers' nor 'error'");

    std::vector<RetroLayerKind> twin_layout;
    bool twin_error = false;
    std::string twin_message;
    try {
      twin_layout = retro::get_retro_decoder_block_layout(n);
    } catch (const ConfigError& e) {
      twin_error = true;
      twin_message = e.what();
    }
    const std::string label = "num_layers=" + std::to_string(n);
    error.add(twin_error, megatron_error,
              label + " (twin: " + (twin_error ? twin_message : "a layout") +
                  "; Megatron: " + (megatron_error ? entry["error"].dump() : "a layout") + ")");
    if (megatron_error) continue;

    const json& expected_layers = entry["layers"];
    num_layers.add(static_cast<std::int64_t>(twin_layout.size()), static_cast<std::int64_t>(expected_layers.size()),
                   label);
    const std::size_t len = std::max(twin_layout.size(), expected_layers.size());
    for (std::size_t l = 0; l < len; ++l) {
      const std::int64_t a = l < twin_layout.size() ? static_cast<std::int64_t>(twin_layout[l]) : kMissing;
      std::int64_t e = kMissing;
      if (l < expected_layers.size()) {
        if (!expected_layers[l].is_string()) bad_table(f, where + ".layers[" + std::to_string(l) + "] is not a string");
        e = kind_code(expected_layers[l].get<std::string>(), where + ".layers[" + std::to_string(l) + "]");
      }
      layers.add(a, e, label + " layer " + std::to_string(l + 1));
    }
  }

  auto yes_no = [](std::int64_t v) -> std::string { return v ? "error" : "a layout"; };
  TwinRun run;
  run.expected.emplace();
  error.add_to(run, yes_no);
  if (!num_layers.actual.empty()) num_layers.add_to(run);
  if (!layers.actual.empty()) layers.add_to(run, kind_str);
  return run;
}

}  // namespace twin::parity
