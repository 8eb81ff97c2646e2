// TransformerConfig: the fields of megatron.core.transformer.TransformerConfig (and the MoE and
// Retro fields) that the twins read, parsed from a fixture's `config` JSON.
//
// Parsing is strict: a field this struct does not know, or a value of the wrong JSON type, is a
// ConfigError naming the field. Semantic validation (Megatron's __post_init__) lives in
// reference/transformer_config.h, next to the code whose assumptions it protects.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "core/dtype.h"

namespace twin {

struct ConfigError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

// Which Megatron-Core's numbers the twins reproduce where two commits differ: each switch is one
// such difference, read by the code that computes it (core/megatron_commit.h picks them from a
// golden's commit). Every switch off is the January pin.
struct MegatronSwitches {
  // TopKRouter: the scores stay in fp32 through top-k, the sigmoid renormalisation and the scaling
  // factor, with one cast to the logits' dtype at the end (the pin stores the score function's
  // output in the logits' dtype first). Differs where the logits are not fp32.
  bool router_scores_fp32 = false;
  // compute_routing_scores_for_aux_loss: sigmoid (and sqrtsoftplus) scores and their
  // normalisation in fp32; the pin keeps them in the logits' dtype.
  bool aux_loss_scores_fp32 = false;
  // moe_router_score_function "sqrtsoftplus" exists: sqrt(softplus(logits)) in fp32 on the sigmoid
  // path (renormalised over the top k when k > 1, expert bias allowed).
  bool sqrtsoftplus = false;
};

struct TransformerConfig {
  // --- model shape
  int num_layers = 1;
  int hidden_size = 0;
  int num_attention_heads = 0;
  std::optional<int> num_query_groups;  // None -> num_attention_heads
  std::optional<int> kv_channels;       // None -> hidden_size / num_attention_heads
  std::optional<int> ffn_hidden_size;   // None -> 4 * hidden_size

  // --- numerics
  std::string params_dtype = "float32";
  bool fp16 = false;
  bool bf16 = false;
  bool fp32_residual_connection = false;
  bool attention_softmax_in_fp32 = true;
  bool apply_query_key_layer_scaling = false;
  std::optional<double> softmax_scale;
  std::string softmax_type = "vanilla";
  double layernorm_epsilon = 1e-5;
  bool layernorm_zero_centered_gamma = false;
  std::string normalization = "LayerNorm";  // LayerNorm | RMSNorm
  bool qk_layernorm = false;
  bool qk_l2_norm = false;
  std::string activation_func = "gelu";  // gelu | silu | relu | squared_relu | quick_gelu | ...
  std::optional<double> activation_func_clamp_value;
  bool gated_linear_unit = false;
  double glu_linear_offset = 0.0;
  bool add_bias_linear = true;
  bool add_qkv_bias = false;
  bool attention_output_gate = false;
  bool apply_residual_connection_post_layernorm = false;
  double hidden_dropout = 0.1;
  double attention_dropout = 0.1;
  std::optional<std::vector<int>> window_size;

  // --- position embedding (RoPE angles arrive as an input tensor)
  std::string position_embedding_type = "none";  // none | rope | learned_absolute
  bool rotary_interleaved = false;
  double rotary_percent = 1.0;
  double rotary_base = 10000;

  // --- fusion flags (no numeric effect in the twins; kept so configs round-trip)
  // Multi-latent attention (MLATransformerConfig): the layer's self attention is MLASelfAttention,
  // with these sizes, and it computes its own rotary embedding (rope_type "rope": RotaryEmbedding
  // of qk_pos_emb_head_dim with rotary_percent; "yarn": YarnRotaryEmbedding with the fields below).
  bool multi_latent_attention = false;
  std::optional<int> q_lora_rank = 512;  // None: linear_q_proj instead of the q down / up projections
  int kv_lora_rank = 512;
  int qk_head_dim = 128;
  int qk_pos_emb_head_dim = 64;
  int v_head_dim = 128;
  std::string rope_type = "yarn";  // rope | yarn (MLA only)
  double rotary_scaling_factor = 40;
  int original_max_position_embeddings = 4096;
  double beta_fast = 32;
  double beta_slow = 1;
  double mscale = 1.0;
  double mscale_all_dim = 0.0;

  bool apply_rope_fusion = false;
  bool bias_activation_fusion = false;
  bool bias_dropout_fusion = false;
  bool masked_softmax_fusion = false;
  bool calculate_per_token_loss = false;
  bool test_mode = false;

