// `twin` on the golden fixtures: inspect lists all tensors and the config; fixture --json over the
// whole directory prints one well-formed object per file.
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "core/safetensors.h"
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
  for (const auto& e : std::filesystem::recursive_directory_iterator(fixtures_dir())) {
    const auto ext = e.path().extension();
    if (ext != ".safetensors" && ext != ".json") continue;
    const TwinRun r = run_twin("inspect --json " + quote(e.path().string()));
    EXPECT_EQ(r.code, 0) << e.path() << ": " << r.out << r.err;
    EXPECT_EQ(json::parse(r.out)["status"], "ok");
  }
}

// Acceptance 4's command on the real directory, with what each file must give. Every golden is a
// kind the reference twin supports (the README's table), so each must pass with tensors compared
// and every compared tensor within its bound; the optimized twin may say it does not support a
// kind (then the line says exactly that), and where it has a handler the file must pass too. Files
// that are not fixtures (README.md, PROVENANCE.md) are `unsupported` as not a fixture file; a
// folder (random/) stands for the fixtures under it.
TEST(TwinCliFixtures, FixtureJsonOverTheDirectory) {
  std::size_t files = 0, fixtures = 0;
  for (const auto& e : std::filesystem::recursive_directory_iterator(fixtures_dir())) {
    const bool fixture = e.path().extension() == ".safetensors" || e.path().extension() == ".json";
    fixtures += fixture;
    files += e.is_regular_file() && (fixture || e.path().parent_path() == fixtures_dir());
  }
  ASSERT_GT(fixtures, 0u);
  const TwinRun r = run_twin("fixture --json --twin both " + quote(fixtures_dir()) + "/*");
  const auto ls = lines(r.out);
  ASSERT_EQ(ls.size(), 2 * fixtures + (files - fixtures)) << r.err;  // a fixture gives one line per twin
  std::size_t reference_pass = 0, optimized_pass = 0, optimized_unsupported = 0;
  for (const auto& l : ls) {
    SCOPED_TRACE(l.substr(0, 300));
    const json v = json::parse(l);
    const std::string file = v["file"], status = v["status"], message = v["message"];
    const auto ext = std::filesystem::path(file).extension();
    if (ext != ".safetensors" && ext != ".json") {
      EXPECT_EQ(status, "unsupported");
      EXPECT_NE(message.find("not a fixture file"), std::string::npos);
      continue;
    }
    const std::string twin = v["twin"];
    ASSERT_TRUE(v["kind"].is_string());
    if (twin == "optimized" && status == "unsupported") {
      EXPECT_NE(message.find("does not support fixture kind '" + v["kind"].get<std::string>() + "'"),
                std::string::npos);
      EXPECT_TRUE(v["tensors"].empty());
      ++optimized_unsupported;
      continue;
    }
    EXPECT_EQ(status, "pass") << twin << ": " << message;
    ASSERT_TRUE(v["tensors"].is_array());
    EXPECT_FALSE(v["tensors"].empty()) << "no tensor compared";
    for (const auto& t : v["tensors"]) EXPECT_TRUE(t["pass"].get<bool>()) << t.dump();
    (twin == "reference" ? reference_pass : optimized_pass) += status == "pass";
  }
  EXPECT_EQ(reference_pass, fixtures);
  EXPECT_EQ(optimized_pass + optimized_unsupported, fixtures);
  EXPECT_GT(optimized_pass, 0u) << "the optimized twin runs the dense_layer goldens";
  // Every file passes or is unsupported by a twin: exit 3 while some kind is unsupported, else 0.
  EXPECT_EQ(r.code, optimized_unsupported ? 3 : 0) << r.err;
}

