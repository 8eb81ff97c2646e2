#include "core/config.h"

#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>

namespace twin {
namespace {

using json = nlohmann::json;

const char* json_type(const json& v) { return v.type_name(); }

[[noreturn]] void bad_type(const std::string& field, const char* want, const json& v) {
  throw ConfigError("config field '" + field + "': expected " + want + ", got " + json_type(v) + " " + v.dump());
}

// An integer outside int's range is refused, not narrowed: get<int>() would silently wrap it
// (4294967312 would read as 16).
bool is_int(const json& v) {
  if (v.is_number_unsigned())
    return v.get<std::uint64_t>() <= static_cast<std::uint64_t>(std::numeric_limits<int>::max());
  return v.is_number_integer() && v.get<std::int64_t>() >= std::numeric_limits<int>::min() &&
         v.get<std::int64_t>() <= std::numeric_limits<int>::max();
}

void read(const std::string& f, const json& v, int& out) {
  if (!is_int(v)) bad_type(f, v.is_number_integer() ? "an integer within int range" : "an integer", v);
  out = v.get<int>();
}
void read(const std::string& f, const json& v, double& out) {
  if (!v.is_number()) bad_type(f, "a number", v);
  out = v.get<double>();
}
void read(const std::string& f, const json& v, bool& out) {
  if (!v.is_boolean()) bad_type(f, "true or false", v);
  out = v.get<bool>();
}
void read(const std::string& f, const json& v, std::string& out) {
  if (!v.is_string()) bad_type(f, "a string", v);
  out = v.get<std::string>();
}
void read(const std::string& f, const json& v, std::vector<int>& out) {
  if (!v.is_array()) bad_type(f, "a list of integers", v);
  out.clear();
  for (const auto& e : v) {
    if (!is_int(e)) bad_type(f, "a list of integers", v);
    out.push_back(e.get<int>());
  }
}
template <class T>
void read(const std::string& f, const json& v, std::optional<T>& out) {
  if (v.is_null()) {
    out.reset();
    return;
  }
  T t{};
  read(f, v, t);
  out = t;
}

template <class T>
json write(const T& v) {
  return json(v);
}
template <class T>
json write(const std::optional<T>& v) {
  return v ? json(*v) : json(nullptr);
}

// An X-macro list, laid out by hand (clang-format would split the X(...) items).
// clang-format off
#define TWIN_CONFIG_FIELDS(X)                                                                        \
  X(num_layers) X(hidden_size) X(num_attention_heads) X(num_query_groups) X(kv_channels)             \
  X(ffn_hidden_size) X(params_dtype) X(fp16) X(bf16) X(fp32_residual_connection)                      \
  X(attention_softmax_in_fp32) X(apply_query_key_layer_scaling) X(softmax_scale) X(softmax_type)     \
  X(layernorm_epsilon) X(layernorm_zero_centered_gamma) X(normalization) X(qk_layernorm)             \
  X(qk_l2_norm) X(activation_func) X(activation_func_clamp_value) X(gated_linear_unit)               \
  X(glu_linear_offset) X(add_bias_linear) X(add_qkv_bias) X(attention_output_gate)                    \
  X(apply_residual_connection_post_layernorm) X(hidden_dropout) X(attention_dropout) X(window_size)  \
  X(position_embedding_type) X(rotary_interleaved) X(rotary_percent) X(rotary_base)                  \
  X(multi_latent_attention) X(q_lora_rank) X(kv_lora_rank) X(qk_head_dim) X(qk_pos_emb_head_dim)      \
  X(v_head_dim) X(rope_type) X(rotary_scaling_factor) X(original_max_position_embeddings)            \
  X(beta_fast) X(beta_slow) X(mscale) X(mscale_all_dim)                                              \
  X(apply_rope_fusion) X(bias_activation_fusion) X(bias_dropout_fusion) X(masked_softmax_fusion)     \
  X(calculate_per_token_loss) X(test_mode) X(tensor_model_parallel_size)                              \
  X(pipeline_model_parallel_size) X(virtual_pipeline_model_parallel_size) X(context_parallel_size)   \
  X(expert_model_parallel_size) X(sequence_parallel) X(num_layers_in_first_pipeline_stage)           \
  X(num_layers_in_last_pipeline_stage) X(account_for_embedding_in_pipeline_split)                    \
  X(account_for_loss_in_pipeline_split) X(seq_length) X(micro_batch_size) X(attn_mask_type)          \
  X(context_shape) X(num_moe_experts) X(moe_ffn_hidden_size) X(moe_router_topk)                      \
  X(moe_router_load_balancing_type) X(moe_router_score_function) X(moe_router_pre_softmax)           \
  X(moe_router_num_groups) X(moe_router_group_topk) X(moe_router_topk_scaling_factor)                \
  X(moe_router_dtype) X(moe_router_enable_expert_bias) X(moe_router_bias_update_rate)                \
  X(moe_router_force_load_balancing) X(moe_router_fusion) X(moe_router_topk_limited_devices)         \
  X(moe_router_padding_for_fp8) X(moe_router_padding_for_quantization) X(moe_aux_loss_coeff)         \
  X(moe_z_loss_coeff) X(moe_input_jitter_eps) X(moe_expert_capacity_factor)                          \
  X(moe_pad_expert_input_to_capacity) X(moe_token_drop_policy) X(moe_token_dispatcher_type)          \
  X(moe_shared_expert_intermediate_size) X(moe_shared_expert_gate) X(moe_shared_expert_overlap)      \
  X(moe_grouped_gemm) X(moe_use_legacy_grouped_gemm) X(moe_permute_fusion)                           \
  X(moe_apply_probs_on_input) X(moe_per_layer_logging) X(moe_layer_freq) X(moe_latent_size)         \
  X(moe_deepep_num_sms) X(moe_spec) X(retro_chunk_length) X(retro_num_neighbors)                     \
  X(retro_num_retrieved_chunks) X(retro_retrieved_length) X(retro_encoder_num_layers)                \
  X(retro_encoder_hidden_dropout) X(retro_encoder_attention_dropout) X(retro_block_size)             \
  X(retro_l_chunks) X(retro_r) X(retro_neighbor_dirs) X(retro_project_dir)                           \
  X(retro_split_preprocessing) X(retro_verify_neighbor_count)
// clang-format on

using Reader = std::function<void(TransformerConfig&, const json&)>;

const std::map<std::string, Reader>& readers() {
  static const std::map<std::string, Reader> m = {
#define X(name) {#name, [](TransformerConfig& c, const json& v) { read(#name, v, c.name); }},
      TWIN_CONFIG_FIELDS(X)
#undef X
  };
  return m;
}

}  // namespace

const std::vector<std::string>& transformer_config_fields() {
  static const std::vector<std::string> names = {
#define X(name) #name,
      TWIN_CONFIG_FIELDS(X)
#undef X
  };
  return names;
}

TransformerConfig parse_transformer_config(const json& j) {
  if (!j.is_object()) throw ConfigError(std::string("config: expected a JSON object, got ") + j.type_name());
  TransformerConfig c;
  const auto& r = readers();
  for (const auto& [key, value] : j.items()) {
    auto it = r.find(key);
    if (it == r.end()) throw ConfigError("config field '" + key + "' is unknown");
    it->second(c, value);
  }
  return c;
}

TransformerConfig parse_transformer_config(const std::string& text) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    // Every way the text can fail to be JSON is a ConfigError: syntax errors (parse_error) and
    // numbers beyond double's range such as 1e400 (nlohmann reports those as out_of_range).
    throw ConfigError(std::string("config is not valid JSON: ") + e.what());
  }
  return parse_transformer_config(j);
}

json to_json(const TransformerConfig& c) {
  json j = json::object();
#define X(name) j[#name] = write(c.name);
  TWIN_CONFIG_FIELDS(X)
#undef X
  return j;
}

DType params_dtype(const TransformerConfig& c) {
  if (c.bf16) return DType::BF16;
  if (c.fp16) return DType::F16;
  const auto dt = dtype_from_any_name(c.params_dtype);
  if (!dt || (*dt != DType::F32 && *dt != DType::BF16 && *dt != DType::F16))
    throw ConfigError("params_dtype: unsupported value '" + c.params_dtype + "' (float32, bfloat16 or float16)");
  return *dt;
}

}  // namespace twin
