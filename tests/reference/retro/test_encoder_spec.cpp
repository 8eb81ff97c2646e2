// get_retro_encoder_block_spec: layer 1 the Retro encoder layer, the rest GPT layers; padding
// self-attention masks, the encoder's own dropouts; the family each layer spec names.
#include <gtest/gtest.h>

#include "reference/retro/encoder_attention.h"
#include "reference/retro/encoder_spec.h"
#include "tests/reference/retro/retro_test_util.h"

using namespace twin;
using namespace twin::reference;
using namespace twin::reference::retro;

TEST(RetroEncoderSpec, BlockLayersDropoutsAndMasks) {
  for (int num_layers : {1, 2, 4}) {
    TransformerConfig c = test::retro_config(4, 2, 2);
    c.retro_encoder_num_layers = num_layers;
    c.retro_encoder_hidden_dropout = 0.25;
    c.retro_encoder_attention_dropout = 0.125;
    c.hidden_dropout = 0.0;
    c.attention_dropout = 0.0625;
    for (bool te : {false, true}) {
      TransformerBlock block(c, get_retro_encoder_block_spec(c, te), Precision{}, true, true, false);
      ASSERT_EQ(block.layers.size(), static_cast<std::size_t>(num_layers));
      EXPECT_EQ(block.final_layernorm, nullptr);
      for (int i = 0; i < num_layers; ++i) {
        const TransformerLayer& layer = *block.layers[i];
        EXPECT_EQ(layer.layer_number, i + 1);
        EXPECT_EQ(layer.hidden_dropout, 0.25);
        const auto* self = dynamic_cast<const SelfAttention*>(layer.self_attention.get());
        ASSERT_NE(self, nullptr);
        EXPECT_EQ(self->core_attention.attn_mask_type, AttnMaskType::padding);
        EXPECT_EQ(self->core_attention.attention_dropout, 0.125);
        const auto* cross = dynamic_cast<const RetroEncoderCrossAttention*>(layer.cross_attention.get());
        if (i == 0) {
          ASSERT_NE(cross, nullptr);
          EXPECT_EQ(cross->attn.core_attention.attn_mask_type, AttnMaskType::padding);
          EXPECT_EQ(cross->attn.core_attention.attention_dropout, 0.0625);  // the config's, as Megatron
          EXPECT_NE(dynamic_cast<const RetroEncoderLayerNorm*>(layer.pre_mlp_layernorm.get()), nullptr);
          EXPECT_NE(layer.pre_cross_attn_layernorm, nullptr);
          EXPECT_TRUE(static_cast<bool>(layer.cross_attn_bda));
        } else {
          EXPECT_EQ(layer.cross_attention, nullptr);
          EXPECT_EQ(layer.pre_cross_attn_layernorm, nullptr);
          EXPECT_EQ(dynamic_cast<const RetroEncoderLayerNorm*>(layer.pre_mlp_layernorm.get()), nullptr);
        }
      }
    }
  }
}

TEST(RetroEncoderSpec, Families) {
  EXPECT_EQ(get_retro_encoder_layer_te_spec().family, SpecFamily::TransformerEngine);
  EXPECT_EQ(get_retro_encoder_layer_local_spec().family, SpecFamily::Local);
  EXPECT_STREQ(spec_family_name(SpecFamily::TransformerEngine), "transformer_engine");
  EXPECT_STREQ(spec_family_name(SpecFamily::Local), "local");
}

// FusedLayerNorm (local) supports LayerNorm only, as Megatron asserts; TENorm also RMSNorm.
TEST(RetroEncoderSpec, FusedLayerNormRejectsRmsNorm) {
  TransformerConfig c = test::retro_config(4, 2, 2);
  c.normalization = "RMSNorm";
  EXPECT_THROW(TransformerBlock(c, get_retro_encoder_block_spec(c, false), Precision{}), ConfigError);
  TransformerBlock te(c, get_retro_encoder_block_spec(c, true), Precision{});
  EXPECT_NE(dynamic_cast<const RMSNorm*>(te.layers[0]->pre_cross_attn_layernorm.get()), nullptr);
}
