// The features Megatron-Core runs that no optimized layer implements, asked of every kind: each is
// named before anything runs (the dense and MoE constructors throw ConfigError, MoE's and Retro's
// *_unsupported name it), never accepted and computed as if it were off. One table for all three
// kinds, so a feature that one kind forgets to reject fails here.
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "optimized/moe/moe_transformer_layer.h"
#include "optimized/retro/retro_layer.h"
#include "optimized/transformer_layer.h"
#include "parity/dense_case.h"
#include "parity/fixture_kinds.h"

using namespace twin;

namespace {

struct Unsupported {
  std::string name;  // the words the refusal must contain
  std::function<void(TransformerConfig&)> set;
};

const std::vector<Unsupported>& unsupported_by_every_kind() {
  static const std::vector<Unsupported> cases = {
      {"bias_activation_fusion", [](TransformerConfig& c) { c.bias_activation_fusion = true; }},
      {"window_size",
       [](TransformerConfig& c) {
         c.window_size = std::vector<int>{4, 0};
       }},
      {"softmax_type", [](TransformerConfig& c) { c.softmax_type = "off-by-one"; }},
      {"attention_output_gate", [](TransformerConfig& c) { c.attention_output_gate = true; }},
      {"qk_l2_norm", [](TransformerConfig& c) { c.qk_l2_norm = true; }},
      {"activation_func_clamp_value", [](TransformerConfig& c) { c.activation_func_clamp_value = 7.0; }},
      {"glu_linear_offset", [](TransformerConfig& c) { c.glu_linear_offset = 1.0; }},
      {"context_parallel_size", [](TransformerConfig& c) { c.context_parallel_size = 2; }},
  };
  return cases;
}

// The message of the exception f throws ("" when it throws none of type E).
template <class E, class F>
std::string refusal(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(OptimizedLayerSupport, DenseRefusesEveryUnsupportedFeature) {
  // GLU on, so glu_linear_offset would change the result if it were accepted.
  const parity::DenseInputs in = parity::make_inputs(parity::parse_case_id(
      "dense(h=16,a=4,g=2,d=8,ffn=32,norm=rms,act=silu,glu=1,bias=1,qkv_bias=0,rope=none,rot=1,qkln=0,mask=causal,s=4,"
      "b=1,dtype=bf16,tp=1,sp=0,drop=0,seed=3)"));
  ASSERT_NO_THROW(opt::DenseTransformerLayer(in.config, in.params, {}));
  for (const auto& u : unsupported_by_every_kind()) {
    SCOPED_TRACE(u.name);
    TransformerConfig cfg = in.config;
    u.set(cfg);
    const std::string why = refusal<ConfigError>([&] { opt::DenseTransformerLayer(cfg, in.params, {}); });
    EXPECT_NE(why.find(u.name), std::string::npos) << "refusal: '" << why << "'";
  }
}

TEST(OptimizedLayerSupport, MoERefusesEveryUnsupportedFeature) {
  const Fixture base = load_fixture(golden_dir() + "/moe_top2_aux_allgather.safetensors");
  ASSERT_EQ(opt::moe_layer_unsupported(base.config), "");
  const auto params = parity::params_of(base);
  for (const auto& u : unsupported_by_every_kind()) {
    SCOPED_TRACE(u.name);
    TransformerConfig cfg = base.config;
    u.set(cfg);
    EXPECT_NE(opt::moe_layer_unsupported(cfg).find(u.name), std::string::npos) << opt::moe_layer_unsupported(cfg);
    const std::string why = refusal<ConfigError>([&] { opt::MoETransformerLayer(cfg, params); });
    EXPECT_NE(why.find(u.name), std::string::npos) << "refusal: '" << why << "'";
  }
}

TEST(OptimizedLayerSupport, RetroRefusesEveryUnsupportedFeature) {
  const Fixture base = load_fixture(golden_dir() + "/retro_later_layer_divisible.safetensors");
  ASSERT_EQ(opt::retro::retro_decoder_unsupported(base.config), "");
  for (const auto& u : unsupported_by_every_kind()) {
    SCOPED_TRACE(u.name);
    TransformerConfig cfg = base.config;
    u.set(cfg);
    const std::string why = opt::retro::retro_decoder_unsupported(cfg);
    EXPECT_NE(why.find(u.name), std::string::npos) << "refusal: '" << why << "'";
  }
}
