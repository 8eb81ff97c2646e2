// `twin case`, `twin check`, `twin layout` and `twin fixture --tp / --ep`, run as a user runs them: what they print
// (text and
// --json), their exit codes, and one-line errors for bad input. Expected values come from outside
// the command: the reference twin's own record (the tap names and order), Megatron-Core's layout
// table (fixtures/megatron-core/retro_decoder_layout_table.json), a golden with a tap perturbed.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "core/safetensors.h"
#include "fixtures/fixture.h"
#include "parity/dense_run.h"
#include "tests/parity/twin_cli_util.h"

using namespace twin;
using namespace twin::testing;
using json = nlohmann::json;

namespace {

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// A TP = 4 case with sequence parallelism, GLU, RoPE and qk-layernorm: every kind of shard the
// optimized twin gathers (heads, query groups, GLU halves, sequence slices, reduced outputs).
const std::string kTp4 =
    "dense(h=16,a=8,g=4,d=8,ffn=32,norm=rms,act=silu,glu=1,bias=1,qkv_bias=0,rope=half,rot=1,qkln=1,mask=causal,s=8,b="
    "2,dtype=bf16,tp=4,sp=1,drop=0,seed=21)";

struct TapLine {
  std::string name;
  double max_abs = 0, max_rel = 0, share = 0;
};

// The rows of the tap table `twin case` prints: "<key> <max abs> <max rel> <share>  <worst> ...".
std::vector<TapLine> tap_lines(const std::string& out) {
  std::vector<TapLine> rows;
  for (const std::string& l : lines(out)) {
    if (l.rfind("tap.", 0) != 0 && l.rfind("output.", 0) != 0) continue;
    std::istringstream in(l);
    TapLine t;
    in >> t.name >> t.max_abs >> t.max_rel >> t.share;
    EXPECT_FALSE(in.fail()) << "not a tap row: " << l;
    rows.push_back(t);
  }
  return rows;
}

}  // namespace

// ---- twin case

TEST(TwinCase, Tp4IdPrintsEveryTapInTheReferenceOrderWithItsError) {
  const TwinRun r = run_twin("case " + quote(kTp4));
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_TRUE(has(r.out, "PASS")) << r.out;
  EXPECT_TRUE(has(r.out, kTp4)) << r.out;
  const std::vector<TapLine> rows = tap_lines(r.out);

  // The same keys, in the same order, as the reference's own record of the unsharded layer.
  const parity::DenseCase c = parity::parse_case_id(kTp4);
  Record ref;
  parity::reference_forward(c, parity::make_inputs(c), false, &ref);
  std::vector<std::string> printed, expected;
  for (const auto& t : rows) printed.push_back(t.name);
  for (const auto& e : ref.entries) expected.push_back(e.key());
  ASSERT_EQ(printed, expected) << r.out;
  EXPECT_GE(printed.size(), 16u);  // 15 taps with qk-layernorm and biases, and the output

  // Each row's numbers are the engine's tap-by-tap diff of this case (printed to 4 significant
  // digits) and within its bound; the biases (parameters handed out) match exactly.
  parity::RunOptions o;
  o.taps = true;
  const parity::CaseResult in_process = parity::run_case(c, o);
  ASSERT_EQ(in_process.taps.rows.size(), rows.size());
  for (std::size_t i = 0; i < rows.size(); ++i) {
    SCOPED_TRACE(rows[i].name);
    EXPECT_NEAR(rows[i].max_abs, in_process.taps.rows[i].max_abs, 5e-4 * in_process.taps.rows[i].max_abs);
    EXPECT_GE(rows[i].share, 0.0);
    EXPECT_LE(rows[i].share, 1.0);
    if (rows[i].name.size() > 2 && rows[i].name.substr(rows[i].name.size() - 2) == ".1") {
      EXPECT_EQ(rows[i].max_abs, 0.0);
    }
  }
  // A bf16 layer does not land bit for bit on the reference: the table shows nonzero errors.
  double largest = 0;
  for (const auto& t : rows) largest = std::max(largest, t.max_abs);
  EXPECT_GT(largest, 0.0);
  // Replayed from each simulated rank's captured graph: the output passes the same bound.
  const TwinRun graph = run_twin("case --graph " + quote(kTp4));
  ASSERT_EQ(graph.code, 0) << graph.out << graph.err;
  EXPECT_TRUE(has(graph.out, "PASS")) << graph.out;
}