// A golden's __metadata__.megatron_commit picks the semantics both twins hold it to; --megatron
// overrides it. A difference from the January pin the twins do not implement yet is `unsupported`
// (never compared against the pin's numbers), an unknown commit an error naming the known ones.
TEST(TwinCliFixtures, TheGoldensMegatronCommitPicksTheSemantics) {
  auto statuses = [](const TwinRun& r) {
    std::vector<std::string> out;
    for (const auto& line : lines(r.out)) {
      const json v = json::parse(line);
      out.push_back(v["twin"].get<std::string>() + " " + v["status"].get<std::string>() + " " +
                    (v["megatron"].is_string() ? v["megatron"].get<std::string>() : "-") + ": " +
                    v["message"].get<std::string>().substr(0, 60));
    }
    return out;
  };
  const std::string current_dense = fixtures_dir() + "/d98e8a64/dense_ln_mha_gelu_rope_bias.safetensors";
  const TwinRun own = run_twin("fixture --json --twin both " + quote(current_dense));
  EXPECT_EQ(own.code, 0) << own.out << own.err;
  for (const auto& line : lines(own.out)) EXPECT_EQ(json::parse(line)["megatron"], "d98e8a64 (August 2026)") << line;

  // bf16 sigmoid router scores: the current commit rounds them once, the pin at each step. One
  // layer captured on each commit passes at its own commit and fails under the other's, on the
  // first tensor the switches change (the router's probabilities).
  const std::string current_sigmoid = fixtures_dir() + "/d98e8a64/moe_bf16_sigmoid_top2_aux.safetensors";
  const std::string pin_sigmoid = fixtures_dir() + "/d98e8a64/upgrade/moe_bf16_sigmoid_top2_aux.93ddc247.safetensors";
  for (const auto& [golden, other] : {std::pair{current_sigmoid, "93ddc247"}, std::pair{pin_sigmoid, "d98e8a64"}}) {
    const TwinRun own_commit = run_twin("fixture --json --twin both " + quote(golden));
    EXPECT_EQ(own_commit.code, 0) << own_commit.out << own_commit.err;
    const TwinRun held = run_twin("fixture --json --twin both --megatron " + std::string(other) + " " + quote(golden));
    EXPECT_EQ(held.code, 1) << held.out << held.err;
    for (const auto& line : lines(held.out)) {
      const std::string message = json::parse(line)["message"].get<std::string>();
      EXPECT_EQ(message.rfind("1 of ", 0), 0u) << line;
      EXPECT_NE(message.find("first: tap.mlp.router.0 (semantics differ between Megatron-Core " + std::string(other)),
                std::string::npos)
          << line;
    }
  }
  // twin diff of the two captures says the semantics differ, naming the first changed tensor.
  const TwinRun diff = run_twin("diff " + quote(pin_sigmoid) + " " + quote(current_sigmoid));
  EXPECT_EQ(diff.code, 1) << diff.out << diff.err;
  EXPECT_NE(diff.out.find("SEMANTICS DIFFER: semantics differ between these commits (93ddc247 (January 2026) -> "
                          "d98e8a64 (August 2026)): first changed tensor tap.mlp.router.0"),
            std::string::npos)
      << diff.out;
  const TwinRun same_commit = run_twin("diff " + quote(current_sigmoid) + " " + quote(current_sigmoid));
  EXPECT_EQ(same_commit.code, 0) << same_commit.out;
  EXPECT_EQ(same_commit.out.find("semantics"), std::string::npos) << same_commit.out;
  const TwinRun retro = run_twin("fixture --json --megatron d98e8a64ddf3 " +
                                 quote(fixtures_dir() + "/retro_first_layer_divisible.safetensors"));
  EXPECT_EQ(statuses(retro),
            std::vector<std::string>{"reference unsupported d98e8a64 (August 2026): the twins do not implement "
                                     "Retro, which does not exist at Me"});

  const TwinRun unknown = run_twin("fixture --megatron 0123456 " + quote(current_dense));
  EXPECT_EQ(unknown.code, 2);
  EXPECT_EQ(lines(unknown.err).size(), 1u) << unknown.err;
  EXPECT_NE(unknown.err.find("the twins know 93ddc247 (January 2026), d98e8a64 (August 2026)"), std::string::npos)
      << unknown.err;

  // A golden from a Megatron-Core the twins do not know: an error until --megatron names one.
  TempDir dir;
  const twin::SafetensorsFile f = twin::read_safetensors(current_dense);
  std::vector<std::pair<std::string, twin::Tensor>> tensors;
  for (const auto& n : f.names()) tensors.emplace_back(n, f.at(n));
  std::map<std::string, std::string> meta = f.metadata();
  meta["megatron_commit"] = "megatron-core 0.21.0";
  const std::string other = dir.file("other.safetensors");
  twin::write_safetensors(other, tensors, meta);
  const TwinRun err = run_twin("fixture --json " + quote(other));
  EXPECT_EQ(err.code, 2) << err.out;
  ASSERT_EQ(lines(err.out).size(), 1u) << err.out;
  EXPECT_EQ(json::parse(lines(err.out)[0])["status"], "error") << err.out;
  EXPECT_NE(err.out.find("unknown Megatron-Core commit 'megatron-core 0.21.0'"), std::string::npos) << err.out;
  EXPECT_NE(err.out.find("--megatron COMMIT"), std::string::npos) << err.out;
  EXPECT_EQ(run_twin("fixture --megatron d98e8a64 " + quote(other)).code, 0);
}

