// Mirrors the checks of ModelParallelConfig.__post_init__ and TransformerConfig.__post_init__
// (Megatron-LM 93ddc247) that concern the fields in core/config.h, in Megatron's order, and
// RetroConfig.__post_init__. Checks marked "twin:" are ours: Megatron accepts those configs in
// __post_init__ but fails later (module constructors, torch.topk).
#include "reference/transformer_config.h"

#include <string>

#include "reference/transformer_layer_offset.h"

namespace twin::reference {

namespace {

std::string str(std::optional<int> v) { return v ? std::to_string(*v) : "None"; }
std::string str(bool v) { return v ? "True" : "False"; }
std::string str(int v) { return std::to_string(v); }
std::string str(std::int64_t v) { return std::to_string(v); }

[[noreturn]] void reject(const std::string& message) { throw ConfigError("TransformerConfig: " + message); }

// Python's a % b on config ints; b == 0 is a ConfigError naming the divisor (Megatron raises
// ZeroDivisionError there, which rejects the config just the same).
std::int64_t mod(std::int64_t a, std::int64_t b, const char* divisor) {
  if (b == 0) reject(std::string(divisor) + " is 0 (Megatron: ZeroDivisionError)");
  return py_mod(a, b, divisor);
}
std::int64_t floordiv(std::int64_t a, std::int64_t b, const char* divisor) {
  if (b == 0) reject(std::string(divisor) + " is 0 (Megatron: ZeroDivisionError)");
  return py_floordiv(a, b, divisor);
}

bool is_one_of(const std::string& v, std::initializer_list<const char*> options) {
  for (const char* o : options)
    if (v == o) return true;
  return false;
}

// ModelParallelConfig.__post_init__.
void validate_model_parallel_config(const TransformerConfig& c) {
  if (c.sequence_parallel && c.tensor_model_parallel_size <= 1)
    reject(
        "Cannot use sequence parallelism without tensor parallelism (sequence_parallel=True, "
        "tensor_model_parallel_size=" +
        str(c.tensor_model_parallel_size) + ")");
  // pipeline_dtype (required when pipeline_model_parallel_size > 1) is not a twin field: the
  // twins run one stage on one device.
}

// The pipeline split: uneven first / last stages, or the embedding / loss taking a slot.
void validate_pipeline_split(const TransformerConfig& c) {
  const auto first = c.num_layers_in_first_pipeline_stage;
  const auto last = c.num_layers_in_last_pipeline_stage;
  const auto vp = c.virtual_pipeline_model_parallel_size;

  if ((first || last) && (c.account_for_embedding_in_pipeline_split || c.account_for_loss_in_pipeline_split))
    reject(
        "num_layers_in_first_pipeline_stage and num_layers_in_last_pipeline_stage cannot be set at the same "
        "time with account_for_embedding_in_pipeline_split and account_for_loss_in_pipeline_split "
        "(num_layers_in_first_pipeline_stage=" +
        str(first) + ", num_layers_in_last_pipeline_stage=" + str(last) +
        ", account_for_embedding_in_pipeline_split=" + str(c.account_for_embedding_in_pipeline_split) +
        ", account_for_loss_in_pipeline_split=" + str(c.account_for_loss_in_pipeline_split) + ")");

  if (first || last) {
    // Uneven PP.
    std::int64_t pipeline_parallel_size = c.pipeline_model_parallel_size;
    std::int64_t num_layers = c.num_layers;

    if (first) {
      if (*first <= 0) reject("num_layers_in_first_pipeline_stage must be larger than 0, got " + str(first));
      if (vp && mod(*first, *vp, "virtual_pipeline_model_parallel_size") != 0)
        reject("number of layers at first stage: " + str(first) +
               " must be divisible by virtual pipeline parallel degree " + str(vp) +
               " (num_layers_in_first_pipeline_stage % virtual_pipeline_model_parallel_size != 0)");
      num_layers -= *first;
      pipeline_parallel_size -= 1;
    }
    if (last) {
      if (*last <= 0) reject("num_layers_in_last_pipeline_stage must be larger than 0, got " + str(last));
      if (vp && mod(*last, *vp, "virtual_pipeline_model_parallel_size") != 0)
        reject("number of layers at last stage: " + str(last) +
               " must be divisible by virtual pipeline parallel degree " + str(vp) +
               " (num_layers_in_last_pipeline_stage % virtual_pipeline_model_parallel_size != 0)");
      num_layers -= *last;
      pipeline_parallel_size -= 1;
    }

    // pipeline_parallel_size is now the number of middle stages (Python truthiness: != 0).
    if (pipeline_parallel_size != 0 && mod(num_layers, pipeline_parallel_size, "middle pipeline stages") != 0)
      reject("number of layers at middle stage: " + str(num_layers) +
             " must be divisible by the middle pipeline model parallel size " + str(pipeline_parallel_size) +
             " (num_layers=" + str(c.num_layers) + ", pipeline_model_parallel_size=" +
             str(c.pipeline_model_parallel_size) + ", first=" + str(first) + ", last=" + str(last) + ")");

    if (pipeline_parallel_size != 0 && vp) {
      const std::int64_t num_layers_per_middle_pipeline_rank =
          floordiv(num_layers, pipeline_parallel_size, "middle pipeline stages");
      if (mod(num_layers_per_middle_pipeline_rank, *vp, "virtual_pipeline_model_parallel_size") != 0)
        reject("number of layers on each middle pipeline rank: " + str(num_layers_per_middle_pipeline_rank) +
               " must be divisible by virtual pipeline parallel degree " + str(vp));
    }
  } else if (c.account_for_embedding_in_pipeline_split || c.account_for_loss_in_pipeline_split) {
    std::int64_t num_layers = c.num_layers;
    if (c.account_for_embedding_in_pipeline_split) num_layers += 1;
    if (c.account_for_loss_in_pipeline_split) num_layers += 1;
    const std::string accounted =
        "(num_layers=" + str(c.num_layers) + " plus " +
        (c.account_for_embedding_in_pipeline_split ? "the embedding" : "") +
        (c.account_for_embedding_in_pipeline_split && c.account_for_loss_in_pipeline_split ? " and " : "") +
        (c.account_for_loss_in_pipeline_split ? "the loss" : "") + ")";

    if (!vp) {
      if (mod(num_layers, c.pipeline_model_parallel_size, "pipeline_model_parallel_size") != 0)
        reject("number of middle layers: " + str(num_layers) +
               " must be divisible by middle "
               "pipeline_model_parallel_size " +
               str(c.pipeline_model_parallel_size) + " " + accounted);
    } else {
      if (mod(num_layers, c.pipeline_model_parallel_size, "pipeline_model_parallel_size") != 0)
        reject("num_layers: " + str(num_layers) +
               " after enable account_for_embedding_in_pipeline_split or "
               "account_for_loss_in_pipeline_split must be divisible by pipeline_model_parallel_size " +
               str(c.pipeline_model_parallel_size) + " " + accounted);
      const std::int64_t num_layers_per_pipeline_rank =
          floordiv(num_layers, c.pipeline_model_parallel_size, "pipeline_model_parallel_size");
      if (mod(num_layers_per_pipeline_rank, *vp, "virtual_pipeline_model_parallel_size") != 0)
        reject("number of layers on each pipeline rank: " + str(num_layers_per_pipeline_rank) +
               " (after enable account_for_embedding_in_pipeline_split or account_for_loss_in_pipeline_split) "
               "must be divisible by virtual_pipeline_model_parallel_size " +
               str(vp) + " " + accounted);
    }
  }
}

// The MoE checks of TransformerConfig.__post_init__.
void validate_moe(const TransformerConfig& c) {
  if (c.expert_model_parallel_size > 1 && !c.num_moe_experts)
    reject("num_moe_experts must be non None to use expert-parallel (expert_model_parallel_size=" +
           str(c.expert_model_parallel_size) + ")");
  if (c.num_moe_experts && *c.num_moe_experts <= 0)
    reject("num_moe_experts must be positive, got " + str(c.num_moe_experts));
  if (!c.num_moe_experts && c.moe_ffn_hidden_size)
    reject("moe_ffn_hidden_size must be None when num_moe_experts is not set (moe_ffn_hidden_size=" +
           str(c.moe_ffn_hidden_size) + ")");

  // moe_flex_dispatcher_backend defaults to "deepep" (not a twin field).
  if (c.moe_token_dispatcher_type == "flex" && c.moe_pad_expert_input_to_capacity)
    reject("Flex token dispatcher with deepep backend does not support moe_pad_expert_input_to_capacity");

  if (c.moe_shared_expert_intermediate_size) {
    if (*c.moe_shared_expert_intermediate_size <= 0)
      reject(
          "moe_shared_expert_intermediate_size must be num_shared_experts * ffn_size_of_each_shared_expert, "
          "but got " +
          str(c.moe_shared_expert_intermediate_size));
    if (c.moe_shared_expert_overlap && c.moe_token_dispatcher_type != "alltoall")
      reject("moe_shared_expert_overlap only works with alltoall token dispatcher (moe_token_dispatcher_type='" +
             c.moe_token_dispatcher_type + "')");
  }

  // A negative capacity factor means None.
  std::optional<double> capacity_factor = c.moe_expert_capacity_factor;
  if (capacity_factor && *capacity_factor < 0) capacity_factor.reset();
  if (c.moe_expert_capacity_factor &&
      !is_one_of(c.moe_router_load_balancing_type, {"aux_loss", "seq_aux_loss", "global_aux_loss", "none"}))
    reject(
        "moe_expert_capacity_factor only works with aux_loss, seq_aux_loss, global_aux_loss or none load "
        "balancing (moe_router_load_balancing_type='" +
        c.moe_router_load_balancing_type + "')");
  if (c.moe_pad_expert_input_to_capacity && !capacity_factor)
    reject("moe_expert_capacity_factor must be set to use moe_pad_expert_input_to_capacity");
}

void validate_moe_router(const TransformerConfig& c) {
  // expert_tensor_parallel_size defaults to tensor_model_parallel_size.
  if (c.num_moe_experts && c.add_bias_linear && c.tensor_model_parallel_size != 1)
    reject(
        "Bias in Moe is only supported when ETP==1 (expert_tensor_parallel_size defaults to "
        "tensor_model_parallel_size=" +
        str(c.tensor_model_parallel_size) + ", add_bias_linear=True)");

  if (c.moe_router_enable_expert_bias && c.moe_router_score_function != "sigmoid" &&
      !(c.megatron.sqrtsoftplus && c.moe_router_score_function == "sqrtsoftplus"))
    reject(c.megatron.sqrtsoftplus
               ? "Expert bias for aux-loss-free routing only supports 'sigmoid' and 'sqrtsoftplus' score functions. "
                 "Please set --moe-router-score-function to 'sigmoid' or 'sqrtsoftplus', or unset "
                 "--moe-router-enable-expert-bias."
               : "Expert bias for aux-loss-free routing only supports sigmoid score function "
                 "(moe_router_enable_expert_bias=True, moe_router_score_function='" +
                     c.moe_router_score_function + "')");

  // moe_router_padding_for_fp8 turns on padding_for_quantization, which needs fp8 / fp4; the
  // twins have neither, so Megatron's "fp8 is None and fp4 is None" always holds.
  if (c.moe_router_padding_for_fp8 || c.moe_router_padding_for_quantization)
    reject(
        "fp8/fp4 must be specified when moe_router_padding_for_quantization is True "
        "(moe_router_padding_for_fp8=" +
        str(c.moe_router_padding_for_fp8) +
        ", moe_router_padding_for_quantization=" + str(c.moe_router_padding_for_quantization) + ")");

  if (c.moe_router_topk == 1 && c.moe_router_score_function == "softmax" && !c.moe_router_pre_softmax &&
      c.moe_router_load_balancing_type != "sinkhorn")
    // softmax over the single selected expert would be 1 with a zero gradient.
    reject(
        "Please use --moe-router-pre-softmax when topk is 1 (moe_router_topk=1, "
        "moe_router_score_function='softmax', moe_router_pre_softmax=False)");

  if (c.moe_router_group_topk && *c.moe_router_group_topk != 0) {
    if (c.moe_router_topk_limited_devices && *c.moe_router_topk_limited_devices != 0)
      reject(
          "moe_router_topk_limited_devices is deprecated and replaced by moe_router_group_topk and "
          "moe_router_num_groups");
    if (!c.moe_router_num_groups || *c.moe_router_num_groups == 0)
      reject(
          "When using group limited routing, moe_router_num_groups must be specified "
          "(moe_router_group_topk=" +
          str(c.moe_router_group_topk) + ")");
    if (!c.num_moe_experts) reject("moe_router_group_topk is set but num_moe_experts is None");
    if (mod(*c.num_moe_experts, *c.moe_router_num_groups, "moe_router_num_groups") != 0)
      reject("num_moe_experts (" + str(c.num_moe_experts) + ") should be divisible by moe_router_num_groups (" +
             str(c.moe_router_num_groups) + ")");
    if (*c.moe_router_group_topk > *c.moe_router_num_groups)
      reject("moe_router_group_topk (" + str(c.moe_router_group_topk) +
             ") should be smaller than moe_router_num_groups (" + str(c.moe_router_num_groups) + ")");
  }

  if (c.num_moe_experts) {
    // twin: torch.topk fails at run time on these.
    if (c.moe_router_topk < 1) reject("twin: moe_router_topk must be >= 1, got " + str(c.moe_router_topk));
    if (c.moe_router_topk > *c.num_moe_experts)
      reject("twin: moe_router_topk (" + str(c.moe_router_topk) + ") must be <= num_moe_experts (" +
             str(c.num_moe_experts) + ")");
  }
}

// bias_activation_fusion restricts the activation (activation_func is a name here).
void validate_bias_activation_fusion(const TransformerConfig& c) {
  if (!c.bias_activation_fusion) return;
  const std::string& act = c.activation_func;
  if (!is_one_of(act, {"gelu", "silu", "quick_gelu"}))
    reject(
        "When bias_activation_fusion is True, activation function should be either gelu, swiglu, or "
        "quick_geglu (activation_func='" +
        act + "')");
  if (act == "gelu" && !c.gated_linear_unit && !c.add_bias_linear)
    reject(
        "When bias_activation_fusion is True, gated_linear_unit is False and activation function is gelu, "
        "add_bias_linear must also be True");
  if (act == "quick_gelu" && !c.gated_linear_unit)
    reject(
        "When bias_activation_fusion is True and activation function is quick_gelu, gated_linear_unit must "
        "be True");
  if (c.glu_linear_offset != 0.0 && act != "quick_gelu")
    reject(
        "When bias_activation_fusion is True and glu_linear_offset is non-zero, activation function must be "
        "quick_gelu (glu_linear_offset=" +
        std::to_string(c.glu_linear_offset) + ")");
}

}  // namespace

void validate_transformer_config(const TransformerConfig& c) {
  validate_model_parallel_config(c);

  if (c.fp16 && c.bf16) reject("Only one of fp16: True and bf16: True should be True");

  if (c.tensor_model_parallel_size <= 0)
    reject("tensor_model_parallel_size must be >= 1, got " + str(c.tensor_model_parallel_size));
  // twin: Megatron divides hidden_size by num_attention_heads (ZeroDivisionError on 0).
  if (c.num_attention_heads <= 0) reject("num_attention_heads must be >= 1, got " + str(c.num_attention_heads));
  if (mod(c.num_attention_heads, c.tensor_model_parallel_size, "tensor_model_parallel_size") != 0)
    reject("num_attention_heads (" + str(c.num_attention_heads) +
           ") must be a multiple of "
           "tensor_model_parallel_size (" +
           str(c.tensor_model_parallel_size) + ")");

  // kv_channels None -> hidden_size // num_attention_heads (floored; Megatron accepts a hidden
  // size that heads do not divide, then query_projection_size != hidden_size).
  if (c.kv_channels && *c.kv_channels <= 0)
    reject("twin: kv_channels must be >= 1, got " + str(c.kv_channels));  // an empty head
  if (!c.kv_channels && c.hidden_size / c.num_attention_heads <= 0)
    reject("twin: kv_channels = hidden_size // num_attention_heads = " + str(c.hidden_size) + " // " +
           str(c.num_attention_heads) + " is not >= 1; set kv_channels or a larger hidden_size");

  const int num_query_groups = c.query_groups();
  if (num_query_groups <= 0) reject("twin: num_query_groups must be >= 1, got " + str(num_query_groups));
  if (mod(num_query_groups, c.tensor_model_parallel_size, "tensor_model_parallel_size") != 0 &&
      mod(c.tensor_model_parallel_size, num_query_groups, "num_query_groups") != 0)
    reject("num_query_groups (" + str(num_query_groups) +
           ") must be a multiple or divisor of "
           "tensor_model_parallel_size (" +
           str(c.tensor_model_parallel_size) + ")");
  // twin: attention shares each key/value head between heads / groups query heads; Megatron's
  // divide() / repeat_interleave fail later when they do not divide.
  if (c.num_attention_heads % num_query_groups != 0)
    reject("num_attention_heads (" + str(c.num_attention_heads) + ") must be divisible by num_query_groups (" +
           str(num_query_groups) + ")");

  validate_moe(c);
  validate_pipeline_split(c);
  validate_bias_activation_fusion(c);
  validate_moe_router(c);

  if (c.pipeline_model_parallel_size <= 0)
    reject("Pipeline model parallel size must be larger than 0, got pipeline_model_parallel_size=" +
           str(c.pipeline_model_parallel_size));

  // output_layer_init_method: init_method_std / sqrt(2 * num_layers) fails for num_layers <= 0.
  if (c.num_layers <= 0) reject("num_layers must be >= 1, got " + str(c.num_layers));
}

RetroConfig validate_retro_config(const TransformerConfig& c) {
  validate_transformer_config(c);

  auto retro_reject = [](const std::string& m) -> void { throw ConfigError("RetroConfig: " + m); };
  RetroConfig r;
  if (!c.retro_split_preprocessing)
    retro_reject("retro_split_preprocessing must be set (Megatron asserts it is not None)");
  r.retro_split_preprocessing = *c.retro_split_preprocessing;

  if (!c.retro_chunk_length)
    retro_reject(
        "retro_chunk_length must be set (retro_retrieved_length = retro_num_retrieved_chunks * "
        "retro_chunk_length)");
  r.retro_chunk_length = *c.retro_chunk_length;
  r.retro_num_neighbors = c.retro_num_neighbors.value_or(r.retro_num_neighbors);
  r.retro_num_retrieved_chunks = c.retro_num_retrieved_chunks.value_or(r.retro_num_retrieved_chunks);
  r.retro_encoder_num_layers = c.retro_encoder_num_layers.value_or(r.retro_encoder_num_layers);
  r.retro_encoder_hidden_dropout = c.retro_encoder_hidden_dropout.value_or(r.retro_encoder_hidden_dropout);
  r.retro_encoder_attention_dropout = c.retro_encoder_attention_dropout.value_or(r.retro_encoder_attention_dropout);
  r.retro_block_size = c.retro_block_size;
  r.retro_verify_neighbor_count = c.retro_verify_neighbor_count.value_or(true);

  // twin: chunking, retrieval and the encoder need at least one of each.
  if (r.retro_chunk_length < 1) retro_reject("twin: retro_chunk_length must be >= 1, got " + str(r.retro_chunk_length));
  if (r.retro_num_neighbors < 1)
    retro_reject("twin: retro_num_neighbors must be >= 1, got " + str(r.retro_num_neighbors));
  if (r.retro_num_retrieved_chunks < 1)
    retro_reject("twin: retro_num_retrieved_chunks must be >= 1, got " + str(r.retro_num_retrieved_chunks));
  if (r.retro_encoder_num_layers < 1)
    retro_reject("twin: retro_encoder_num_layers must be >= 1 (layer 1 is the Retro encoder layer), got " +
                 str(r.retro_encoder_num_layers));
  if (!(r.retro_encoder_hidden_dropout >= 0.0 && r.retro_encoder_hidden_dropout <= 1.0))
    retro_reject("twin: retro_encoder_hidden_dropout must be in [0, 1], got " +
                 std::to_string(r.retro_encoder_hidden_dropout));
  if (!(r.retro_encoder_attention_dropout >= 0.0 && r.retro_encoder_attention_dropout <= 1.0))
    retro_reject("twin: retro_encoder_attention_dropout must be in [0, 1], got " +
                 std::to_string(r.retro_encoder_attention_dropout));

  // Pre-compute retrieved length.
  r.retro_retrieved_length = r.retro_num_retrieved_chunks * r.retro_chunk_length;
  if (c.retro_retrieved_length && *c.retro_retrieved_length != r.retro_retrieved_length)
    retro_reject("retro_retrieved_length (" + str(c.retro_retrieved_length) +
                 ") must equal retro_num_retrieved_chunks * retro_chunk_length = " + str(r.retro_num_retrieved_chunks) +
                 " * " + str(r.retro_chunk_length) + " = " + str(r.retro_retrieved_length));
  return r;
}

}  // namespace twin::reference