TEST(TwinCase, BadIdsAndOptionsExit2WithOneLine) {
  std::string bad_tp = kTp4, bad_dtype = kTp4;
  bad_tp.replace(bad_tp.find("tp=4"), 4, "tp=3");
  bad_dtype.replace(bad_dtype.find("dtype=bf16"), 10, "dtype=bf17");
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"case " + quote(bad_tp), "not divisible by tp=3"},
      {"case " + quote(bad_dtype), "dtype=bf17"},
      {"case " + quote("dense(h=16)"), "missing key"},
      {"case " + quote("moe(h=16)"), "dense("},
      {"case " + quote("retro(kind=later,m=2)"), "TWIN_CASE='retro(kind=later,m=2)'"},
      {"case", "ID is required"},
      {"case --backend tpu " + quote(kTp4), "tpu"},
      {"case --backend cuda --graph " + quote(kTp4), "tp=1"},
  };
  for (const auto& [args, part] : cases) {
    SCOPED_TRACE(args);
    const TwinRun r = run_twin(args);
    EXPECT_EQ(r.code, 2) << r.out << r.err;
    EXPECT_EQ(lines(r.err).size(), 1u) << r.err;
    EXPECT_TRUE(has(r.err, part)) << r.err;
    EXPECT_TRUE(r.out.empty()) << r.out;
  }
}

// ---- twin fixture --tp: the optimized twin sharded over simulated ranks against an unsharded
// golden, its taps gathered across the ranks; a perturbed element of one rank's weight shard is
// named as the first divergence.

namespace {

// h=64, 4 heads (4 query groups), ffn=256, s=16: divisible by tp = 4 with SP.
const char* kShardable = "dense_ln_mha_gelu_bias.safetensors";

std::vector<std::string> tensor_names(const json& j) {
  std::vector<std::string> n;
  for (const json& t : j["tensors"]) n.push_back(t["name"]);
  return n;
}
// The same without the gradients (grad.*).
std::vector<std::string> forward_names(const json& j) {
  std::vector<std::string> n;
  for (const std::string& name : tensor_names(j))
    if (name.rfind("grad.", 0) != 0) n.push_back(name);
  return n;
}

}  // namespace

TEST(TwinFixtureTp, GoldenPassesShardedWithTheSameRows) {
  const std::string golden = quote(golden_dir() + "/" + kShardable);
  const TwinRun tp1 = run_twin("fixture --json --twin optimized " + golden);
  ASSERT_EQ(tp1.code, 0) << tp1.out << tp1.err;
  // The rows, forward and gradients, are the same at every tp (the ranks' shards gathered).
  EXPECT_GT(tensor_names(json::parse(tp1.out)).size(), forward_names(json::parse(tp1.out)).size());
  for (const char* sharding : {"--tp 2", "--tp 4 --sp"}) {
    SCOPED_TRACE(sharding);
    const TwinRun r = run_twin(std::string("fixture --json --twin optimized ") + sharding + " " + golden);
    ASSERT_EQ(r.code, 0) << r.out << r.err;
    const json j = json::parse(r.out);
    EXPECT_EQ(j["status"], "pass");
    EXPECT_EQ(j["tp"], std::string(sharding).find('4') != std::string::npos ? 4 : 2);
    EXPECT_EQ(j["sp"], std::string(sharding).find("--sp") != std::string::npos);
    EXPECT_EQ(tensor_names(j), tensor_names(json::parse(tp1.out)));
    EXPECT_GT(tensor_names(j).size(), forward_names(j).size());
  }
  // --twin both: the reference stays the unsharded layer
  const auto both = lines(run_twin("fixture --json --twin both --tp 4 " + golden).out);
  ASSERT_EQ(both.size(), 2u);
  EXPECT_EQ(json::parse(both[0])["twin"], "reference");
  EXPECT_EQ(json::parse(both[0])["tp"], 1);
  EXPECT_EQ(json::parse(both[1])["tp"], 4);
  // text: the header says how the twin was sharded
  EXPECT_TRUE(has(run_twin("fixture --twin optimized --tp 4 --sp " + golden).out, "optimized twin, tp 4+sp"));
}

