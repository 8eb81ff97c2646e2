// The `twin` command line, run as a user runs it: exit codes, one-line errors, --json lines.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>

#include "core/safetensors.h"
#include "core/torch_io.h"
#include "tests/optional_dependency.h"
#include "tests/parity/twin_cli_util.h"

using namespace twin;
using namespace twin::testing;
using json = nlohmann::json;

namespace {

const std::string kConfig = R"({"hidden_size": 8, "num_attention_heads": 2})";

std::string write_fixture(const TempDir& dir, const std::string& name, const std::string& kind) {
  const std::string path = dir.file(name);
  write_safetensors(path, {{"input.hidden_states", Tensor::zeros(DType::F32, {4, 1, 8})}},
                    {{"kind", kind}, {"config", kConfig}});
  return path;
}

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

TEST(TwinCli, EveryCommandHasHelpAndJson) {
  for (const char* cmd : {"", "inspect ", "fixture ", "check "}) {
    const TwinRun r = run_twin(std::string(cmd) + "--help");
    EXPECT_EQ(r.code, 0) << cmd;
    EXPECT_TRUE(has(r.out, "Usage")) << cmd << r.out;
    if (*cmd) EXPECT_TRUE(has(r.out, "--json")) << cmd;
  }
}

TEST(TwinCli, UsageErrorsExit2OnOneLine) {
  for (const char* args : {"", "frobnicate", "fixture", "fixture --twin other x.safetensors", "inspect --bogus x"}) {
    const TwinRun r = run_twin(args);
    EXPECT_EQ(r.code, 2) << args;
    EXPECT_EQ(lines(r.err).size(), 1u) << args << ": " << r.err;
    EXPECT_TRUE(r.out.empty()) << args;
  }
}

// Acceptance 3: every corrupt file is exit 2 and one line naming the file and the fault, from
// both commands. One ctest test per case (they run in parallel).
class TwinCliCorrupt : public ::testing::TestWithParam<CorruptCase> {};

TEST_P(TwinCliCorrupt, Exit2WithOneLine) {
  const CorruptCase& c = GetParam();
  TempDir dir;
  const std::string path = dir.file(c.name + ".safetensors");
  write_bytes(path, c.bytes);
  for (const char* cmd : {"fixture", "inspect"}) {
    const TwinRun text = run_twin(std::string(cmd) + " " + quote(path));
    EXPECT_EQ(text.code, 2) << cmd << " " << c.name;
    EXPECT_TRUE(text.out.empty()) << cmd << " " << c.name << ": " << text.out;
    ASSERT_EQ(lines(text.err).size(), 1u) << cmd << " " << c.name << ": " << text.err;
    EXPECT_TRUE(has(text.err, path) && has(text.err, c.fault)) << text.err;
  }
}

INSTANTIATE_TEST_SUITE_P(EveryFault, TwinCliCorrupt, ::testing::ValuesIn(corrupt_safetensors_cases()),
                         [](const auto& info) { return info.param.name; });

// --json: one object per corrupt file, status error, nothing on stderr.
TEST(TwinCli, CorruptFilesJsonOneErrorObjectEach) {
  TempDir dir;
  const auto cases = corrupt_safetensors_cases();
  for (const auto& c : cases) write_bytes(dir.file(c.name + ".safetensors"), c.bytes);
  for (const char* cmd : {"fixture", "inspect"}) {
    const TwinRun j = run_twin(std::string(cmd) + " --json " + quote(dir.path().string()) + "/*");
    EXPECT_EQ(j.code, 2) << cmd;
    EXPECT_TRUE(j.err.empty()) << j.err;
    const auto ls = lines(j.out);
    ASSERT_EQ(ls.size(), cases.size()) << j.out;
    for (const auto& l : ls) {
      const json v = json::parse(l);
      EXPECT_EQ(v["status"], "error") << l;
      const std::string file = v["file"];
      const std::string name = std::filesystem::path(file).stem().string();
      const auto it = std::find_if(cases.begin(), cases.end(), [&](const CorruptCase& c) { return c.name == name; });
      ASSERT_NE(it, cases.end()) << l;
      EXPECT_TRUE(has(v["message"].get<std::string>(), file) && has(v["message"].get<std::string>(), it->fault)) << l;
    }
  }
}

TEST(TwinCli, BadConfigIsExit2) {
  TempDir dir;
  const std::string path = dir.file("badcfg.safetensors");
  write_safetensors(path, {{"x", Tensor::zeros(DType::F32, {1})}},
                    {{"kind", "dense_layer"}, {"config", R"({"hidden_size": 8, "hiden": 1})"}});
  for (const char* cmd : {"fixture", "inspect"}) {
    const TwinRun r = run_twin(std::string(cmd) + " " + quote(path));
    EXPECT_EQ(r.code, 2) << cmd;
    ASSERT_EQ(lines(r.err).size(), 1u) << r.err;
    EXPECT_TRUE(has(r.err, path) && has(r.err, "'hiden' is unknown")) << r.err;
  }
}

// Acceptance 4, on a kind no twin will ever support (the real files gain handlers over time):
// one well-formed JSON object per file, every key present, exit 3. A README beside the fixtures
// is not a fixture: also `unsupported`.
TEST(TwinCli, FixtureJsonOneObjectPerFileUnsupportedExit3) {
  TempDir dir;
  const std::vector<std::string> files = {write_fixture(dir, "a.safetensors", "no_such_kind"),
                                          write_fixture(dir, "b.safetensors", "no_such_kind_either")};
  write_bytes(dir.file("c_table.json"), R"({"kind": "no_such_table", "entries": []})");
  write_bytes(dir.file("README.md"), "# fixtures\n");
  for (const char* twin : {"reference", "optimized"}) {
    const TwinRun r = run_twin(std::string("fixture --json --twin ") + twin + " " + quote(dir.path().string()) + "/*");
    EXPECT_EQ(r.code, 3) << r.out << r.err;
    EXPECT_TRUE(r.err.empty()) << r.err;
    const auto ls = lines(r.out);
    ASSERT_EQ(ls.size(), 4u) << r.out;
    std::map<std::string, json> by_name;
    for (const auto& l : ls) {
      const json v = json::parse(l);  // throws on malformed JSON
      for (const char* key : {"file", "kind", "twin", "status", "message", "tensors"})
        EXPECT_TRUE(v.contains(key)) << key << " in " << l;
      EXPECT_EQ(v["status"], "unsupported") << l;
      EXPECT_EQ(v["twin"], twin);
      EXPECT_TRUE(v["tensors"].empty());
      EXPECT_FALSE(v["message"].get<std::string>().empty());
      by_name[std::filesystem::path(v["file"].get<std::string>()).filename().string()] = v;
    }
    ASSERT_EQ(by_name.size(), 4u);
    EXPECT_EQ(by_name["a.safetensors"]["kind"], "no_such_kind");
    EXPECT_EQ(by_name["b.safetensors"]["kind"], "no_such_kind_either");
    EXPECT_EQ(by_name["c_table.json"]["kind"], "no_such_table");
    EXPECT_TRUE(by_name["README.md"]["kind"].is_null());
  }
  // --twin both: one object per file and twin.
  const TwinRun both = run_twin("fixture --json --twin both " + quote(files[0]));
  EXPECT_EQ(both.code, 3);
  const auto ls = lines(both.out);
  ASSERT_EQ(ls.size(), 2u);
  EXPECT_EQ(json::parse(ls[0])["twin"], "reference");
  EXPECT_EQ(json::parse(ls[1])["twin"], "optimized");
  // Text: one line per unsupported file.
  const TwinRun text = run_twin("fixture " + quote(files[0]));
  EXPECT_EQ(text.code, 3);
  EXPECT_EQ(lines(text.out).size(), 1u) << text.out;
  EXPECT_TRUE(has(text.out, "unsupported") && has(text.out, "no_such_kind"));
}

TEST(TwinCli, ErrorOutranksUnsupportedOverSeveralFiles) {
  TempDir dir;
  const std::string ok = write_fixture(dir, "a.safetensors", "no_such_kind");
  const std::string bad = dir.file("bad.safetensors");
  write_bytes(bad, "");
  for (const std::string& order : {quote(ok) + " " + quote(bad), quote(bad) + " " + quote(ok)}) {
    const TwinRun r = run_twin("fixture --json " + order);
    EXPECT_EQ(r.code, 2) << order;
    EXPECT_EQ(lines(r.out).size(), 2u);
  }
}

// Acceptance 2 for .pt: a file written by LibTorch's own writer, listed by `twin inspect`.
TEST(TwinCli, InspectPtFileWrittenByLibTorch) {
  TempDir dir;
  const std::string path = dir.file("dump.pt");
  if (!torch_write_available()) {
    write_bytes(path, "PK\x03\x04");
    const TwinRun r = run_twin("inspect " + quote(path));
    EXPECT_EQ(r.code, 2);
    EXPECT_TRUE(has(r.err, "unsupported")) << r.err;
    TWIN_SKIP_OPTIONAL("built without LibTorch: no .pt file to inspect (the plain error for .pt input was checked)");
  }
  write_torch_file(path, {{"weight", Tensor::from_vector<float>({2, 3}, {1, -2, 3, 4, 5, 6})},
                          {"steps", Tensor::from_vector<std::int64_t>({2}, {10, 20})},
                          {"mask", Tensor::from_vector<bool>({3}, {true, false, true})},
                          {"half", Tensor::from_doubles(DType::BF16, {1}, {0.5})}});
  const TwinRun j = run_twin("inspect --json " + quote(path));
  ASSERT_EQ(j.code, 0) << j.err;
  const json v = json::parse(j.out);
  EXPECT_EQ(v["format"], "pt");
  ASSERT_EQ(v["tensors"].size(), 4u);
  EXPECT_EQ(v["tensors"][0]["name"], "weight");
  EXPECT_EQ(v["tensors"][0]["dtype"], "F32");
  EXPECT_EQ(v["tensors"][0]["shape"], json::array({2, 3}));
  EXPECT_EQ(v["tensors"][0]["min"], -2.0);
  EXPECT_EQ(v["tensors"][0]["max"], 6.0);
  EXPECT_DOUBLE_EQ(v["tensors"][0]["mean"].get<double>(), 17.0 / 6.0);
  EXPECT_EQ(v["tensors"][1]["dtype"], "I64");
  EXPECT_EQ(v["tensors"][2]["dtype"], "BOOL");
  EXPECT_EQ(v["tensors"][2]["mean"].get<double>(), 2.0 / 3.0);
  EXPECT_EQ(v["tensors"][3]["dtype"], "BF16");
  const TwinRun text = run_twin("inspect " + quote(path));
  EXPECT_EQ(text.code, 0);
  EXPECT_TRUE(has(text.out, "tensors (4)") && has(text.out, "weight") && has(text.out, "[2, 3]")) << text.out;
  // Any name: recognised by its zip magic.
  const std::string renamed = dir.file("dump.bin");
  std::filesystem::copy_file(path, renamed);
  EXPECT_EQ(run_twin("inspect " + quote(renamed)).code, 0);
  // A corrupt .pt is a one-line error, exit 2.
  write_bytes(path, std::string("PK\x03\x04", 4) + std::string(64, '\0'));
  const TwinRun bad = run_twin("inspect " + quote(path));
  EXPECT_EQ(bad.code, 2);
  EXPECT_EQ(lines(bad.err).size(), 1u) << bad.err;
}
