// `twin fixture` with handlers of its own (run in-process): the pass/fail rows, the mark on the
// first tensor out of tolerance, the JSON rows, and the exit-code precedence.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <sstream>
#include <tuple>

#include "core/safetensors.h"
#include "parity/fixture_cmd.h"
#include "tests/core/corrupt_safetensors.h"

using namespace twin;
using namespace twin::cli;
using twin::testing::TempDir;
using json = nlohmann::json;

namespace {

// A fake twin's run: what it "computed" beside what the "golden" expects, through the one comparison.
TwinRun fake_run(const std::vector<std::tuple<std::string, Tensor, Tensor>>& rows) {
  TwinRun run;
  run.expected.emplace();
  for (const auto& [key, actual, expected] : rows) {
    const bool output = key.rfind("output.", 0) == 0;
    // One bf16 store before each: the bound is eps = 2^-8, atol = eps max|e|.
    run.record.add(output ? Role::Output : Role::Tap, key.substr(output ? 7 : 4), actual).rounding.bf16 = 1;
    run.expected->emplace_back(key, expected);
  }
  return run;
}

TwinRun all_pass(const Fixture& fx, const RunMode&) {
  const Tensor& x = fx.tensor("input.hidden_states");
  return fake_run({{"tap.a", x, x}, {"output.hidden_states", x, x}});
}

TwinRun second_and_third_fail(const Fixture& fx, const RunMode&) {
  const Tensor& x = fx.tensor("input.hidden_states");
  const Tensor y = Tensor::from_vector<float>({2}, {1.0f, 2.0f});
  const Tensor y_off = Tensor::from_vector<float>({2}, {1.0f, 2.5f});
  return fake_run({{"tap.first", x, x}, {"tap.second", y_off, y}, {"tap.third", y, x}, {"output.hidden_states", x, x}});
}

TwinRun throws_shape(const Fixture&, const RunMode&) {
  throw ShapeError("linear_qkv: expected shape [8, 8], got [8, 4]");
}
TwinRun compares_nothing(const Fixture&, const RunMode&) {
  TwinRun run;
  run.expected.emplace();
  return run;
}

FixtureHandler fake_lookup(const std::string& kind, TwinKind twin, const RunMode&) {
  if (twin == TwinKind::Optimized) return nullptr;
  if (kind == "fake_pass") return all_pass;
  if (kind == "fake_fail") return second_and_third_fail;
  if (kind == "fake_throw") return throws_shape;
  if (kind == "fake_empty") return compares_nothing;
  return nullptr;
}

struct CmdRun {
  int code;
  std::string out, err;
};

CmdRun run(const std::vector<std::string>& files, bool json_out, const std::string& twin = "reference") {
  FixtureOptions opt;
  opt.files = files;
  opt.json = json_out;
  opt.twin = twin;
  opt.lookup = fake_lookup;
  std::ostringstream out, err;
  const int code = run_fixture(opt, out, err);
  return {code, out.str(), err.str()};
}

std::string fixture(const TempDir& dir, const std::string& kind) {
  const std::string path = dir.file(kind + ".safetensors");
  write_safetensors(path, {{"input.hidden_states", Tensor::from_vector<float>({2, 1, 1}, {1.0f, 2.0f})}},
                    {{"kind", kind}, {"config", R"({"hidden_size": 1})"}});
  return path;
}

std::vector<std::string> lines(const std::string& s) {
  std::vector<std::string> r;
  std::istringstream in(s);
  for (std::string l; std::getline(in, l);) r.push_back(l);
  return r;
}

int count(const std::string& s, const std::string& part) {
  int n = 0;
  for (auto p = s.find(part); p != std::string::npos; p = s.find(part, p + 1)) ++n;
  return n;
}

}  // namespace