TEST(TwinFixtureTp, PerturbedShardOfRank3IsTheFirstDivergence) {
  // linear_fc2 is row parallel: at tp = 4 rank 3 holds input columns 192..255 of [64, 256]. One
  // element there moved by 0.5 (the weights are within +-0.21) changes output channel 5 of
  // linear_fc2 and nothing before it.
  TempDir dir;
  const SafetensorsFile f = read_safetensors(golden_dir() + "/" + kShardable);
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (const auto& n : f.names()) {
    Tensor t = f.at(n);
    if (n == "param.mlp.linear_fc2.weight") {
      ASSERT_EQ(t.shape(), (Shape{64, 256}));
      t = t.clone();
      t.data_mut<float>()[5 * 256 + 200] += 0.5f;
    }
    tensors.emplace_back(n, t);
  }
  const std::string path = dir.file("shard3_fc2.safetensors");
  write_safetensors(path, tensors, f.metadata());
  const TwinRun r = run_twin("fixture --json --twin optimized --tp 4 --sp " + quote(path));
  EXPECT_EQ(r.code, 1) << r.out << r.err;
  const json j = json::parse(r.out);
  EXPECT_EQ(j["status"], "fail");
  EXPECT_TRUE(has(j["message"], "first: tap.mlp.linear_fc2.0")) << j["message"];
  for (const json& t : j["tensors"]) {
    if (t["name"] == "tap.mlp.linear_fc2.0") break;
    EXPECT_EQ(t["pass"], true) << t.dump();
  }
}

TEST(TwinFixtureTp, BadShardingExit2WithOneLine) {
  const std::string golden = quote(golden_dir() + "/" + kShardable);
  const std::string mask = quote(golden_dir() + "/dense_ln_mha_explicit_mask.safetensors");  // s = 10
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"fixture --twin optimized --tp 3 " + golden, "tp 3 must divide num_attention_heads 4"},
      {"fixture --twin optimized --tp 4 --sp " + mask, "not divisible by tp 4"},
      {"fixture --twin optimized --sp " + golden, "--sp needs --tp > 1"},
      {"fixture --tp 2 " + golden, "the reference is the unsharded layer"},
      {"fixture --twin optimized --tp 0 " + golden, "--tp"},
  };
  for (const auto& [args, part] : cases) {
    SCOPED_TRACE(args);
    const TwinRun r = run_twin(args);
    EXPECT_EQ(r.code, 2) << r.out;
    EXPECT_EQ(lines(r.err).size(), 1u) << r.err;
    EXPECT_TRUE(has(r.err, part)) << r.err;
  }
  // an error inside a file names the file
  EXPECT_TRUE(has(run_twin("fixture --twin optimized --tp 4 --sp " + mask).err, "dense_ln_mha_explicit_mask"));
}

// ---- twin fixture --ep: the optimized MoE layer over simulated expert-parallel ranks against the
// same ep = 1 golden. Routing is exact; the alltoall exchange moves values without rounding, so
// every row's error and bound are the ep = 1 ones, but the experts' weight gradients (each sums
// every rank's replica of its rows, scaled by 1 / ep, so every gradient's bound counts the longer
// sums); the allgather dispatcher's reduce-scatter
// adds rounding points to the combine (mlp.0, the output and the gradients), and only there.

