// optimized/layer/attention_half.h: the attention half the dense and MoE layers share (Retro's
// layers its scaling). Its softmax scale and query-key layer scaling coefficient against the
// reference's DotProductAttention for every layer number, its input checks' one-line errors, and
// the q/k-layernorm taps out of the grouped linear_qkv layout element by element.
#include <gtest/gtest.h>

#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include "optimized/layer/attention_half.h"
#include "reference/dot_product_attention.h"

namespace twin::opt {
namespace {

TEST(AttentionHalf, ScalingIsTheReferenceCoreAttentionsAtEveryLayerNumber) {
  for (bool qk_layer_scaling : {false, true})
    for (std::optional<double> softmax_scale : {std::optional<double>(), std::optional<double>(0.3)})
      for (int layer_number : {1, 2, 3, 7}) {
        SCOPED_TRACE("layer " + std::to_string(layer_number) + (qk_layer_scaling ? " qk-layer-scaling" : "") +
                     (softmax_scale ? " softmax_scale 0.3" : ""));
        TransformerConfig c;
        c.hidden_size = 16;
        c.num_attention_heads = 4;
        c.apply_query_key_layer_scaling = qk_layer_scaling;
        c.softmax_scale = softmax_scale;
        const reference::DotProductAttention ref(c, layer_number, reference::AttnMaskType::causal,
                                                 reference::Precision{});
        const AttentionScaling a = attention_scaling(c, layer_number);
        EXPECT_EQ(a.alpha, static_cast<float>(ref.softmax_scale));
        EXPECT_EQ(a.coeff, ref.coeff ? static_cast<float>(*ref.coeff) : 0.0f);
        EXPECT_TRUE(a.softmax_fp32);  // fp32 activations, or the scaling's fp32 softmax
      }
}

// Each bad input is a ShapeError of one line that names the layer and the input.
TEST(AttentionHalf, BadInputsAreOneLineShapeErrorsNamingTheInput) {
  const int h = 8, np = 2, hn = 4;
  const Tensor x = Tensor::zeros(DType::F32, {3, 2, h});
  const Tensor mask = Tensor::zeros(DType::BOOL, {2, 1, 3, 3}), rope = Tensor::zeros(DType::F32, {3, 1, 1, 4});
  const Tensor wrong_mask = Tensor::zeros(DType::BOOL, {2, 1, 3, 4}),
               odd_rope = Tensor::zeros(DType::F32, {3, 1, 1, 3});
  const Tensor wrong_h = Tensor::zeros(DType::F32, {3, 2, h + 1}), bf16 = Tensor::zeros(DType::BF16, {3, 2, h});
  const Tensor empty = Tensor::zeros(DType::F32, {0, 2, h});
  const AttentionInputs ok = check_attention_inputs("L", x, DType::F32, h, np, hn, &mask, &rope);
  EXPECT_EQ(ok.s, 3);
  EXPECT_EQ(ok.b, 2);
  EXPECT_EQ(ok.mask_b, 2);
  EXPECT_EQ(ok.rot, 4);
  struct Bad {
    const Tensor* x;
    const Tensor* mask;
    const Tensor* rope;
    std::string says;
  };
  for (const Bad& bad :
       {Bad{&wrong_h, nullptr, nullptr, "L: hidden_states expected [s, b, 8]"},
        Bad{&bf16, nullptr, nullptr, "L: hidden_states dtype"}, Bad{&empty, nullptr, nullptr, "L: empty hidden_states"},
        Bad{&x, &wrong_mask, nullptr, "L: attention_mask expected BOOL [2, 1, 3, 3]"},
        Bad{&x, nullptr, &odd_rope, "L: rot_dim 3 must be even"}}) {
    try {
      check_attention_inputs("L", *bad.x, DType::F32, h, np, hn, bad.mask, bad.rope);
      ADD_FAILURE() << "accepted: " << bad.says;
    } catch (const ShapeError& e) {
      const std::string what = e.what();
      EXPECT_EQ(what.rfind(bad.says, 0), 0u) << what;
      EXPECT_EQ(what.find('\n'), std::string::npos) << what;
    }
  }
}

// linear_qkv's output holds, per token and query group, hpg query heads, then the key, then the
// value head: q head g * hpg + j is the group's j-th block, k head g its block hpg.
TEST(AttentionHalf, QkLayernormTapsAreTheGroupedLayoutsQueryAndKeyHeads) {
  const int S = 2, B = 3, ng = 2, hpg = 2, hn = 3, width = ng * (hpg + 2) * hn;
  std::vector<double> v(std::size_t(S * B * width));
  std::iota(v.begin(), v.end(), 0.0);
  const auto [q, k] = qk_layernorm_taps(Tensor::from_doubles(DType::F32, {S * B, width}, v), S, B, ng, hpg, hn);
  EXPECT_EQ(q.shape(), (Shape{S, B, ng * hpg, hn}));
  EXPECT_EQ(k.shape(), (Shape{S, B, ng, hn}));
  for (int t = 0; t < S * B; ++t)
    for (int g = 0; g < ng; ++g)
      for (int c = 0; c < hn; ++c) {
        const int group = t * width + g * (hpg + 2) * hn;
        for (int j = 0; j < hpg; ++j) EXPECT_EQ(q.at_f64((t * ng * hpg + g * hpg + j) * hn + c), group + j * hn + c);
        EXPECT_EQ(k.at_f64((t * ng + g) * hn + c), group + hpg * hn + c);
      }
}

}  // namespace
}  // namespace twin::opt
