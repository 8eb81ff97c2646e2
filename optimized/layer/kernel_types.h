// The choices and limits host code hands the kernels, as plain types shared by both backends:
// the kernels (compiled once for the simulator and once by nvcc, in twin::opt::sim / ::cuda) use
// these same enums, so a plan crosses the backend boundary without conversion and no host file
// names a backend's types.
#pragma once

#include <stdexcept>
#include <string>

namespace twin::opt {

// Limits of the kernels every kind runs (the feature table refuses configs past them).
constexpr int kMaxHeadDim = 256;        // the attention kernel's head dim (kv_channels)
constexpr int kMaxRouterExperts = 256;  // the router kernel's experts per token row

// The activation of linear_fc1's output (activations.cuh).
enum class Act : int { Gelu, Silu, Relu, SquaredRelu, QuickGelu };

// Act for a Megatron activation_func name; invalid_argument for names the kernel does not have.
inline Act act_from_name(const std::string& name) {
  if (name == "gelu") return Act::Gelu;
  if (name == "silu" || name == "swish") return Act::Silu;
  if (name == "relu") return Act::Relu;
  if (name == "squared_relu") return Act::SquaredRelu;
  if (name == "quick_gelu") return Act::QuickGelu;
  throw std::invalid_argument("bias_activation_forward: activation '" + name +
                              "' has no optimized kernel (gelu, silu, relu, squared_relu, quick_gelu)");
}

// The attention's mask (dot_product_attention*.cuh): none, causal, or an explicit BOOL mask.
enum class MaskMode : int { None, Causal, Explicit };

// Megatron's mask for a self-attention: an explicit mask when given; else causal for the
// "causal" attn_mask_type past one token; else none.
inline MaskMode self_attention_mask_mode(bool explicit_mask, const std::string& attn_mask_type, int s) {
  if (explicit_mask) return MaskMode::Explicit;
  return attn_mask_type == "causal" && s > 1 ? MaskMode::Causal : MaskMode::None;
}

// The router's score function and its losses (moe/router.cuh).
enum class ScoreFunction : int { Softmax, Sigmoid, SqrtSoftplus };
enum class AuxLossKind : int { AuxLoss, SeqAuxLoss, GlobalAuxLoss, ZLoss };

// What the attention half's backward kernel sequence does not support, or an empty string.
inline std::string attention_half_backward_unsupported(bool post_ln_residual) {
  if (post_ln_residual) return "apply_residual_connection_post_layernorm";
  return {};
}

}  // namespace twin::opt