TEST(TwinFixtureEp, MoEGoldenPassesOverExpertParallelRanksWithTheSameRows) {
  const std::string golden = quote(golden_dir() + "/moe_top2_aux_allgather.safetensors");  // E = 4
  for (const char* dispatcher : {"alltoall", "allgather"}) {
    SCOPED_TRACE(dispatcher);
    const std::string file = std::string(dispatcher) == "allgather"
                                 ? golden
                                 : quote(golden_dir() + "/moe_top2_aux_alltoall_presoftmax.safetensors");
    const TwinRun ep1 = run_twin("fixture --json --twin optimized " + file);
    ASSERT_EQ(ep1.code, 0) << ep1.out << ep1.err;
    const json one = json::parse(ep1.out);
    for (int ep : {2, 4}) {
      SCOPED_TRACE(ep);
      const TwinRun r = run_twin("fixture --json --twin optimized --ep " + std::to_string(ep) + " " + file);
      ASSERT_EQ(r.code, 0) << r.out << r.err;
      const json j = json::parse(r.out);
      EXPECT_EQ(j["status"], "pass");
      EXPECT_EQ(j["ep"], ep);
      ASSERT_EQ(tensor_names(j), tensor_names(one));
      EXPECT_GE(tensor_names(j).size(), 15u);
      bool combined = false;  // from the combine on (allgather: the reduce-scatter's roundings)
      for (std::size_t i = 0; i < j["tensors"].size(); ++i) {
        const std::string name = j["tensors"][i]["name"];
        combined = combined || name == "tap.mlp.0";
        if (combined && std::string(dispatcher) == "allgather") continue;
        if (name.rfind("grad.", 0) == 0) {
          // every gradient's count carries the experts' longer weight-gradient sums
          EXPECT_GE(j["tensors"][i]["tol_abs"], one["tensors"][i]["tol_abs"]) << name;
          if (name.find(".local_experts.") == std::string::npos)
            EXPECT_EQ(j["tensors"][i]["max_abs"], one["tensors"][i]["max_abs"]) << name;
          continue;
        }
        EXPECT_EQ(j["tensors"][i]["max_abs"], one["tensors"][i]["max_abs"]) << name;
        EXPECT_EQ(j["tensors"][i]["tol_abs"], one["tensors"][i]["tol_abs"]) << name;
      }
      EXPECT_TRUE(combined);
    }
  }
  EXPECT_TRUE(has(run_twin("fixture --twin optimized --ep 2 " + golden).out,
                  "optimized twin, ep 2, Megatron-Core 93ddc247 (January 2026)]"));
  // what cannot run at ep > 1 is unsupported (exit 3), bad options exit 2
  const TwinRun e8 = run_twin("fixture --twin optimized --ep 8 " + golden);
  EXPECT_EQ(e8.code, 3) << e8.out << e8.err;
  EXPECT_TRUE(has(e8.out, "num_moe_experts 4 not divisible by expert_model_parallel_size 8")) << e8.out;
  const TwinRun dense = run_twin("fixture --twin optimized --ep 2 " + quote(golden_dir() + "/" + kShardable));
  EXPECT_EQ(dense.code, 3) << dense.out << dense.err;
  EXPECT_TRUE(has(dense.out, "does not run fixture kind 'dense_layer' at ep > 1")) << dense.out;
  for (const char* args : {"fixture --ep 2 ", "fixture --twin optimized --ep 0 "}) {
    const TwinRun r = run_twin(args + golden);
    EXPECT_EQ(r.code, 2) << args;
    EXPECT_EQ(lines(r.err).size(), 1u) << r.err;
    EXPECT_TRUE(has(r.err, "--ep")) << r.err;
  }
}

// ---- twin layout: Megatron-Core's own layouts for 1..24 layers

