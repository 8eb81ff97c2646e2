#include "core/megatron_commit.h"

#include <nlohmann/json.hpp>

namespace twin {

const std::vector<MegatronSemantics>& known_megatron_commits() {
  static const std::vector<MegatronSemantics> commits = [] {
    MegatronSemantics pin;
    pin.commit = "93ddc24720bb8d62ae68ced044ad59e1a95ead0f";
    pin.name = "93ddc247 (January 2026)";
    MegatronSemantics current;
    current.commit = "d98e8a64ddf34856e74b24714e3bedb2f5a39553";
    current.name = "d98e8a64 (August 2026)";
    current.has_retro = false;
    current.switches.router_scores_fp32 = true;
    current.switches.aux_loss_scores_fp32 = true;
    current.switches.sqrtsoftplus = true;
    current.layer_fp32_residual = true;
    current.removed_fields = {"moe_use_legacy_grouped_gemm"};  // with the legacy GroupedMLP
    return std::vector<MegatronSemantics>{pin, current};
  }();
  return commits;
}

const MegatronSemantics& pinned_megatron() { return known_megatron_commits().front(); }

const MegatronSemantics* find_megatron_semantics(const std::string& commit) {
  for (const auto& m : known_megatron_commits())
    if (commit.size() >= 7 && m.commit.compare(0, commit.size(), commit) == 0) return &m;
  return nullptr;
}

std::string unknown_megatron_commit(const std::string& commit) {
  std::string known;
  for (const auto& m : known_megatron_commits()) known += (known.empty() ? "" : ", ") + m.name;
  return "unknown Megatron-Core commit '" + commit + "': the twins know " + known;
}

const MegatronSemantics& megatron_semantics(const std::string& commit) {
  if (const MegatronSemantics* m = find_megatron_semantics(commit)) return *m;
  throw ConfigError(unknown_megatron_commit(commit));
}

void check_config_fields(const MegatronSemantics& m, const nlohmann::json& config) {
  for (const auto& field : m.removed_fields) {
    // Every removed field so far defaulted to false (or None).
    auto it = config.find(field);
    if (it != config.end() && !it->is_null() && *it != false)
      throw ConfigError("config field '" + field + "' does not exist at Megatron-Core " + m.name);
  }
}

std::string unimplemented_semantics(const MegatronSemantics& m, const TransformerConfig& c, const std::string& kind) {
  const std::string at = " at Megatron-Core " + m.name;
  if (!m.has_retro && kind.rfind("retro", 0) == 0) return "Retro, which does not exist" + at;
  if (m.layer_fp32_residual && c.fp32_residual_connection && params_dtype(c) != DType::F32)
    return "fp32_residual_connection in a " + std::string(dtype_name(params_dtype(c))) + " layer (an fp32 residual" +
           at + ")";
  return "";
}

}  // namespace twin
