#include "optimized/layer/features.h"

#include <algorithm>

namespace twin::opt {

namespace {

using K = LayerKind;
const std::vector<LayerKind> kNone = {};

bool has_experts(const TransformerConfig& c) { return c.num_moe_experts.has_value(); }
int tp_of(const TransformerConfig& c, const LayerOptions& o) { return std::max(o.tp, c.tensor_model_parallel_size); }

// The activations the optimized bias-activation kernel implements (activations.cuh act_from_name).
bool has_activation_kernel(const std::string& a) {
  for (const char* k : {"gelu", "silu", "swish", "relu", "squared_relu", "quick_gelu"})
    if (a == k) return true;
  return false;
}

LayerFeature row(std::string name, std::function<bool(const TransformerConfig&, const LayerOptions&)> requested,
                 std::vector<LayerKind> supported_by, std::string reason,
                 std::function<void(TransformerConfig&, LayerOptions&)> example) {
  return LayerFeature{std::move(name), std::move(requested), std::move(supported_by), std::move(reason),
                      std::move(example)};
}

// A config field that no kind implements, asked for when `on` holds.
LayerFeature none_implement(std::string name, std::function<bool(const TransformerConfig&)> on, std::string reason,
                            std::function<void(TransformerConfig&)> example) {
  return row(
      std::move(name), [on](const TransformerConfig& c, const LayerOptions&) { return on(c); }, kNone,
      std::move(reason), [example](TransformerConfig& c, LayerOptions&) { example(c); });
}

// A router feature of the MoE layer (asked for only by a config with experts) that it does not implement.
LayerFeature moe_lacks(std::string name, std::function<bool(const TransformerConfig&)> on, std::string reason,
                       std::function<void(TransformerConfig&)> example) {
  return none_implement(
      std::move(name), [on](const TransformerConfig& c) { return has_experts(c) && on(c); }, std::move(reason),
      std::move(example));
}

}  // namespace

const char* layer_kind_name(LayerKind k) {
  switch (k) {
    case K::Dense:
      return "dense";
    case K::MoE:
      return "moe";
    case K::Retro:
      return "retro";
  }
  return "?";
}

const std::vector<LayerKind>& all_layer_kinds() {
  static const std::vector<LayerKind> kinds = {K::Dense, K::MoE, K::Retro};
  return kinds;
}

bool LayerFeature::supported(LayerKind k) const {
  return std::find(supported_by.begin(), supported_by.end(), k) != supported_by.end();
}

namespace {

// The layer's structure and parallel layout.
std::vector<LayerFeature> structure_features() {
  return {
      row(
          "num_moe_experts", [](const TransformerConfig& c, const LayerOptions&) { return has_experts(c); }, {K::MoE},
          "a mixture of experts is the MoE layer's (the dense and Retro specs are dense)",
          [](TransformerConfig& c, LayerOptions&) { c.num_moe_experts = 4; }),
      row(
          "tensor_model_parallel_size > 1",
          [](const TransformerConfig& c, const LayerOptions& o) { return tp_of(c, o) > 1; },
          {K::Dense, K::Retro, K::MoE}, "",
          [](TransformerConfig& c, LayerOptions& o) { c.tensor_model_parallel_size = o.tp = 2; }),
      row(
          "sequence_parallel",
          [](const TransformerConfig& c, const LayerOptions& o) { return o.sp || c.sequence_parallel; },
          {K::Dense, K::MoE}, "Retro's layers do not split the sequence across tensor-parallel ranks",
          [](TransformerConfig& c, LayerOptions& o) {
            c.tensor_model_parallel_size = o.tp = 2;
            c.sequence_parallel = o.sp = true;
          }),
      row(
          "tensor_model_parallel_size > 1 on the GPU backend",
          [](const TransformerConfig&, const LayerOptions& o) { return o.backend == rt::Backend::Cuda && o.tp > 1; },
          kNone, "one device here: simulate the ranks with Backend::Sim",
          [](TransformerConfig& c, LayerOptions& o) {
            c.tensor_model_parallel_size = o.tp = 2;
            o.backend = rt::Backend::Cuda;
          }),
      none_implement(
          "context_parallel_size > 1", [](const TransformerConfig& c) { return c.context_parallel_size != 1; },
          "no twin splits the sequence across context-parallel ranks",
          [](TransformerConfig& c) { c.context_parallel_size = 2; }),
  };
}

// The self attention's.
std::vector<LayerFeature> attention_features() {
  return {
      row(
          "multi_latent_attention",
          [](const TransformerConfig& c, const LayerOptions&) { return c.multi_latent_attention; }, {K::Dense, K::MoE},
          "Retro's decoder spec has no multi-latent attention",
          [](TransformerConfig& c, LayerOptions&) { c.multi_latent_attention = true; }),
      none_implement(
          "v_head_dim",
          [](const TransformerConfig& c) {
            return c.multi_latent_attention && c.v_head_dim > c.qk_head_dim + c.qk_pos_emb_head_dim;
          },
          "MLA's value is zero-padded to the query's head dim (qk_head_dim + qk_pos_emb_head_dim), so v_head_dim "
          "must not exceed it",
          [](TransformerConfig& c) {
            c.multi_latent_attention = true;
            c.v_head_dim = c.qk_head_dim + c.qk_pos_emb_head_dim + 8;
          }),
      none_implement(
          "window_size", [](const TransformerConfig& c) { return c.window_size.has_value(); },
          "sliding-window attention has no optimized kernel",
          [](TransformerConfig& c) {
            c.window_size = {{4, 0}};
          }),
      none_implement(
          "softmax_type", [](const TransformerConfig& c) { return c.softmax_type != "vanilla"; },
          "the attention kernel's softmax is vanilla only (no off-by-one or learnable sink)",
          [](TransformerConfig& c) { c.softmax_type = "off-by-one"; }),
      none_implement(
          "attention_output_gate", [](const TransformerConfig& c) { return c.attention_output_gate; },
          "the gated attention output has no optimized kernel",
          [](TransformerConfig& c) { c.attention_output_gate = true; }),
      none_implement(
          "qk_l2_norm", [](const TransformerConfig& c) { return c.qk_l2_norm; },
          "the q/k L2 norm has no optimized kernel", [](TransformerConfig& c) { c.qk_l2_norm = true; }),
      none_implement(
          "kv_channels",
          [](const TransformerConfig& c) {
            return (c.multi_latent_attention ? c.qk_head_dim + c.qk_pos_emb_head_dim : c.head_dim()) > kMaxHeadDim;
          },
          "the attention kernel holds a head (MLA's: qk_head_dim + qk_pos_emb_head_dim) of at most " +
              std::to_string(kMaxHeadDim) + " channels",
          [](TransformerConfig& c) { c.kv_channels = kMaxHeadDim + 8; }),
  };
}

// The norms' and the MLP's.
std::vector<LayerFeature> mlp_features() {
  return {
      none_implement(
          "normalization",
          [](const TransformerConfig& c) { return c.normalization != "LayerNorm" && c.normalization != "RMSNorm"; },
          "the norm kernels are LayerNorm and RMSNorm", [](TransformerConfig& c) { c.normalization = "L2Norm"; }),
      none_implement(
          "bias_activation_fusion", [](const TransformerConfig& c) { return c.bias_activation_fusion; },
          "Megatron's tanh bias_gelu / swiglu fusions are not mirrored (the twin fuses bias and activation with "
          "the unfused path's numerics)",
          [](TransformerConfig& c) { c.bias_activation_fusion = true; }),
      none_implement(
          "activation_func", [](const TransformerConfig& c) { return !has_activation_kernel(c.activation_func); },
          "the activation kernel implements gelu, silu, relu, squared_relu and quick_gelu",
          [](TransformerConfig& c) { c.activation_func = "erf_gelu"; }),
      none_implement(
          "activation_func_clamp_value",
          [](const TransformerConfig& c) { return c.activation_func_clamp_value.has_value(); },
          "the activation kernel does not clamp", [](TransformerConfig& c) { c.activation_func_clamp_value = 7.0; }),
      none_implement(
          "glu_linear_offset", [](const TransformerConfig& c) { return c.glu_linear_offset != 0.0; },
          "the GLU kernel multiplies by the linear half as is (no offset)",
          [](TransformerConfig& c) { c.glu_linear_offset = 1.0; }),
  };
}

// The MoE router's and dispatcher's.
std::vector<LayerFeature> moe_features() {
  return {
      moe_lacks(
          "num_moe_experts", [](const TransformerConfig& c) { return *c.num_moe_experts > kMaxRouterExperts; },
          "the router kernel ranks at most " + std::to_string(kMaxRouterExperts) + " experts per token",
          [](TransformerConfig& c) { c.num_moe_experts = kMaxRouterExperts * 2; }),
      row(
          "expert_model_parallel_size > 1 on the GPU backend",
          [](const TransformerConfig& c, const LayerOptions& o) {
            return has_experts(c) && o.backend == rt::Backend::Cuda && c.expert_model_parallel_size > 1;
          },
          kNone, "one device here: simulate the ranks with Backend::Sim",
          [](TransformerConfig& c, LayerOptions& o) {
            c.expert_model_parallel_size = 2;
            o.backend = rt::Backend::Cuda;
          }),
      moe_lacks(
          "moe_input_jitter_eps", [](const TransformerConfig& c) { return c.moe_input_jitter_eps.has_value(); },
          "the router takes no input jitter", [](TransformerConfig& c) { c.moe_input_jitter_eps = 0.01; }),
      moe_lacks(
          "moe_router_load_balancing_type",
          [](const TransformerConfig& c) { return c.moe_router_load_balancing_type == "sinkhorn"; },
          "sinkhorn load balancing has no optimized kernel",
          [](TransformerConfig& c) {
            c.moe_router_load_balancing_type = "sinkhorn";
            c.moe_aux_loss_coeff = 0.0;
          }),
      moe_lacks(
          "moe_router_force_load_balancing",
          [](const TransformerConfig& c) { return c.moe_router_force_load_balancing; },
          "random benchmark logits are not drawn",
          [](TransformerConfig& c) { c.moe_router_force_load_balancing = true; }),
      moe_lacks(
          "moe_apply_probs_on_input", [](const TransformerConfig& c) { return c.moe_apply_probs_on_input; },
          "the experts apply the probabilities to their output only",
          [](TransformerConfig& c) {
            c.moe_apply_probs_on_input = true;
            c.moe_router_topk = 1;
          }),
      moe_lacks(
          "moe_latent_size", [](const TransformerConfig& c) { return c.moe_latent_size.has_value(); },
          "no latent projection around the experts", [](TransformerConfig& c) { c.moe_latent_size = 4; }),
      moe_lacks(
          "moe_grouped_gemm", [](const TransformerConfig& c) { return c.moe_grouped_gemm; },
          "GroupedMLP's weight layout is not loaded (SequentialMLP's is)",
          [](TransformerConfig& c) { c.moe_grouped_gemm = true; }),
      moe_lacks(
          "moe_token_dispatcher_type",
          [](const TransformerConfig& c) {
            return c.moe_token_dispatcher_type != "allgather" && c.moe_token_dispatcher_type != "alltoall";
          },
          "the dispatchers are allgather and alltoall",
          [](TransformerConfig& c) { c.moe_token_dispatcher_type = "flex"; }),
      moe_lacks(
          "moe_router_score_function",
          [](const TransformerConfig& c) {
            const std::string& fn = c.moe_router_score_function;
            return fn != "softmax" && fn != "sigmoid" && !(c.megatron.sqrtsoftplus && fn == "sqrtsoftplus");
          },
          "the score functions are softmax, sigmoid and, after Megatron-Core 93ddc247, sqrtsoftplus",
          [](TransformerConfig& c) { c.moe_router_score_function = "sqrtsoftplus"; }),
      moe_lacks(
          "moe_router_dtype",
          [](const TransformerConfig& c) {
            return c.moe_router_dtype && *c.moe_router_dtype != "fp32" && *c.moe_router_dtype != "fp64";
          },
          "the router runs in the params dtype, fp32 or fp64",
          [](TransformerConfig& c) { c.moe_router_dtype = "fp16"; }),
  };
}

}  // namespace

const std::vector<LayerFeature>& layer_features() {
  static const std::vector<LayerFeature> rows = [] {
    std::vector<LayerFeature> all;
    for (auto part : {structure_features, attention_features, mlp_features, moe_features})
      for (LayerFeature& f : part()) all.push_back(std::move(f));
    return all;
  }();
  return rows;
}

std::string layer_unsupported(LayerKind kind, const TransformerConfig& c, const LayerOptions& o) {
  for (const LayerFeature& f : layer_features())
    if (!f.supported(kind) && f.requested(c, o)) return f.refusal();
  return "";
}

}  // namespace twin::opt