TEST(TwinLayout, MatchesMegatronsTableAndRejectsTooFewLayers) {
  std::ifstream f(golden_dir() + "/retro_decoder_layout_table.json");
  ASSERT_TRUE(f) << golden_dir();
  const json table = json::parse(f);
  int layouts = 0, errors = 0;
  for (const json& e : table["entries"]) {
    const int n = e["num_layers"];
    SCOPED_TRACE(n);
    const TwinRun r = run_twin("layout --json --num-layers " + std::to_string(n));
    if (e.contains("error")) {
      ++errors;
      EXPECT_EQ(r.code, 2);
      EXPECT_EQ(lines(r.err).size(), 1u) << r.err;
      EXPECT_TRUE(has(r.err, "num_layers >= 6") && has(r.err, "got num_layers=" + std::to_string(n))) << r.err;
      EXPECT_TRUE(r.out.empty());
      continue;
    }
    ++layouts;
    ASSERT_EQ(r.code, 0) << r.err;
    const json got = json::parse(r.out);
    EXPECT_EQ(got["num_layers"], n);
    EXPECT_EQ(got["layers"], e["layers"]);
  }
  EXPECT_GE(layouts, 10);
  EXPECT_GE(errors, 5);

  // text: one line per layer, "layer <number>: <kind>", the same kinds
  const json& last = table["entries"].back();
  const int n = last["num_layers"];
  const TwinRun text = run_twin("layout --num-layers " + std::to_string(n));
  ASSERT_EQ(text.code, 0);
  const auto ls = lines(text.out);
  ASSERT_EQ(ls.size(), static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i)
    EXPECT_EQ(ls[i], "layer " + std::to_string(i + 1) + ": " + last["layers"][i].get<std::string>());
}

TEST(TwinLayout, UsageErrorsExit2WithOneLine) {
  for (const char* args :
       {"layout", "layout --num-layers abc", "layout --num-layers 99999999999", "layout --num-layers 7 extra"}) {
    SCOPED_TRACE(args);
    const TwinRun r = run_twin(args);
    EXPECT_EQ(r.code, 2);
    EXPECT_EQ(lines(r.err).size(), 1u) << r.err;
    EXPECT_TRUE(has(r.err, "--num-layers") || has(r.err, "extra")) << r.err;
    EXPECT_TRUE(r.out.empty());
  }
}

// ---- twin check, on a fixture folder of two files: a golden as Megatron wrote it, and a copy
// with one tap scaled by 1.01 (far outside any bound at fp32), so the fixture rows must name it.

namespace {

const char* kGolden = "dense_ln_mha_gelu_bias.safetensors";
const char* kPerturbedTap = "tap.mlp.linear_fc1.0";
const char* kUnshardable = "dense_ln_gqa_gelu_bias_qkln.safetensors";  // 6 heads in 3 groups: not at tp 2

// TWIN_SOURCE_DIR for the child `twin`, pointing at a tree whose fixtures/megatron-core holds the
// three files; restored when done.
class CheckFolder {
 public:
  CheckFolder() {
    const std::filesystem::path fdir = std::filesystem::path(dir_.path()) / "fixtures" / "megatron-core";
    std::filesystem::create_directories(fdir);
    const std::string src = golden_dir() + "/" + kGolden;
    std::filesystem::copy_file(src, fdir / kGolden);
    std::filesystem::copy_file(golden_dir() + "/" + kUnshardable, fdir / kUnshardable);
    const SafetensorsFile f = read_safetensors(src);
    std::vector<std::pair<std::string, Tensor>> tensors;
    bool found = false;
    for (const auto& n : f.names()) {
      Tensor t = f.at(n);
      if (n == kPerturbedTap) {
        std::vector<double> v = t.to_f64();
        for (double& x : v) x *= 1.01;
        t = Tensor::from_doubles(t.dtype(), t.shape(), v);
        found = true;
      }
      tensors.emplace_back(n, t);
    }
    EXPECT_TRUE(found) << kGolden << " has no " << kPerturbedTap;
    // `twin check` names a fixture row by kind and case: the copy gets its own case name
    auto meta = f.metadata();
    meta["case"] = "perturbed_" + meta["case"];
    write_safetensors((fdir / ("perturbed_" + std::string(kGolden))).string(), tensors, meta);
    if (const char* old = std::getenv("TWIN_SOURCE_DIR")) old_ = old;
    setenv("TWIN_SOURCE_DIR", dir_.path().c_str(), 1);
  }
  ~CheckFolder() {
    if (old_.empty())
      unsetenv("TWIN_SOURCE_DIR");
    else
      setenv("TWIN_SOURCE_DIR", old_.c_str(), 1);
  }