// A capture of a multi-rank job records its layout in its config: `twin fixture` runs the
// optimized twin at that layout unless --tp / --ep say otherwise, and the reference on the whole
// layer.
TEST(TwinCliFixtures, OptimizedRunsAtTheGoldensOwnLayoutByDefault) {
  TempDir dir;
  // The golden `name` with its config's layout fields set.
  auto at_layout = [&](const std::string& name, const json& layout) {
    const twin::SafetensorsFile f = twin::read_safetensors(fixtures_dir() + "/" + name);
    std::vector<std::pair<std::string, twin::Tensor>> tensors;
    for (const auto& n : f.names()) tensors.emplace_back(n, f.at(n));
    std::map<std::string, std::string> meta = f.metadata();
    json cfg = json::parse(meta.at("config"));
    cfg.update(layout);
    meta["config"] = cfg.dump();
    const std::string path = dir.file("layout_" + name);
    twin::write_safetensors(path, tensors, meta);
    return path;
  };
  auto layouts = [&](const std::string& path, const std::string& flags) {
    const TwinRun r = run_twin("fixture --json --twin both " + flags + " " + quote(path));
    EXPECT_EQ(r.code, 0) << r.out << r.err;
    std::vector<std::string> out;
    for (const auto& line : lines(r.out)) {
      const json v = json::parse(line);
      EXPECT_EQ(v["status"], "pass") << line;
      out.push_back(v["twin"].get<std::string>() + " tp " + std::to_string(v["tp"].get<int>()) +
                    (v["sp"].get<bool>() ? " sp" : "") + " ep " + std::to_string(v["ep"].get<int>()));
    }
    return out;
  };
  using Rows = std::vector<std::string>;
  const std::string dense =
      at_layout("dense_ln_mha_gelu_bias.safetensors", {{"tensor_model_parallel_size", 2}, {"sequence_parallel", true}});
  EXPECT_EQ(layouts(dense, ""), (Rows{"reference tp 1 ep 1", "optimized tp 2 sp ep 1"}));
  EXPECT_EQ(layouts(dense, "--tp 4"), (Rows{"reference tp 1 ep 1", "optimized tp 4 ep 1"}));
  EXPECT_EQ(layouts(dense, "--tp 1"), (Rows{"reference tp 1 ep 1", "optimized tp 1 ep 1"}));
  const std::string moe =
      at_layout("moe_top2_aux_alltoall_presoftmax.safetensors", {{"expert_model_parallel_size", 2}});
  EXPECT_EQ(layouts(moe, ""), (Rows{"reference tp 1 ep 1", "optimized tp 1 ep 2"}));
  EXPECT_EQ(layouts(moe, "--ep 1"), (Rows{"reference tp 1 ep 1", "optimized tp 1 ep 1"}));
}

// --fast: the reference in fast mode (its GEMMs in fp32 through a BLAS) passes every golden in the
// directory within the same counted bound, says so, and computed otherwise than FP32 mode (some
// tensor's error moved); --fast is refused for the optimized twin alone.
TEST(TwinCliFixtures, FastModePassesEveryGoldenAndSaysSo) {
  const std::string all = quote(fixtures_dir()) + "/*.safetensors";
  const TwinRun fast = run_twin("fixture --json --fast " + all), plain = run_twin("fixture --json " + all);
  const auto fl = lines(fast.out), pl = lines(plain.out);
  ASSERT_EQ(fl.size(), pl.size()) << fast.err;
  ASSERT_GT(fl.size(), 10u);
  std::size_t moved = 0;
  for (std::size_t i = 0; i < fl.size(); ++i) {
    const json f = json::parse(fl[i]), p = json::parse(pl[i]);
    SCOPED_TRACE(f["file"].get<std::string>());
    EXPECT_EQ(f["status"], p["status"]) << f["message"];
    EXPECT_EQ(f["fast"], true);
    EXPECT_EQ(p["fast"], false);
    for (std::size_t t = 0; t < f["tensors"].size() && t < p["tensors"].size(); ++t)
      moved += f["tensors"][t]["max_abs"] != p["tensors"][t]["max_abs"];
  }
  EXPECT_GT(moved, 0u) << "fast mode computed every tensor as FP32 mode does";
  const TwinRun refused = run_twin("fixture --fast --twin optimized " + all);
  EXPECT_EQ(refused.code, 2);
  EXPECT_NE(refused.err.find("--fast is a mode of the reference twin"), std::string::npos) << refused.err;
}
