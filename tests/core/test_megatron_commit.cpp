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

TEST(MegatronCommit, ThePinHasEverySwitchOffAndTheCurrentCommitEveryOne) {
  const MegatronSwitches pin = pinned_megatron().switches, now = current().switches;
  EXPECT_FALSE(pin.router_scores_fp32 || pin.aux_loss_scores_fp32 || pin.sqrtsoftplus);
  EXPECT_TRUE(now.router_scores_fp32 && now.aux_loss_scores_fp32 && now.sqrtsoftplus);
  // A config not held to any golden is the pin's.
  const MegatronSwitches unset = TransformerConfig{}.megatron;
  EXPECT_FALSE(unset.router_scores_fp32 || unset.aux_loss_scores_fp32 || unset.sqrtsoftplus);
}

TEST(MegatronCommit, RetroAndAnFp32ResidualInAHalfLayerAreRefusedAtTheCurrentCommit) {
  EXPECT_NE(unimplemented_semantics(current(), TransformerConfig{}, "retro_decoder_layer").find("Retro"),
            std::string::npos);
  TransformerConfig residual = moe("softmax", true);
  residual.num_moe_experts.reset();
  residual.fp32_residual_connection = true;
  EXPECT_NE(unimplemented_semantics(current(), residual, "dense_layer").find("fp32_residual_connection"),
            std::string::npos);
  residual.bf16 = false;
  residual.params_dtype = "float32";  // an fp32 layer's residual is fp32 either way
  EXPECT_EQ(unimplemented_semantics(current(), residual, "dense_layer"), "");
  // The router's differences are switches both twins read, not refusals.
  EXPECT_EQ(unimplemented_semantics(current(), moe("sqrtsoftplus", true), "moe_layer"), "");
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