 private:
  TempDir dir_;
  std::string old_;
};

}  // namespace

TEST(TwinCheck, JsonRowsNameThePerturbedTapAndExit1) {
  CheckFolder folder;
  const TwinRun r = run_twin("check --json");
  EXPECT_EQ(r.code, 1) << r.err;
  const json j = json::parse(r.out);
  EXPECT_EQ(j["command"], "check");
  EXPECT_EQ(j["status"], "fail");
  std::set<std::string> dense_tp, fixture_ranks;
  int fixture_rows = 0;
  for (const json& row : j["rows"]) {
    SCOPED_TRACE(row.dump());
    const std::string layer = row["layer"], status = row["status"], detail = row["detail"];
    if (layer.rfind("dense ", 0) == 0) {
      dense_tp.insert(row["tp"].get<std::string>());
      EXPECT_EQ(status, "pass");
      EXPECT_LE(row["max_error"].get<double>(), row["bound"].get<double>());
      EXPECT_LE(row["share"].get<double>(), 1.0);
      continue;
    }
    ++fixture_rows;
    fixture_ranks.insert(row["tp"].get<std::string>());
    if (row["tp"] != "1" && has(layer, "qkln")) {
      EXPECT_EQ(status, "unsupported");  // a sharding the layer refuses is not an error
      EXPECT_TRUE(has(detail, "does not shard")) << detail;
    } else if (has(layer, "perturbed_")) {
      EXPECT_EQ(status, "fail");  // both twins: the golden itself is off at that tap
      EXPECT_TRUE(has(detail, std::string("first failing: ") + kPerturbedTap)) << detail;
      EXPECT_GT(row["share"].get<double>(), 1.0);
    } else {
      EXPECT_EQ(status, "pass");
      EXPECT_LE(row["share"].get<double>(), 1.0);
    }
  }
  // Three files, each through the reference and the optimized twin; the two named dense_* also
  // through the optimized twin at tp 2 with and without SP.
  EXPECT_EQ(fixture_rows, 10);
  EXPECT_EQ(fixture_ranks, (std::set<std::string>{"1", "2", "2+sp"}));
  EXPECT_EQ(dense_tp, (std::set<std::string>{"1", "2", "2+sp", "4", "4+sp"}));
}

TEST(TwinCheck, TextTableCountsTheFailures) {
  CheckFolder folder;
  const TwinRun r = run_twin("check");
  EXPECT_EQ(r.code, 1) << r.err;
  const auto ls = lines(r.out);
  ASSERT_GE(ls.size(), 3u) << r.out;
  EXPECT_TRUE(has(ls.front(), "layer") && has(ls.front(), "max error") && has(ls.front(), "status")) << ls.front();
  int fail_lines = 0;
  for (std::size_t i = 1; i + 1 < ls.size(); ++i)
    if (has(ls[i], "  fail")) {
      ++fail_lines;
      EXPECT_TRUE(has(ls[i], kPerturbedTap)) << ls[i];
    }
  EXPECT_EQ(fail_lines, 2);
  EXPECT_EQ(ls.back(), "twin check: " + std::to_string(ls.size() - 2) + " rows, 2 failed, 0 errors");
  EXPECT_TRUE(has(r.err, "[1/")) << r.err;  // progress goes to stderr, not into the table
}

TEST(TwinCheck, UsageErrorsExit2) {
  const TwinRun r = run_twin("check --bogus");
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(lines(r.err).size(), 1u) << r.err;
  EXPECT_TRUE(r.out.empty());
}
