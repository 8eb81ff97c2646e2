// core/megatron_commit.h: a golden's Megatron-Core commit picks the semantics it is held to. The
// switches' conditions are Megatron's (read from both commits' code); these tests pin down which
// layers meet a difference the twins do not implement yet, so that such a golden is refused and
// never compared against the January pin's numbers.
#include "core/megatron_commit.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

namespace twin {
namespace {

const MegatronSemantics& current() { return megatron_semantics("d98e8a64"); }

TransformerConfig moe(const std::string& score, bool bf16) {
  TransformerConfig c;
  c.hidden_size = 32;
  c.num_attention_heads = 4;
  c.num_moe_experts = 4;
  c.moe_router_score_function = score;
  c.bf16 = bf16;
  c.params_dtype = bf16 ? "bfloat16" : "float32";
  return c;
}

TEST(MegatronCommit, KnownByHashOrPrefixAndUnknownNamesTheKnownOnes) {
  EXPECT_EQ(&megatron_semantics("93ddc24720bb8d62ae68ced044ad59e1a95ead0f"), &pinned_megatron());
  EXPECT_EQ(&megatron_semantics("93ddc24"), &pinned_megatron());
  EXPECT_EQ(megatron_semantics("d98e8a64ddf3").commit, "d98e8a64ddf34856e74b24714e3bedb2f5a39553");
  EXPECT_EQ(find_megatron_semantics("93ddc2"), nullptr);  // six digits name nothing
  EXPECT_EQ(find_megatron_semantics("megatron-core 0.16.0"), nullptr);
  try {
    megatron_semantics("0123456789");
    FAIL() << "an unknown commit must be an error";
  } catch (const ConfigError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("0123456789"), std::string::npos) << what;
    EXPECT_NE(what.find("93ddc247 (January 2026)"), std::string::npos) << what;
    EXPECT_NE(what.find("d98e8a64 (August 2026)"), std::string::npos) << what;
  }
}

TEST(MegatronCommit, ThePinMeetsNoDifferenceFromItself) {
  for (const char* score : {"softmax", "sigmoid"})
    for (bool bf16 : {false, true}) {
      TransformerConfig c = moe(score, bf16);
      c.moe_router_pre_softmax = true;
      c.moe_router_topk_scaling_factor = 2.0;
      c.fp32_residual_connection = true;
      EXPECT_EQ(unimplemented_semantics(pinned_megatron(), c, "moe_layer"), "") << score << bf16;
    }
  EXPECT_EQ(unimplemented_semantics(pinned_megatron(), TransformerConfig{}, "retro_block"), "");
}

TEST(MegatronCommit, RouterScoresDifferForHalfLogitsOnTheSigmoidPreSoftmaxAndScalingPaths) {
  // bf16 logits: sigmoid scores, pre-softmax top-k and a scaling factor round differently.
  EXPECT_NE(unimplemented_semantics(current(), moe("sigmoid", true), "moe_layer").find("router scores"),
            std::string::npos);
  TransformerConfig pre = moe("softmax", true);
  pre.moe_router_pre_softmax = true;
  EXPECT_NE(unimplemented_semantics(current(), pre, "moe_layer").find("router scores"), std::string::npos);
  TransformerConfig scaled = moe("softmax", true);
  scaled.moe_router_topk_scaling_factor = 1.5;
  EXPECT_NE(unimplemented_semantics(current(), scaled, "moe_layer").find("router scores"), std::string::npos);
  // The same in fp32 logits, or the default softmax after top-k in bf16: the same numbers.
  EXPECT_EQ(unimplemented_semantics(current(), moe("sigmoid", false), "moe_layer"), "");
  TransformerConfig fp32_router = moe("sigmoid", true);
  fp32_router.moe_router_dtype = "fp32";
  EXPECT_EQ(unimplemented_semantics(current(), fp32_router, "moe_layer"), "");
  EXPECT_EQ(unimplemented_semantics(current(), moe("softmax", true), "moe_layer"), "");
}

TEST(MegatronCommit, RetroSqrtsoftplusFp32ResidualAndPerTokenAuxScale) {
  EXPECT_NE(unimplemented_semantics(current(), TransformerConfig{}, "retro_decoder_layer").find("Retro"),
            std::string::npos);
  EXPECT_NE(unimplemented_semantics(current(), moe("sqrtsoftplus", false), "moe_layer").find("sqrtsoftplus"),
            std::string::npos);
  TransformerConfig residual = moe("softmax", true);
  residual.num_moe_experts.reset();
  residual.fp32_residual_connection = true;
  EXPECT_NE(unimplemented_semantics(current(), residual, "dense_layer").find("fp32_residual_connection"),
            std::string::npos);
  residual.bf16 = false;
  residual.params_dtype = "float32";  // an fp32 layer's residual is fp32 either way
  EXPECT_EQ(unimplemented_semantics(current(), residual, "dense_layer"), "");
  TransformerConfig per_token = moe("softmax", false);
  per_token.calculate_per_token_loss = true;
  per_token.moe_router_load_balancing_type = "seq_aux_loss";
  per_token.moe_aux_loss_coeff = 0.01;
  EXPECT_EQ(unimplemented_semantics(current(), per_token, "moe_layer"), "");  // one sequence, one rank
  per_token.micro_batch_size = 2;
  EXPECT_NE(unimplemented_semantics(current(), per_token, "moe_layer").find("calculate_per_token_loss"),
            std::string::npos);
}

TEST(MegatronCommit, AFieldTheCommitNoLongerHasIsAnErrorUnlessAtItsOldDefault) {
  const nlohmann::json off = {{"moe_use_legacy_grouped_gemm", false}};
  const nlohmann::json on = {{"moe_use_legacy_grouped_gemm", true}};
  EXPECT_NO_THROW(check_config_fields(current(), off));
  EXPECT_NO_THROW(check_config_fields(pinned_megatron(), on));
  try {
    check_config_fields(current(), on);
    FAIL() << "a removed field set must be an error";
  } catch (const ConfigError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("moe_use_legacy_grouped_gemm"), std::string::npos) << what;
    EXPECT_NE(what.find("d98e8a64"), std::string::npos) << what;
  }
}

}  // namespace
}  // namespace twin
