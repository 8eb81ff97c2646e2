// What the optimized MoE layer does not implement is named before anything runs: the fixture
// handler reports the golden `unsupported` (FixtureUnsupported), never a wrong answer, and the
// layer's constructor rejects the config with a ConfigError naming the feature. Every supported
// golden runs and passes (the same check `twin fixture --twin optimized` makes).
#include <gtest/gtest.h>

#include <functional>

#include "optimized/moe/moe_transformer_layer.h"
#include "parity/fixture_kinds.h"

using namespace twin;

namespace {

const std::string kGolden = "moe_top2_aux_allgather.safetensors";

struct Unsupported {
  std::string name;  // the words the reason must contain
  std::function<void(TransformerConfig&)> set;
};

}  // namespace

TEST(OptimizedMoESupport, UnsupportedFeaturesAreReportedBeforeRunning) {
  const Fixture base = load_fixture(golden_dir() + "/" + kGolden);
  ASSERT_EQ(opt::moe_layer_unsupported(base.config), "");
  const std::vector<Unsupported> cases = {
      {"moe_input_jitter_eps", [](TransformerConfig& c) { c.moe_input_jitter_eps = 0.01; }},
      {"sinkhorn",
       [](TransformerConfig& c) {
         c.moe_router_load_balancing_type = "sinkhorn";
         c.moe_aux_loss_coeff = 0.0;
       }},
      {"expert_model_parallel_size", [](TransformerConfig& c) { c.expert_model_parallel_size = 3; }},  // E = 4
      {"moe_apply_probs_on_input",
       [](TransformerConfig& c) {
         c.moe_apply_probs_on_input = true;
         c.moe_router_topk = 1;
       }},
      {"moe_grouped_gemm", [](TransformerConfig& c) { c.moe_grouped_gemm = true; }},
      {"moe_router_force_load_balancing", [](TransformerConfig& c) { c.moe_router_force_load_balancing = true; }},
      {"bias_activation_fusion", [](TransformerConfig& c) { c.bias_activation_fusion = true; }},
      {"moe_token_dispatcher_type", [](TransformerConfig& c) { c.moe_token_dispatcher_type = "flex"; }},
  };
  for (const auto& u : cases) {
    SCOPED_TRACE(u.name);
    Fixture f = load_fixture(golden_dir() + "/" + kGolden);
    u.set(f.config);
    const std::string why = opt::moe_layer_unsupported(f.config);
    EXPECT_NE(why.find(u.name), std::string::npos) << why;
    RunMode at_its_layout;  // as `twin fixture` runs a golden by default
    at_its_layout.ep = f.config.expert_model_parallel_size;
    EXPECT_THROW(parity::run_optimized_moe_layer(f, at_its_layout), FixtureUnsupported);
    EXPECT_THROW(opt::MoETransformerLayer(f.config, parity::params_of(f)), ConfigError);
  }
  // Tensor parallelism of the layer is not run by the MoE twin either.
  opt::LayerOptions tp2;
  tp2.tp = 2;
  EXPECT_NE(opt::moe_layer_unsupported(base.config, tp2), "");
}

// A parameter the MoE layer does not own, or one of the wrong shape, is bad input (ShapeError).
TEST(OptimizedMoESupport, BadParametersAreRejected) {
  const Fixture f = load_fixture(golden_dir() + "/" + kGolden);
  auto params = parity::params_of(f);
  auto extra = params;
  extra["mlp.experts.local_experts.9.linear_fc1.weight"] = params.at("mlp.router.weight");
  EXPECT_THROW(opt::MoETransformerLayer(f.config, extra), ShapeError);
  auto missing = params;
  missing.erase("mlp.experts.local_experts.3.linear_fc2.weight");
  EXPECT_THROW(opt::MoETransformerLayer(f.config, missing), ShapeError);
  auto wrong = params;
  wrong["mlp.router.weight"] = params.at("mlp.experts.local_experts.0.linear_fc1.weight");
  EXPECT_THROW(opt::MoETransformerLayer(f.config, wrong), ShapeError);
}

// Every moe_* golden (and the random ones) passes for the optimized twin on the simulator at
// expert-parallel sizes 1, 2 and 4 where num_moe_experts allows, with the routing map, the tokens
// per expert, the gradients and every other compared tensor within its bound.
TEST(OptimizedMoESupport, EveryMoEGoldenPasses) {
  const std::vector<std::string> files = golden_files("moe_");  // recursive: random/ too
  ASSERT_GE(files.size(), 18u);
  int expert_parallel = 0;
  for (const auto& path : files)
    for (int ep : {1, 2, 4}) {
      const Fixture f = load_fixture(path);
      if (*f.config.num_moe_experts % ep != 0) continue;
      SCOPED_TRACE(path + " at ep " + std::to_string(ep));
      expert_parallel += ep > 1;
      RunMode mode;
      mode.ep = ep;
      std::string grads;
      const auto rows = compare_fixture(find_fixture_handler(f.kind, TwinKind::Optimized, mode), f, TwinKind::Optimized,
                                        mode, &grads);
      EXPECT_EQ(grads, "compared");
      bool map = false, tokens = false;
      for (const auto& row : rows) {
        EXPECT_TRUE(row.pass) << row.name << ": " << row.message;
        map |= row.name == "tap.mlp.router.1";
        tokens |= row.name == "tap_in.mlp.experts.tokens_per_expert";
      }
      EXPECT_TRUE(map && tokens) << "routing map and tokens per expert compared";
    }
  // the goldens with an even number of experts (all but the random ones with an odd one) ran at ep > 1
  EXPECT_GE(expert_parallel, int(files.size()) / 2);
}
