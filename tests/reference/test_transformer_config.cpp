// validate_transformer_config / validate_retro_config: each check Megatron's __post_init__ makes
// rejects its combination with a message naming the fields, the neighbouring valid combination is
// accepted, and every golden fixture's config is accepted.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <functional>
#include <string>

#include "fixtures/fixture.h"
#include "reference/transformer_config.h"

using namespace twin;
using namespace twin::reference;

namespace {

TransformerConfig base() {
  TransformerConfig c;
  c.num_layers = 2;
  c.hidden_size = 64;
  c.num_attention_heads = 4;
  return c;
}

// Runs validation on base() changed by `edit`; returns the message, or "" when accepted.
std::string message_for(const std::function<void(TransformerConfig&)>& edit) {
  TransformerConfig c = base();
  edit(c);
  try {
    validate_transformer_config(c);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

::testing::AssertionResult rejected_with(const std::string& message, const std::string& needle) {
  if (message.empty())
    return ::testing::AssertionFailure() << "accepted; expected an error containing '" << needle << "'";
  if (message.find(needle) == std::string::npos)
    return ::testing::AssertionFailure() << "message '" << message << "' lacks '" << needle << "'";
  return ::testing::AssertionSuccess();
}

}  // namespace

TEST(TransformerConfigValidation, BaseIsAccepted) {
  EXPECT_EQ(message_for([](auto&) {}), "");
}

TEST(TransformerConfigValidation, HeadsAndQueryGroups) {
  EXPECT_TRUE(rejected_with(message_for([](auto& c) { c.num_query_groups = 3; }),
                            "num_attention_heads (4) must be divisible by num_query_groups (3)"));
  EXPECT_EQ(message_for([](auto& c) { c.num_query_groups = 2; }), "");  // GQA
  EXPECT_EQ(message_for([](auto& c) { c.num_query_groups = 1; }), "");  // MQA
  EXPECT_TRUE(rejected_with(message_for([](auto& c) { c.num_query_groups = 0; }), "num_query_groups must be >= 1"));
  EXPECT_TRUE(
      rejected_with(message_for([](auto& c) { c.num_attention_heads = 0; }), "num_attention_heads must be >= 1"));
  // Megatron floors kv_channels = hidden // heads and accepts a hidden size heads do not divide.
  EXPECT_EQ(message_for([](auto& c) {
              c.num_attention_heads = 3;
              c.hidden_size = 64;
            }),
            "");
  EXPECT_TRUE(rejected_with(message_for([](auto& c) { c.hidden_size = 2; }),
                            "kv_channels = hidden_size // num_attention_heads"));
  EXPECT_TRUE(rejected_with(message_for([](auto& c) { c.kv_channels = 0; }), "kv_channels must be >= 1"));
}

TEST(TransformerConfigValidation, TensorParallel) {
  EXPECT_TRUE(rejected_with(message_for([](auto& c) { c.tensor_model_parallel_size = 3; }),
                            "num_attention_heads (4) must be a multiple of tensor_model_parallel_size (3)"));
  EXPECT_TRUE(rejected_with(message_for([](auto& c) {
                              c.num_attention_heads = 12;
                              c.hidden_size = 96;
                              c.num_query_groups = 3;
                              c.tensor_model_parallel_size = 2;
                            }),
                            "num_query_groups (3) must be a multiple or divisor of tensor_model_parallel_size (2)"));
  EXPECT_EQ(message_for([](auto& c) {
              c.num_query_groups = 1;
              c.tensor_model_parallel_size = 2;
            }),
            "");
  EXPECT_TRUE(rejected_with(message_for([](auto& c) { c.sequence_parallel = true; }),
                            "Cannot use sequence parallelism without tensor parallelism"));
  EXPECT_EQ(message_for([](auto& c) {
              c.sequence_parallel = true;
              c.tensor_model_parallel_size = 2;
            }),
            "");
  EXPECT_TRUE(rejected_with(message_for([](auto& c) { c.fp16 = c.bf16 = true; }), "Only one of fp16"));
}

TEST(TransformerConfigValidation, PipelineFields) {
  EXPECT_TRUE(rejected_with(message_for([](auto& c) { c.pipeline_model_parallel_size = 0; }),
                            "Pipeline model parallel size must be larger than 0"));
  EXPECT_TRUE(rejected_with(message_for([](auto& c) { c.num_layers = 0; }), "num_layers must be >= 1"));
  EXPECT_TRUE(rejected_with(message_for([](auto& c) {
                              c.pipeline_model_parallel_size = 2;
                              c.num_layers_in_first_pipeline_stage = 1;
                              c.account_for_loss_in_pipeline_split = true;
                            }),
                            "cannot be set at the same time with account_for_embedding_in_pipeline_split"));
  EXPECT_TRUE(rejected_with(message_for([](auto& c) {
                              c.pipeline_model_parallel_size = 2;
                              c.num_layers_in_first_pipeline_stage = 0;
                            }),
                            "num_layers_in_first_pipeline_stage must be larger than 0"));
  EXPECT_TRUE(rejected_with(message_for([](auto& c) {
                              c.pipeline_model_parallel_size = 2;
                              c.num_layers_in_last_pipeline_stage = -1;
                            }),
                            "num_layers_in_last_pipeline_stage must be larger than 0"));
  EXPECT_TRUE(rejected_with(message_for([](auto& c) {
                              c.num_layers = 8;
                              c.pipeline_model_parallel_size = 4;
                              c.num_layers_in_first_pipeline_stage = 1;
                            }),
                            "number of layers at middle stage: 7 must be divisible by the middle pipeline model "
                            "parallel size 3"));
  // Python's floor modulo: -1 % 2 == 1, so -1 middle layers over 2 stages are refused.
  EXPECT_TRUE(rejected_with(message_for([](auto& c) {
                              c.num_layers = 1;
                              c.pipeline_model_parallel_size = 3;
                              c.num_layers_in_first_pipeline_stage = 2;
                            }),
                            "number of layers at middle stage: -1"));
  EXPECT_TRUE(
      rejected_with(message_for([](auto& c) {
                      c.num_layers = 8;
                      c.pipeline_model_parallel_size = 2;
                      c.virtual_pipeline_model_parallel_size = 2;
                      c.num_layers_in_first_pipeline_stage = 3;
                    }),
                    "number of layers at first stage: 3 must be divisible by virtual pipeline parallel degree 2"));
  EXPECT_TRUE(rejected_with(message_for([](auto& c) {
                              c.num_layers = 8;
                              c.pipeline_model_parallel_size = 3;
                              c.virtual_pipeline_model_parallel_size = 2;
                              c.num_layers_in_first_pipeline_stage = 2;
                              c.num_layers_in_last_pipeline_stage = 3;
                            }),
                            "number of layers at last stage: 3"));
  EXPECT_TRUE(rejected_with(message_for([](auto& c) {
                              c.num_layers = 7;
                              c.pipeline_model_parallel_size = 3;
                              c.virtual_pipeline_model_parallel_size = 2;
                              c.num_layers_in_first_pipeline_stage = 2;
                              c.num_layers_in_last_pipeline_stage = 2;
                            }),
                            "number of layers on each middle pipeline rank: 3 must be divisible by virtual pipeline "
                            "parallel degree 2"));
  EXPECT_TRUE(rejected_with(message_for([](auto& c) {
                              c.num_layers = 8;
                              c.pipeline_model_parallel_size = 2;
                              c.account_for_embedding_in_pipeline_split = true;
                            }),
                            "number of middle layers: 9 must be divisible by middle pipeline_model_parallel_size 2"));
  EXPECT_TRUE(rejected_with(message_for([](auto& c) {
                              c.num_layers = 8;
                              c.pipeline_model_parallel_size = 2;
                              c.virtual_pipeline_model_parallel_size = 2;
                              c.account_for_loss_in_pipeline_split = true;
                            }),
                            "num_layers: 9 after enable"));
  EXPECT_TRUE(rejected_with(message_for([](auto& c) {
                              c.num_layers = 4;
                              c.pipeline_model_parallel_size = 2;
                              c.virtual_pipeline_model_parallel_size = 2;
                              c.account_for_loss_in_pipeline_split = true;
                              c.account_for_embedding_in_pipeline_split = true;
                            }),
                            "number of layers on each pipeline rank: 3"));
  // Accepted by Megatron although get_num_layers_to_build later refuses it: 5 layers, 2 stages.
  EXPECT_EQ(message_for([](auto& c) {
              c.num_layers = 5;
              c.pipeline_model_parallel_size = 2;
            }),
            "");
  EXPECT_EQ(message_for([](auto& c) {
              c.num_layers = 6;
              c.pipeline_model_parallel_size = 2;
              c.virtual_pipeline_model_parallel_size = 2;
              c.account_for_embedding_in_pipeline_split = true;
              c.account_for_loss_in_pipeline_split = true;
            }),
            "");
}

TEST(TransformerConfigValidation, Moe) {
  auto moe = [](TransformerConfig& c) {
    c.num_moe_experts = 4;
    c.add_bias_linear = false;
  };
  EXPECT_EQ(message_for(moe), "");
  EXPECT_TRUE(rejected_with(message_for([](auto& c) { c.expert_model_parallel_size = 2; }),
                            "num_moe_experts must be non None to use expert-parallel"));
  EXPECT_TRUE(rejected_with(message_for([&](auto& c) {
                              moe(c);
                              c.num_moe_experts = 0;
                            }),
                            "num_moe_experts must be positive"));
  EXPECT_TRUE(rejected_with(message_for([](auto& c) { c.moe_ffn_hidden_size = 32; }),
                            "moe_ffn_hidden_size must be None when num_moe_experts is not set"));
  EXPECT_TRUE(rejected_with(message_for([&](auto& c) {
                              moe(c);
                              c.moe_router_topk = 1;
                            }),
                            "Please use --moe-router-pre-softmax when topk is 1"));
  EXPECT_EQ(message_for([&](auto& c) {
              moe(c);
              c.moe_router_topk = 1;
              c.moe_router_pre_softmax = true;
            }),
            "");
  EXPECT_EQ(message_for([&](auto& c) {
              moe(c);
              c.moe_router_topk = 1;
              c.moe_router_score_function = "sigmoid";
            }),
            "");
  EXPECT_TRUE(rejected_with(message_for([&](auto& c) {
                              moe(c);
                              c.moe_router_topk = 5;
                            }),
                            "moe_router_topk (5) must be <= num_moe_experts (4)"));
  EXPECT_TRUE(rejected_with(message_for([&](auto& c) {
                              moe(c);
                              c.moe_router_enable_expert_bias = true;
                            }),
                            "Expert bias for aux-loss-free routing only supports sigmoid score function"));
  EXPECT_TRUE(rejected_with(message_for([&](auto& c) {
                              moe(c);
                              c.moe_pad_expert_input_to_capacity = true;
                            }),
                            "moe_expert_capacity_factor must be set to use moe_pad_expert_input_to_capacity"));
  // A negative capacity factor means None.
  EXPECT_TRUE(rejected_with(message_for([&](auto& c) {
                              moe(c);
                              c.moe_expert_capacity_factor = -1.0;
                              c.moe_pad_expert_input_to_capacity = true;
                            }),
                            "moe_expert_capacity_factor must be set"));
  EXPECT_TRUE(rejected_with(message_for([&](auto& c) {
                              moe(c);
                              c.moe_expert_capacity_factor = 1.0;
                              c.moe_router_load_balancing_type = "sinkhorn";
                            }),
                            "moe_expert_capacity_factor only works with aux_loss"));
  EXPECT_TRUE(rejected_with(message_for([&](auto& c) {
                              moe(c);
                              c.moe_expert_capacity_factor = 1.0;
                              c.moe_pad_expert_input_to_capacity = true;
                              c.moe_token_dispatcher_type = "flex";
                            }),
                            "Flex token dispatcher with deepep backend does not support"));
  EXPECT_EQ(message_for([&](auto& c) {
              moe(c);
              c.moe_expert_capacity_factor = 1.0;
              c.moe_pad_expert_input_to_capacity = true;
              c.moe_token_dispatcher_type = "alltoall";
            }),
            "");
  EXPECT_TRUE(rejected_with(message_for([&](auto& c) {
                              moe(c);
                              c.moe_shared_expert_intermediate_size = 0;
                            }),
                            "moe_shared_expert_intermediate_size must be"));
  EXPECT_TRUE(rejected_with(message_for([&](auto& c) {
                              moe(c);
                              c.moe_shared_expert_intermediate_size = 64;
                              c.moe_shared_expert_overlap = true;
                            }),
                            "moe_shared_expert_overlap only works with alltoall token dispatcher"));
  EXPECT_TRUE(rejected_with(message_for([&](auto& c) {
                              moe(c);
                              c.moe_router_group_topk = 1;
                            }),
                            "moe_router_num_groups must be specified"));
  EXPECT_TRUE(rejected_with(message_for([&](auto& c) {
                              moe(c);
                              c.moe_router_group_topk = 1;
                              c.moe_router_num_groups = 3;
                            }),
                            "num_moe_experts (4) should be divisible by moe_router_num_groups (3)"));
  EXPECT_TRUE(rejected_with(message_for([&](auto& c) {
                              moe(c);
                              c.moe_router_group_topk = 3;
                              c.moe_router_num_groups = 2;
                            }),
                            "moe_router_group_topk (3) should be smaller than moe_router_num_groups (2)"));
  EXPECT_EQ(message_for([&](auto& c) {
              moe(c);
              c.moe_router_group_topk = 1;
              c.moe_router_num_groups = 2;
            }),
            "");
  EXPECT_TRUE(rejected_with(message_for([&](auto& c) {
                              moe(c);
                              c.moe_router_padding_for_fp8 = true;
                            }),
                            "fp8/fp4 must be specified"));
  EXPECT_TRUE(rejected_with(message_for([&](auto& c) {
                              moe(c);
                              c.add_bias_linear = true;
                              c.tensor_model_parallel_size = 2;
                            }),
                            "Bias in Moe is only supported when ETP==1"));
}

TEST(TransformerConfigValidation, BiasActivationFusion) {
  EXPECT_TRUE(rejected_with(message_for([](auto& c) {
                              c.bias_activation_fusion = true;
                              c.activation_func = "relu";
                            }),
                            "activation function should be either gelu, swiglu, or quick_geglu"));
  EXPECT_TRUE(rejected_with(message_for([](auto& c) {
                              c.bias_activation_fusion = true;
                              c.add_bias_linear = false;
                            }),
                            "add_bias_linear must also be True"));
  EXPECT_EQ(message_for([](auto& c) { c.bias_activation_fusion = true; }), "");
  EXPECT_TRUE(rejected_with(message_for([](auto& c) {
                              c.bias_activation_fusion = true;
                              c.activation_func = "quick_gelu";
                            }),
                            "gated_linear_unit must be True"));
}

// Every golden fixture's config is one Megatron accepted.
TEST(TransformerConfigValidation, EveryFixtureConfigIsAccepted) {
  int checked = 0;
  for (const std::string& path : golden_files()) {
    const Fixture f = load_fixture(path);
    EXPECT_NO_THROW(validate_transformer_config(f.config)) << path;
    if (f.kind.rfind("retro", 0) == 0) {
      const RetroConfig r = validate_retro_config(f.config);
      EXPECT_EQ(r.retro_retrieved_length, r.retro_num_retrieved_chunks * r.retro_chunk_length);
    }
    ++checked;
  }
  EXPECT_GE(checked, 17);  // 7 dense, 7 MoE, 3 Retro files
}

TEST(RetroConfigValidation, DefaultsAndDerivedLength) {
  TransformerConfig c = base();
  c.retro_chunk_length = 4;
  c.retro_split_preprocessing = "98,2,0";
  const RetroConfig r = validate_retro_config(c);
  EXPECT_EQ(r.retro_num_neighbors, 2);
  EXPECT_EQ(r.retro_num_retrieved_chunks, 2);
  EXPECT_EQ(r.retro_retrieved_length, 8);
  EXPECT_EQ(r.retro_encoder_num_layers, 2);
  EXPECT_DOUBLE_EQ(r.retro_encoder_hidden_dropout, 0.1);
  EXPECT_DOUBLE_EQ(r.retro_encoder_attention_dropout, 0.1);
  c.retro_num_retrieved_chunks = 3;
  EXPECT_EQ(validate_retro_config(c).retro_retrieved_length, 12);
}

TEST(RetroConfigValidation, Rejections) {
  auto retro_message = [](const std::function<void(TransformerConfig&)>& edit) -> std::string {
    TransformerConfig c = base();
    c.retro_chunk_length = 4;
    c.retro_split_preprocessing = "98,2,0";
    edit(c);
    try {
      validate_retro_config(c);
    } catch (const ConfigError& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_EQ(retro_message([](auto&) {}), "");
  EXPECT_TRUE(rejected_with(retro_message([](auto& c) { c.retro_split_preprocessing.reset(); }),
                            "retro_split_preprocessing must be set"));
  EXPECT_TRUE(
      rejected_with(retro_message([](auto& c) { c.retro_chunk_length.reset(); }), "retro_chunk_length must be set"));
  EXPECT_TRUE(
      rejected_with(retro_message([](auto& c) { c.retro_chunk_length = 0; }), "retro_chunk_length must be >= 1"));
  EXPECT_TRUE(
      rejected_with(retro_message([](auto& c) { c.retro_num_neighbors = 0; }), "retro_num_neighbors must be >= 1"));
  EXPECT_TRUE(rejected_with(retro_message([](auto& c) { c.retro_encoder_num_layers = 0; }),
                            "retro_encoder_num_layers must be >= 1"));
  EXPECT_TRUE(rejected_with(
      retro_message([](auto& c) { c.retro_retrieved_length = 9; }),
      "retro_retrieved_length (9) must equal retro_num_retrieved_chunks * retro_chunk_length = 2 * 4 = 8"));
  EXPECT_TRUE(rejected_with(retro_message([](auto& c) { c.retro_encoder_hidden_dropout = 1.5; }),
                            "retro_encoder_hidden_dropout must be in [0, 1]"));
  // TransformerConfig checks come first.
  EXPECT_TRUE(rejected_with(retro_message([](auto& c) { c.num_query_groups = 3; }), "num_query_groups (3)"));
}
