#include "parity/inspect.h"

#include <fmt/format.h>

#include <cmath>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include "core/config.h"
#include "core/safetensors.h"
#include "core/torch_io.h"
#include "fixtures/fixture.h"
#include "parity/cli_common.h"

namespace twin::cli {
namespace {

using json = nlohmann::json;

struct Stats {
  double min = std::numeric_limits<double>::quiet_NaN();
  double max = std::numeric_limits<double>::quiet_NaN();
  double mean = std::numeric_limits<double>::quiet_NaN();
};

// NaN propagates: a tensor holding a NaN shows nan, so it cannot hide.
Stats stats(const Tensor& t) {
  Stats s;
  const std::int64_t n = t.numel();
  if (n == 0) return s;
  long double sum = 0;
  bool nan = false;
  s.min = INFINITY;
  s.max = -INFINITY;
  for (std::int64_t i = 0; i < n; ++i) {
    const double v = t.at_f64(i);
    if (std::isnan(v)) nan = true;
    s.min = std::min(s.min, v);
    s.max = std::max(s.max, v);
    sum += v;
  }
  s.mean = static_cast<double>(sum / n);
  if (nan) s.min = s.max = s.mean = std::numeric_limits<double>::quiet_NaN();
  return s;
}

struct Inspected {
  std::string format;  // safetensors | pt | json
  std::uint64_t bytes = 0;
  std::map<std::string, std::string> metadata;
  json config;  // parsed config restricted to the fields the file sets; null if none
  std::vector<std::pair<std::string, Tensor>> tensors;
  json table;  // JSON fixture tables
};

std::uint64_t file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  return in ? static_cast<std::uint64_t>(in.tellg()) : 0;
}

// torch.save writes a zip archive: recognised by its magic whatever the file is called.
bool is_zip(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  char magic[4] = {};
  return in.read(magic, 4) && std::string(magic, 4) == std::string("PK\x03\x04", 4);
}

Inspected load(const std::string& path) {
  Inspected r;
  if (ends_with(path, ".pt") || ends_with(path, ".pth") || is_zip(path)) {
    TorchFile f = read_torch_file(path);
    r.format = "pt";
    r.bytes = file_bytes(path);
    r.metadata = std::move(f.metadata);
    r.tensors = std::move(f.tensors);
    return r;
  }
  if (ends_with(path, ".json")) {
    std::ifstream in(path);
    if (!in) throw FixtureError(path + ": cannot open");
    r.format = "json";
    r.bytes = file_bytes(path);
    try {
      r.table = json::parse(in);
    } catch (const json::exception& e) {
      throw FixtureError(path + ": is not valid JSON: " + e.what());
    }
    return r;
  }
  SafetensorsFile f = read_safetensors(path);
  r.format = "safetensors";
  r.bytes = f.file_size();
  r.metadata = f.metadata();
  for (const auto& n : f.names()) r.tensors.emplace_back(n, f.at(n));
  if (auto it = r.metadata.find("config"); it != r.metadata.end()) {
    json given;
    try {
      given = json::parse(it->second);
    } catch (const json::exception& e) {
      throw FixtureError(path + ": __metadata__.config is not valid JSON: " + e.what());
    }
    TransformerConfig c;
    try {
      c = parse_transformer_config(given);
    } catch (const ConfigError& e) {
      throw ConfigError(path + ": " + e.what());
    }
    const json parsed = to_json(c);
    r.config = json::object();
    for (const auto& [k, v] : given.items()) r.config[k] = parsed.at(k);
  }
  return r;
}

json to_json_line(const std::string& path, const Inspected& r) {
  json j = {{"file", path},     {"status", "ok"},         {"message", ""},     {"format", r.format},
            {"bytes", r.bytes}, {"metadata", r.metadata}, {"config", r.config}};
  json ts = json::array();
  for (const auto& [name, t] : r.tensors) {
    const Stats s = stats(t);
    ts.push_back({{"name", name},
                  {"dtype", dtype_name(t.dtype())},
                  {"shape", t.shape()},
                  {"min", s.min},
                  {"max", s.max},
                  {"mean", s.mean}});
  }
  j["tensors"] = ts;
  if (r.format == "json") {
    j["kind"] = r.table.is_object() ? r.table.value("kind", json(nullptr)) : json(nullptr);
    j["entries"] = r.table.is_object() && r.table.contains("entries") ? r.table["entries"].size() : 0;
  }
  return j;
}

void print_text(const std::string& path, const Inspected& r, std::ostream& out) {
  out << fmt::format("{} ({}, {} bytes)\n", path, r.format, r.bytes);
  if (r.format == "json") {
    out << fmt::format("kind: {}\n",
                       r.table.is_object() ? r.table.value("kind", std::string("(none)")) : "(not an object)");
    if (r.table.is_object() && r.table.contains("entries"))
      out << fmt::format("entries: {}\n", r.table["entries"].size());
    return;
  }
  if (!r.metadata.empty()) {
    out << "metadata:\n";
    for (const auto& [k, v] : r.metadata) {
      std::string shown = one_line(v);
      if (k == "config")
        shown = fmt::format("<JSON, {} chars; parsed below>", v.size());
      else if (shown.size() > 100)
        shown = fmt::format("{}... ({} chars)", shown.substr(0, 96), v.size());
      out << fmt::format("  {}: {}\n", k, shown);
    }
  }
  if (!r.config.is_null()) {
    out << "config (parsed; the fields the file sets):\n";
    std::string text = r.config.dump(2);
    std::string indented = "  ";
    for (char c : text) indented += c == '\n' ? std::string("\n  ") : std::string(1, c);
    out << indented << "\n";
  }
  std::size_t w = 6;
  for (const auto& [name, t] : r.tensors) w = std::max(w, name.size());
  std::size_t sw = 5;
  for (const auto& [name, t] : r.tensors) sw = std::max(sw, shape_str(t.shape()).size());
  out << fmt::format("tensors ({}):\n", r.tensors.size());
  out << fmt::format("  {:<{}}  {:<5}  {:<{}}  {:>12}  {:>12}  {:>12}\n", "name", w, "dtype", "shape", sw, "min", "max",
                     "mean");
  for (const auto& [name, t] : r.tensors) {
    const Stats s = stats(t);
    out << fmt::format("  {:<{}}  {:<5}  {:<{}}  {:>12}  {:>12}  {:>12}\n", name, w, dtype_name(t.dtype()),
                       shape_str(t.shape()), sw, num(s.min), num(s.max), num(s.mean));
  }
}

}  // namespace

int run_inspect(const InspectOptions& opt, std::ostream& out, std::ostream& err) {
  int code = 0;
  bool first = true;
  for (const auto& path : opt.files) {
    try {
      const Inspected r = load(path);
      if (opt.json) {
        out << to_json_line(path, r).dump() << "\n";
      } else {
        if (!first) out << "\n";
        print_text(path, r, out);
      }
      first = false;
    } catch (...) {
      const std::string msg = describe_exception(std::current_exception());
      if (opt.json)
        out << json{{"file", path}, {"status", "error"}, {"message", msg}}.dump() << "\n";
      else
        err << "error: " << msg << "\n";
      code = 2;
    }
    out.flush();
  }
  return code;
}

}  // namespace twin::cli