  // --- parallelism
  int tensor_model_parallel_size = 1;
  int pipeline_model_parallel_size = 1;
  std::optional<int> virtual_pipeline_model_parallel_size;
  int context_parallel_size = 1;
  int expert_model_parallel_size = 1;
  bool sequence_parallel = false;
  std::optional<int> num_layers_in_first_pipeline_stage;
  std::optional<int> num_layers_in_last_pipeline_stage;
  bool account_for_embedding_in_pipeline_split = false;
  bool account_for_loss_in_pipeline_split = false;

  // --- run description (fixtures record these beside the config)
  int seq_length = 0;
  int micro_batch_size = 1;
  std::string attn_mask_type = "causal";
  std::optional<std::vector<int>> context_shape;

  // --- MoE
  std::optional<int> num_moe_experts;
  std::optional<int> moe_ffn_hidden_size;
  int moe_router_topk = 2;
  std::string moe_router_load_balancing_type =
      "aux_loss";  // aux_loss | seq_aux_loss | global_aux_loss | sinkhorn | none (or a list)
  std::string moe_router_score_function = "softmax";  // softmax | sigmoid | sqrtsoftplus (megatron.sqrtsoftplus)
  bool moe_router_pre_softmax = false;
  std::optional<int> moe_router_num_groups;
  std::optional<int> moe_router_group_topk;
  std::optional<double> moe_router_topk_scaling_factor;
  std::optional<std::string> moe_router_dtype;  // None | fp32 | fp64
  bool moe_router_enable_expert_bias = false;
  double moe_router_bias_update_rate = 1e-3;
  bool moe_router_force_load_balancing = false;
  bool moe_router_fusion = false;
  std::optional<int> moe_router_topk_limited_devices;
  bool moe_router_padding_for_fp8 = false;
  bool moe_router_padding_for_quantization = false;
  double moe_aux_loss_coeff = 0.0;
  std::optional<double> moe_z_loss_coeff;
  std::optional<double> moe_input_jitter_eps;
  std::optional<double> moe_expert_capacity_factor;
  bool moe_pad_expert_input_to_capacity = false;
  std::string moe_token_drop_policy = "probs";          // probs | position
  std::string moe_token_dispatcher_type = "allgather";  // allgather | alltoall | flex
  std::optional<int> moe_shared_expert_intermediate_size;
  bool moe_shared_expert_gate = false;
  bool moe_shared_expert_overlap = false;
  bool moe_grouped_gemm = false;
  bool moe_use_legacy_grouped_gemm = false;
  bool moe_permute_fusion = false;
  bool moe_apply_probs_on_input = false;
  bool moe_per_layer_logging = false;
  int moe_layer_freq = 1;
  std::optional<int> moe_latent_size;
  std::optional<int> moe_deepep_num_sms = 20;  // DeepEP only; null (the default) after the January pin
  std::string moe_spec;

  // --- not a TransformerConfig field: whose semantics (set from a golden's commit, never parsed)
  MegatronSwitches megatron;

  // --- Retro
  std::optional<int> retro_chunk_length;
  std::optional<int> retro_num_neighbors;
  std::optional<int> retro_num_retrieved_chunks;
  std::optional<int> retro_retrieved_length;
  std::optional<int> retro_encoder_num_layers;
  std::optional<double> retro_encoder_hidden_dropout;
  std::optional<double> retro_encoder_attention_dropout;
  std::optional<int> retro_block_size;
  std::optional<int> retro_l_chunks;
  std::optional<int> retro_r;
  std::optional<std::string> retro_neighbor_dirs;
  std::optional<std::string> retro_project_dir;
  std::optional<std::string> retro_split_preprocessing;
  std::optional<bool> retro_verify_neighbor_count;

  // Derived values with Megatron's defaults applied.
  int query_groups() const { return num_query_groups.value_or(num_attention_heads); }
  int head_dim() const { return kv_channels.value_or(num_attention_heads ? hidden_size / num_attention_heads : 0); }
  int ffn() const { return ffn_hidden_size.value_or(4 * hidden_size); }
};

// Strict parse: unknown fields and wrongly typed values throw ConfigError naming the field.
TransformerConfig parse_transformer_config(const nlohmann::json& j);
TransformerConfig parse_transformer_config(const std::string& json_text);
nlohmann::json to_json(const TransformerConfig& c);
// The names of every field the parser knows, in declaration order.
const std::vector<std::string>& transformer_config_fields();

// The dtype Megatron keeps parameters and activations in: the bf16 / fp16 flags win (as
// Float16Module casts the model), else params_dtype. ConfigError for anything but float32,
// bfloat16 and float16.
DType params_dtype(const TransformerConfig& c);

}  // namespace twin
