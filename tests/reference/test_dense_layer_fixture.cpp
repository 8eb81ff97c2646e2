// The dense_layer fixture handler on every golden dense_* file: every output and tap compared,
// all within the numerics-derived tolerance; a tap the reference does not produce fails.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "core/safetensors.h"
#include "fixtures/fixture.h"
#include "reference/fixture_handlers.h"

using namespace twin;
namespace fs = std::filesystem;

namespace {

fs::path fixture_dir() {
  const char* src = std::getenv("TWIN_SOURCE_DIR");
  return fs::path(src ? src : ".") / "fixtures" / "megatron-core";
}

std::vector<fs::path> dense_files() {
  std::vector<fs::path> out;
  for (const auto& e : fs::directory_iterator(fixture_dir())) {
    const std::string name = e.path().filename().string();
    if (name.rfind("dense_", 0) == 0 && e.path().extension() == ".safetensors") out.push_back(e.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

TEST(DenseLayerFixture, EveryDenseFixturePassesWithEveryTapCompared) {
  const auto files = dense_files();
  ASSERT_GE(files.size(), 7u) << "dense fixtures missing under " << fixture_dir();
  for (const auto& path : files) {
    SCOPED_TRACE(path.string());
    const Fixture f = load_fixture(path.string());
    ASSERT_EQ(f.kind, "dense_layer");
    const auto comparisons = reference::run_dense_layer_fixture(f);
    // one comparison per tap.* plus output.hidden_states
    EXPECT_EQ(comparisons.size(), f.names_with_prefix("tap.").size() + 1);
    for (const auto& c : comparisons) {
      EXPECT_TRUE(c.pass) << c.name << ": " << c.message << " max_abs " << c.max_abs << " share " << c.share_used;
      EXPECT_LE(c.tol.atol, 1e-5) << c.name;  // the cap for fp32 files
      EXPECT_LE(c.tol.rtol, 1e-4) << c.name;
    }
  }
}

TEST(DenseLayerFixture, ATapTheReferenceDoesNotProduceFails) {
  const auto files = dense_files();
  ASSERT_FALSE(files.empty());
  const SafetensorsFile src = read_safetensors(files.front().string());
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (const auto& n : src.names()) tensors.emplace_back(n, src.at(n));
  tensors.emplace_back("tap.self_attention.no_such_module", src.at("output.hidden_states"));
  const fs::path tmp = fs::temp_directory_path() / "dense_extra_tap.safetensors";
  write_safetensors(tmp.string(), tensors, src.metadata());
  const Fixture f = load_fixture(tmp.string());
  const auto comparisons = reference::run_dense_layer_fixture(f);
  bool found = false;
  for (const auto& c : comparisons)
    if (c.name == "tap.self_attention.no_such_module") {
      found = true;
      EXPECT_FALSE(c.pass);
      EXPECT_NE(c.message.find("produces no tensor"), std::string::npos) << c.message;
    }
  EXPECT_TRUE(found);
  fs::remove(tmp);
}

TEST(DenseLayerFixture, AWrongParameterFails) {
  const auto files = dense_files();
  ASSERT_FALSE(files.empty());
  const SafetensorsFile src = read_safetensors(files.front().string());
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (const auto& n : src.names()) {
    Tensor t = src.at(n);
    if (n == "param.mlp.linear_fc2.weight") {  // perturb one weight: the output must fail
      t = t.clone();
      t.data_mut<float>()[0] += 0.5f;
    }
    tensors.emplace_back(n, t);
  }
  const fs::path tmp = fs::temp_directory_path() / "dense_wrong_param.safetensors";
  write_safetensors(tmp.string(), tensors, src.metadata());
  const auto comparisons = reference::run_dense_layer_fixture(load_fixture(tmp.string()));
  bool output_failed = false;
  for (const auto& c : comparisons)
    if (c.name == "output.hidden_states") output_failed = !c.pass;
  EXPECT_TRUE(output_failed);
  fs::remove(tmp);
}
