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
    current.router_scores_fp32 = true;
    current.aux_loss_scores_fp32 = true;
    current.sqrtsoftplus = true;
    current.layer_fp32_residual = true;
    current.per_token_aux_grad_scale = true;
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

namespace {

bool is_moe(const TransformerConfig& c) { return c.num_moe_experts.value_or(0) > 0; }

// The router's logits dtype: moe_router_dtype, else the layer's.
DType router_logits_dtype(const TransformerConfig& c) {
  if (c.moe_router_dtype == std::optional<std::string>("fp32")) return DType::F32;
  if (c.moe_router_dtype == std::optional<std::string>("fp64")) return DType::F64;
  return params_dtype(c);
}

bool has_aux_loss(const TransformerConfig& c) {
  return c.moe_aux_loss_coeff > 0 && c.moe_router_load_balancing_type.find("aux_loss") != std::string::npos;
}

}  // namespace

std::string unimplemented_semantics(const MegatronSemantics& m, const TransformerConfig& c, const std::string& kind) {
  const std::string at = " at Megatron-Core " + m.name;
  if (!m.has_retro && kind.rfind("retro", 0) == 0) return "Retro, which does not exist" + at;
  if (m.layer_fp32_residual && c.fp32_residual_connection && params_dtype(c) != DType::F32)
    return "fp32_residual_connection in a " + std::string(dtype_name(params_dtype(c))) + " layer (an fp32 residual" + at + ")";
  if (!is_moe(c)) return "";
  const bool logits_not_fp32 = router_logits_dtype(c) != DType::F32;
  const bool sigmoid_path = c.moe_router_score_function == "sigmoid" || c.moe_router_score_function == "sqrtsoftplus";
  if (m.sqrtsoftplus && c.moe_router_score_function == "sqrtsoftplus")
    return "the sqrtsoftplus score function" + at;
  if (m.router_scores_fp32 && logits_not_fp32 &&
      (sigmoid_path || c.moe_router_pre_softmax || c.moe_router_topk_scaling_factor))
    return "router scores kept in fp32 until the final cast (" + std::string(dtype_name(router_logits_dtype(c))) +
           " logits with sigmoid scores, pre-softmax or a scaling factor)" + at;
  if (m.aux_loss_scores_fp32 && logits_not_fp32 && sigmoid_path && has_aux_loss(c))
    return "sigmoid aux-loss scores in fp32" + at;
  const int tp_cp = c.tensor_model_parallel_size * c.context_parallel_size;
  const bool seq_aux = c.moe_router_load_balancing_type.find("seq_aux_loss") != std::string::npos;
  if (m.per_token_aux_grad_scale && c.calculate_per_token_loss &&
      ((seq_aux && c.micro_batch_size > 1) || (tp_cp > 1 && (has_aux_loss(c) || c.moe_z_loss_coeff))))
    return "calculate_per_token_loss's aux-loss gradient scale (by the batch and tensor x context parallel sizes)" + at;
  return "";
}

}  // namespace twin
