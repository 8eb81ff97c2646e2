// `twin` on the golden fixtures: inspect lists all tensors and the config; fixture --json over the
// whole directory prints one well-formed object per file.
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>

#include "fixtures/fixture.h"
#include "tests/parity/twin_cli_util.h"

using namespace twin::testing;
using json = nlohmann::json;

namespace {

std::string fixtures_dir() { return twin::golden_dir(); }

}  // namespace

TEST(TwinCliFixtures, InspectDenseListsConfigAndAll42Tensors) {
  const std::string path = fixtures_dir() + "/dense_ln_mha_gelu_bias.safetensors";
  const TwinRun text = run_twin("inspect " + quote(path));
  ASSERT_EQ(text.code, 0) << text.err;
  EXPECT_NE(text.out.find("tensors (42):"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("\"hidden_size\": 64"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("param.self_attention.linear_qkv.weight"), std::string::npos);

  const TwinRun j = run_twin("inspect --json " + quote(path));
  ASSERT_EQ(j.code, 0);
  const json v = json::parse(j.out);
  EXPECT_EQ(v["tensors"].size(), 42u);
  EXPECT_EQ(v["config"]["hidden_size"], 64);
  EXPECT_EQ(v["config"]["num_attention_heads"], 4);
  EXPECT_EQ(v["metadata"]["kind"], "dense_layer");
  for (const auto& t : v["tensors"]) {
    // Every tensor of this float32 fixture is finite: min <= mean <= max.
    if (t["dtype"] != "F32") continue;
    EXPECT_LE(t["min"].get<double>(), t["mean"].get<double>()) << t.dump();
    EXPECT_LE(t["mean"].get<double>(), t["max"].get<double>()) << t.dump();
  }
}

TEST(TwinCliFixtures, InspectEveryFixture) {
  for (const auto& e : std::filesystem::directory_iterator(fixtures_dir())) {
    const auto ext = e.path().extension();
    if (ext != ".safetensors" && ext != ".json") continue;
    const TwinRun r = run_twin("inspect --json " + quote(e.path().string()));
    EXPECT_EQ(r.code, 0) << e.path() << ": " << r.out << r.err;
    EXPECT_EQ(json::parse(r.out)["status"], "ok");
  }
}

// Acceptance 4's command on the real directory: one well-formed object per file (README.md and
// PROVENANCE.md included: they are `unsupported`), and no file is bad input. The exit code is 3
// until a twin supports a kind, then 0 or 1: what it must never be is 2.
TEST(TwinCliFixtures, FixtureJsonOverTheDirectory) {
  std::size_t files = 0;
  for (const auto& e : std::filesystem::directory_iterator(fixtures_dir())) files += e.is_regular_file();
  const TwinRun r = run_twin("fixture --json " + quote(fixtures_dir()) + "/*");
  EXPECT_NE(r.code, 2) << r.out << r.err;
  const auto ls = lines(r.out);
  ASSERT_EQ(ls.size(), files);
  for (const auto& l : ls) {
    const json v = json::parse(l);
    EXPECT_NE(v["status"], "error") << l;
    EXPECT_TRUE(v["tensors"].is_array());
  }
}