TEST(FixtureCommand, PassExits0WithARowPerTensor) {
  TempDir dir;
  const CmdRun r = run({fixture(dir, "fake_pass")}, false);
  EXPECT_EQ(r.code, 0);
  EXPECT_TRUE(r.err.empty());
  EXPECT_EQ(count(r.out, "tap.a"), 1);
  EXPECT_NE(r.out.find("PASS"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find(">>"), std::string::npos);
}

TEST(FixtureCommand, FailExits1AndMarksOnlyTheFirstOutOfTolerance) {
  TempDir dir;
  const CmdRun r = run({fixture(dir, "fake_fail")}, false);
  EXPECT_EQ(r.code, 1);
  EXPECT_EQ(count(r.out, ">>"), 1) << r.out;
  EXPECT_EQ(count(r.out, "<- first out of tolerance"), 1) << r.out;
  for (const auto& l : lines(r.out)) {
    if (l.find(">>") != std::string::npos) {
      EXPECT_NE(l.find("tap.second"), std::string::npos) << l;
    }
  }
  // The worst element of the first failure, and the shape mismatch of the next, are spelled out.
  EXPECT_NE(r.out.find("first out of tolerance: tap.second at [1]: actual 2.5, expected 2"), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("1 bf16 stores before this tensor"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("FAIL: 2 of 4 tensors out of tolerance; first: tap.second"), std::string::npos) << r.out;
}

TEST(FixtureCommand, JsonRowsCarryTheComparisons) {
  TempDir dir;
  const CmdRun r = run({fixture(dir, "fake_fail")}, true);
  EXPECT_EQ(r.code, 1);
  ASSERT_EQ(lines(r.out).size(), 1u);
  const json v = json::parse(r.out);
  EXPECT_EQ(v["status"], "fail");
  EXPECT_EQ(v["kind"], "fake_fail");
  ASSERT_EQ(v["tensors"].size(), 4u);
  const json& t = v["tensors"][1];
  EXPECT_EQ(t["name"], "tap.second");
  EXPECT_EQ(t["shape"], json::array({2}));
  EXPECT_DOUBLE_EQ(t["max_abs"].get<double>(), 0.5);
  EXPECT_DOUBLE_EQ(t["max_rel"].get<double>(), 0.25);
  EXPECT_DOUBLE_EQ(t["tol_abs"].get<double>(), 2.0 / 256);  // eps max|e|: 2^-8 x 2
  EXPECT_DOUBLE_EQ(t["tol_rel"].get<double>(), 1.0 / 256);
  EXPECT_EQ(t["pass"], false);
  EXPECT_EQ(v["tensors"][0]["pass"], true);
  EXPECT_EQ(v["tensors"][2]["pass"], false);  // shape mismatch
}

TEST(FixtureCommand, HandlerShapeErrorIsBadInputExit2) {
  TempDir dir;
  const CmdRun r = run({fixture(dir, "fake_throw")}, true);
  EXPECT_EQ(r.code, 2);
  const json v = json::parse(r.out);
  EXPECT_EQ(v["status"], "error");
  EXPECT_EQ(v["message"], "linear_qkv: expected shape [8, 8], got [8, 4]");
}

TEST(FixtureCommand, HandlerComparingNothingIsNotAPass) {
  TempDir dir;
  EXPECT_EQ(run({fixture(dir, "fake_empty")}, true).code, 1);
}

TEST(FixtureCommand, ExitCodePrecedenceOverFiles) {
  TempDir dir;
  const std::string pass = fixture(dir, "fake_pass"), fail = fixture(dir, "fake_fail"),
                    unsupported = fixture(dir, "no_such_kind"), error = dir.file("empty.safetensors");
  twin::testing::write_bytes(error, "");
  EXPECT_EQ(run({pass, unsupported}, true).code, 3);
  EXPECT_EQ(run({unsupported, pass}, true).code, 3);
  EXPECT_EQ(run({unsupported, fail, pass}, true).code, 1);
  EXPECT_EQ(run({fail, error, unsupported}, true).code, 2);
  EXPECT_EQ(run({error, pass}, true).code, 2);
  EXPECT_EQ(run({pass, pass}, true).code, 0);
  // --twin both: the optimized twin supports nothing here, so pass + unsupported -> 3.
  const CmdRun both = run({pass}, true, "both");
  EXPECT_EQ(both.code, 3);
  EXPECT_EQ(lines(both.out).size(), 2u);
  // Text over several results ends with a summary line.
  const CmdRun text = run({pass, fail, unsupported, error}, false);
  EXPECT_EQ(text.code, 2);
  EXPECT_NE(text.out.find("1 pass, 1 fail, 1 unsupported, 1 error"), std::string::npos) << text.out;
  EXPECT_EQ(lines(text.err).size(), 1u);
}
