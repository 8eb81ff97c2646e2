// What the optimized Retro decoder does not implement is named before anything runs: the fixture
// handlers report the golden `unsupported` (FixtureUnsupported), never an error or a wrong answer,
// and the constructors reject the config with a ConfigError. Every Retro golden runs and passes
// for the optimized twin (the same check `twin fixture --twin optimized` makes).
#include <gtest/gtest.h>

#include <functional>

#include "optimized/retro/retro_layer.h"
#include "parity/fixture_kinds.h"

using namespace twin;

namespace {

struct Unsupported {
  std::string name;  // the words the reason must contain
  std::function<void(TransformerConfig&)> set;
};

}  // namespace

TEST(OptimizedRetroSupport, UnsupportedFeaturesAreReportedBeforeRunning) {
  const std::vector<Unsupported> cases = {
      {"bias_activation_fusion", [](TransformerConfig& c) { c.bias_activation_fusion = true; }},
      {"window_size",
       [](TransformerConfig& c) {
         c.window_size = std::vector<int>{4, 0};
       }},
      {"softmax_type", [](TransformerConfig& c) { c.softmax_type = "off-by-one"; }},
      {"qk_l2_norm", [](TransformerConfig& c) { c.qk_l2_norm = true; }},
      {"glu_linear_offset", [](TransformerConfig& c) { c.glu_linear_offset = 1.0; }},
      {"tensor_model_parallel_size 1 only", [](TransformerConfig& c) { c.tensor_model_parallel_size = 2; }},
  };
  using Handler = TwinRun (*)(const Fixture&, const RunMode&);
  const std::vector<std::pair<std::string, Handler>> goldens = {
      {"retro_first_layer_cmask.safetensors", parity::run_optimized_retro_decoder_layer_first},
      {"retro_later_layer_divisible.safetensors", parity::run_optimized_retro_decoder_layer},
      {"retro_block_6layers_nondivisible.safetensors", parity::run_optimized_retro_block},
  };
  for (const auto& [file, handler] : goldens)
    for (const auto& u : cases) {
      SCOPED_TRACE(file + ": " + u.name);
      Fixture f = load_fixture(golden_dir() + "/" + file);
      ASSERT_EQ(opt::retro::retro_decoder_unsupported(f.config), "");
      u.set(f.config);
      try {
        handler(f, RunMode{});
        ADD_FAILURE() << "no FixtureUnsupported";
      } catch (const FixtureUnsupported& e) {
        EXPECT_NE(std::string(e.what()).find(u.name), std::string::npos) << e.what();
      }
    }
}

// Every Retro golden passes for the optimized twin on the simulator.
TEST(OptimizedRetroSupport, EveryRetroGoldenPasses) {
  std::vector<std::string> files = golden_files("retro_");
  const auto tables = golden_files("retro_", ".json");
  files.insert(files.end(), tables.begin(), tables.end());
  ASSERT_GE(files.size(), 5u);
  for (const auto& path : files) {
    SCOPED_TRACE(path);
    const Fixture f = load_fixture(path);
    const auto rows = compare_fixture(f, TwinKind::Optimized);
    EXPECT_FALSE(rows.empty());
    for (const auto& row : rows) EXPECT_TRUE(row.pass) << row.name << ": " << row.message;
  }
}
