// get_retro_decoder_layer_{te,local}_spec: the family each names, the same numerics for both;
// get_retro_decoder_block_spec: which layers own what.
#include <gtest/gtest.h>

#include "reference/retro/decoder_attention.h"
#include "reference/retro/decoder_layer_spec.h"
#include "tests/reference/retro/retro_test_util.h"

using namespace twin;
using namespace twin::reference;
using namespace twin::reference::retro;

TEST(RetroDecoderLayerSpec, FamiliesAndModules) {
  EXPECT_EQ(get_retro_decoder_layer_te_spec().family, SpecFamily::TransformerEngine);
  EXPECT_EQ(get_retro_decoder_layer_local_spec().family, SpecFamily::Local);
  const TransformerConfig c = test::retro_config(4, 2, 2);
  for (bool with_encoder : {false, true}) {
    auto layer = test::retro_decoder_layer(c, with_encoder);
    const auto* cross = dynamic_cast<const RetroDecoderCrossAttention*>(layer->cross_attention.get());
    ASSERT_NE(cross, nullptr);
    EXPECT_EQ(cross->encoder != nullptr, with_encoder);
    EXPECT_EQ(cross->attn.core_attention.attn_mask_type, AttnMaskType::padding);
    EXPECT_EQ(cross->attn.core_attention.layer_number, 6);
    if (with_encoder) {
      EXPECT_EQ(cross->encoder->layers.size(), 2u);
    }
  }
}

// Both families build the same numerics here: bitwise equal outputs and contexts.
TEST(RetroDecoderLayerSpec, TeAndLocalSpecsComputeTheSame) {
  const TransformerConfig c = test::retro_config(4, 2, 2);
  for (bool with_encoder : {false, true}) {
    auto local = test::retro_decoder_layer(c, with_encoder, false);
    auto te = test::retro_decoder_layer(c, with_encoder, true);
    const Tensor hidden = test::random_tensor({9, 2, 64}, 21);
    const Tensor context = test::random_tensor(with_encoder ? Shape{8, 12, 64} : Shape{16, 6, 64}, 22);
    LayerInputs in;
    in.context = &context;
    const auto [a, ca] = local->forward(hidden, in);
    const auto [b, cb] = te->forward(hidden, in);
    EXPECT_EQ(a.to_f64(), b.to_f64());
    EXPECT_EQ(ca->to_f64(), cb->to_f64());
  }
}

TEST(RetroDecoderBlockSpec, LayersOwningTheEncoder) {
  TransformerConfig c = test::retro_config(4, 2, 2);
  c.num_layers = 12;  // Retro layers 6 (with the encoder), 9, 12
  const TransformerBlockSubmodules spec = get_retro_decoder_block_spec(c, false);
  TransformerBlock block(c, spec, Precision{});
  ASSERT_EQ(block.layers.size(), 12u);
  for (int i = 0; i < 12; ++i) {
    const auto* cross = dynamic_cast<const RetroDecoderCrossAttention*>(block.layers[i]->cross_attention.get());
    const int n = i + 1;
    EXPECT_EQ(cross != nullptr, n == 6 || n == 9 || n == 12) << n;
    if (cross) {
      EXPECT_EQ(cross->encoder != nullptr, n == 6) << n;
    }
    EXPECT_EQ(block.layers[i]->layer_number, n);
  }
  c.pipeline_model_parallel_size = 2;
  EXPECT_THROW(get_retro_decoder_block_spec(c, false), ConfigError);
}
