// What the optimized Retro decoder does not implement is named before anything runs: the fixture
// handlers report the golden `unsupported` (FixtureUnsupported), never an error or a wrong answer,
// and the constructors reject the config with a ConfigError. Every Retro golden runs and passes
// for the optimized twin, gradients included, at tp 1 and 2 (the check `twin fixture --twin
// optimized [--tp 2]` makes).
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
  };
  // Tensor-parallel layouts it cannot run (the goldens' 2 heads): named the same way.
  std::vector<std::pair<std::string, RunMode>> modes = {{"no sequence parallelism", {}}, {"must divide", {}}};
  modes[0].second.tp = 2;
  modes[0].second.sp = true;
  modes[1].second.tp = 3;
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
  for (const auto& [file, handler] : goldens)
    for (const auto& [name, mode] : modes) {
      SCOPED_TRACE(file + ": " + name);
      try {
        handler(load_fixture(golden_dir() + "/" + file), mode);
        ADD_FAILURE() << "no FixtureUnsupported";
      } catch (const FixtureUnsupported& e) {
        EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
      }
    }
}

// Every Retro golden passes for the optimized twin on the simulator, and every layer and block
// golden with its gradients compared, at tensor-parallel sizes 1 and 2.
TEST(OptimizedRetroSupport, EveryRetroGoldenPasses) {
  const auto tables = golden_files("retro_", ".json");
  ASSERT_GE(tables.size(), 1u);
  for (const auto& path : tables)
    for (const auto& row : compare_fixture(load_fixture(path), TwinKind::Optimized))
      EXPECT_TRUE(row.pass) << path << " " << row.name << ": " << row.message;
  const std::vector<std::string> files = golden_files("retro_");
  ASSERT_GE(files.size(), 4u);
  for (const auto& path : files)
    for (int tp : {1, 2}) {
      SCOPED_TRACE(path + " tp " + std::to_string(tp));
      const Fixture f = load_fixture(path);
      RunMode mode;
      mode.tp = tp;
      std::string grads;
      const auto rows = compare_fixture(find_fixture_handler(f.kind, TwinKind::Optimized, mode), f, TwinKind::Optimized,
                                        mode, &grads);
      EXPECT_EQ(grads, "compared");
      std::size_t gradients = 0;
      for (const auto& row : rows) {
        gradients += row.name.rfind("grad.", 0) == 0;
        EXPECT_TRUE(row.pass) << row.name << ": " << row.message;
      }
      EXPECT_GE(gradients, 10u);
    }
}
