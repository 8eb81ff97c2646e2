// The optimized dense layer as a whole, on the simulator: the golden fixtures through the
// optimized twin's fixture handler (every tap and the output), the reference on fixed cases with
// a tap-by-tap diff at tp 1, 2 and 4 (taps gathered across ranks), and clear errors for bad input.
#include <gtest/gtest.h>

#include <cctype>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "fixtures/fixture.h"
#include "optimized/transformer_layer.h"
#include "parity/bounds.h"
#include "parity/dense_run.h"
#include "parity/fixture_kinds.h"

using namespace twin;
using namespace twin::parity;

TEST(OptimizedLayer, GoldenDenseFixturesPassThroughTheOptimizedHandler) {
  int files = 0;
  for (const std::string& name : golden_files("dense_")) {
    ++files;
    const Fixture f = load_fixture(name);
    const auto rows = compare_fixture(f, TwinKind::Optimized);
    EXPECT_GE(rows.size(), 8u) << name;
    for (const auto& c : rows)
      EXPECT_TRUE(c.pass) << name << " " << c.name << ": max abs " << c.max_abs << " at " << c.worst_index_str()
                          << " actual " << c.worst_actual << " expected " << c.worst_expected << " (" << c.tol.reason
                          << ") " << c.message;
  }
  EXPECT_GE(files, 7);
}

TEST(OptimizedLayer, FixedCasesMatchTheReferenceTapByTap) {
  const char* ids[] = {
      "dense(h=32,a=4,g=2,d=8,ffn=64,norm=ln,act=gelu,glu=0,bias=1,qkv_bias=0,rope=none,rot=1,qkln=0,mask=causal,s=8,b="
      "2,dtype=fp32,tp=1,sp=0,drop=0,seed=1)",
      "dense(h=24,a=4,g=1,d=16,ffn=48,norm=rms,act=silu,glu=1,bias=0,qkv_bias=1,rope=half,rot=0.5,qkln=1,mask="
      "arbitrary,s=7,b=2,dtype=bf16,tp=1,sp=0,drop=0,seed=2)",
      "dense(h=16,a=2,g=2,d=8,ffn=32,norm=ln,act=relu,glu=0,bias=1,qkv_bias=0,rope=interleaved,rot=1,qkln=1,mask="
      "padding,s=5,b=1,dtype=fp16,tp=1,sp=0,drop=0.1,seed=3)",
      "dense(h=16,a=4,g=2,d=8,ffn=32,norm=rms,act=gelu,glu=1,bias=1,qkv_bias=0,rope=half,rot=1,qkln=0,mask=none,s=40,b="
      "1,dtype=bf16,tp=1,sp=0,drop=0,seed=4)",
  };
  for (const char* id : ids) {
    RunOptions o;
    o.taps = true;
    const CaseResult r = run_case(parse_case_id(id), o);
    EXPECT_TRUE(r.pass()) << r.report();
    EXPECT_TRUE(r.taps.pass()) << r.report() << r.taps.format();
    EXPECT_GE(r.taps.rows.size(), 8u) << id;
  }
}

// apply_query_key_layer_scaling at layer 3 (Megatron's DotProductAttention: norm_factor *= layer
// number, the fp32 softmax multiplies the scores by it again), in every dtype, tap by tap against
// the reference. In exact arithmetic the two factors cancel, so the reference's layer-3 run agrees
// with its own unscaled run within the bound: a twin that drops either factor (scores 3x too large
// or too small) fails one comparison or the other.
TEST(OptimizedLayer, QueryKeyLayerScalingAtALaterLayerMatchesTheReference) {
  for (const char* dtype : {"fp32", "bf16", "fp16"}) {
    const DenseCase c = parse_case_id(fmt::format(
        "dense(h=16,a=4,g=2,d=8,ffn=32,norm=rms,act=silu,glu=1,bias=1,qkv_bias=0,rope=half,rot=1,qkln=0,mask=causal,"
        "layer=3,qkls=1,s=36,b=1,dtype={},tp=2,sp=0,drop=0,seed=21)",
        dtype));
    RunOptions o;
    o.taps = true;
    const CaseResult r = run_case(c, o);
    EXPECT_TRUE(r.pass()) << r.report();
    EXPECT_TRUE(r.taps.pass()) << r.report() << r.taps.format();

    DenseCase unscaled = c;
    unscaled.layer = 1;
    unscaled.qk_layer_scaling = false;
    const DenseInputs in = make_inputs(c), in1 = make_inputs(unscaled);
    const Tensor scaled = reference_forward(c, in, false), exact = reference_forward(c, in, true);
    const Tensor plain = reference_forward(unscaled, in1, false);
    const Comparison cmp = compare(std::string(dtype) + " layer 3 scaled vs unscaled", scaled, plain,
                                   reference_error_bound(c.dtype, max_abs_diff(scaled, exact), max_abs(scaled)));
    EXPECT_TRUE(cmp.pass) << cmp.name << ": max abs " << cmp.max_abs << " (" << cmp.tol.reason << ")";
  }
}

TEST(OptimizedLayer, TapDiffNamesTheFirstDivergingTap) {
  // A wrong weight in linear_fc1 must surface first at mlp.linear_fc1.0, not earlier.
  const DenseCase c = parse_case_id(
      "dense(h=16,a=2,g=2,d=8,ffn=32,norm=ln,act=gelu,glu=0,bias=1,qkv_bias=0,rope=none,rot=1,qkln=0,mask=causal,s=4,b="
      "1,dtype=fp32,tp=1,sp=0,drop=0,seed=5)");
  DenseInputs in = make_inputs(c);
  Record ref_taps, opt_taps;
  reference_forward(c, in, false, &ref_taps);
  Tensor w = in.params.at("mlp.linear_fc1.weight").clone();
  w.data_mut<float>()[3] += 0.5f;
  in.params["mlp.linear_fc1.weight"] = w;
  optimized_forward(c, in, RunOptions{}, &opt_taps);
  const TapDiff d =
      diff_taps(opt_taps, ref_taps, [](const RecordEntry&, const Tensor&) { return Tolerance::for_dtype(DType::F32); });
  EXPECT_EQ(d.first_divergence_name(), "tap.mlp.linear_fc1.0") << d.format();
}

namespace {

// The keys of a record's entries, in order.
std::vector<std::string> keys_of(const Record& r) {
  std::vector<std::string> k;
  for (const auto& e : r.entries) k.push_back(e.key());
  return k;
}
const RecordEntry& entry_of(const Record& r, const std::string& name) {
  for (const auto& e : r.entries)
    if (e.role == Role::Tap && e.name == name) return e;
  throw std::out_of_range("no tap " + name);
}

}  // namespace

// At tp > 1 every rank holds a shard of some taps (column-parallel outputs by heads / columns,
// sequence-parallel slices); the layer gathers them in rank order into the reference's full
// tensors, so the one tap-by-tap comparison applies: the same keys in the same order as the
// reference's record, and every tap within the bound run_case derives from the reference's own error.
TEST(OptimizedLayer, TapsAtTp2And4MatchTheReferenceTapByTap) {
  const char* ids[] = {
      "dense(h=32,a=4,g=2,d=8,ffn=64,norm=ln,act=gelu,glu=0,bias=1,qkv_bias=0,rope=none,rot=1,qkln=0,mask=causal,s=8,b="
      "2,dtype=fp32,tp=2,sp=0,drop=0,seed=11)",
      "dense(h=24,a=4,g=2,d=16,ffn=48,norm=rms,act=silu,glu=1,bias=0,qkv_bias=1,rope=half,rot=0.5,qkln=1,mask="
      "arbitrary,s=8,b=2,dtype=bf16,tp=2,sp=1,drop=0,seed=12)",
      "dense(h=16,a=4,g=4,d=8,ffn=32,norm=ln,act=relu,glu=0,bias=1,qkv_bias=0,rope=interleaved,rot=1,qkln=1,mask="
      "padding,s=5,b=1,dtype=fp16,tp=4,sp=0,drop=0.1,seed=13)",
      "dense(h=16,a=8,g=4,d=8,ffn=32,norm=rms,act=gelu,glu=1,bias=1,qkv_bias=0,rope=half,rot=1,qkln=1,mask=none,s=12,b="
      "2,dtype=bf16,tp=4,sp=1,drop=0,seed=14)",
      "dense(h=16,a=4,g=4,d=8,ffn=32,norm=rms,act=silu,glu=1,bias=1,qkv_bias=0,rope=none,rot=1,qkln=0,mask=causal,s=8,"
      "b="
      "2,dtype=fp32,tp=4,sp=1,drop=0,seed=15)",
  };
  for (const char* id : ids) {
    SCOPED_TRACE(id);
    const DenseCase c = parse_case_id(id);
    RunOptions o;
    o.taps = true;
    const CaseResult r = run_case(c, o);
    EXPECT_TRUE(r.pass()) << r.report();
    EXPECT_TRUE(r.taps.pass()) << r.report() << r.taps.format();
    Record ref;
    reference_forward(c, make_inputs(c), false, &ref);
    std::vector<std::string> rows;
    for (const auto& row : r.taps.rows) rows.push_back(row.name);
    EXPECT_EQ(rows, keys_of(ref)) << r.taps.format();
  }
}

// The rounding points a gathered tap carries are those the ranks executed. Column-parallel taps
// (linear_qkv, linear_fc1) run the same per-element work at any tp. A row-parallel linear's output
// after the all-reduce: each rank's fp32 dot product runs over its in / tp columns only, and the
// tp partials, each stored in T, are summed one by one with a rounding to T after each addition
// (tp - 1 of them). Derived here against the same layer at tp = 1 (one product of length in, one store).
TEST(OptimizedLayer, GatheredTapsCarryTheRanksRoundingPoints) {
  const std::string base =
      "dense(h=16,a=4,g=4,d=8,ffn=32,norm=ln,act=gelu,glu=0,bias=1,qkv_bias=0,rope=none,rot=1,qkln=0,mask=causal,s=4,b="
      "1,dtype=fp32,tp=";
  const DenseCase c1 = parse_case_id(base + "1,sp=0,drop=0,seed=16)");
  const DenseCase c4 = parse_case_id(base + "4,sp=0,drop=0,seed=16)");
  const DenseInputs in = make_inputs(c1);
  Record r1, r4;
  optimized_forward(c1, in, RunOptions{}, &r1);
  optimized_forward(c4, in, RunOptions{}, &r4);
  const int tp = 4;
  const std::int64_t proj_in = 4 * 8, fc2_in = 32;  // np * hn, ffn
  for (const char* name : {"input_layernorm", "self_attention.linear_qkv.0", "self_attention.core_attention"})
    EXPECT_EQ(entry_of(r4, name).rounding, entry_of(r1, name).rounding) << name;
  const RoundingCount p1 = entry_of(r1, "self_attention.linear_proj.0").rounding,
                      p4 = entry_of(r4, "self_attention.linear_proj.0").rounding;
  EXPECT_EQ(p4.fp32, p1.fp32 + (tp - 1)) << p4.describe() << " vs " << p1.describe();
  EXPECT_EQ(p4.reduction, p1.reduction - proj_in + proj_in / tp) << p4.describe() << " vs " << p1.describe();
  const RoundingCount f1 = entry_of(r1, "mlp.linear_fc2.0").rounding, f4 = entry_of(r4, "mlp.linear_fc2.0").rounding;
  EXPECT_EQ(f4.fp32, f1.fp32 + 2 * (tp - 1)) << f4.describe() << " vs " << f1.describe();
  EXPECT_EQ(f4.reduction, f1.reduction - (proj_in - proj_in / tp) - (fc2_in - fc2_in / tp))
      << f4.describe() << " vs " << f1.describe();
  EXPECT_TRUE(entry_of(r4, "mlp.linear_fc2.1").rounding.none());  // the bias: a parameter, exact
  // the caller's count continues from the ranks': the output carries the last tap's points and more
  EXPECT_GE(r4.entries.back().rounding.fp32, f4.fp32);
  EXPECT_EQ(r4.entries.back().key(), "output.hidden_states");
}

// One weight element of one rank's shard perturbed at tp = 4 (the layer shards the full state
// dict itself, so perturbing an element of the full weight inside rank r's slice perturbs rank r's
// shard only): the tap-by-tap diff must name the module that holds the shard as the first
// divergence, and the worst element must sit in the output channel that weight row feeds, at its
// place in the full tensor (which checks that the shards are gathered in rank order).
struct ShardPerturbation {
  const char* param;
  std::int64_t row, col;  // in the full [out, in] weight
  int rank;               // whose shard holds it
  const char* first_divergence;
  std::int64_t worst_channel;  // last index of the worst element in that tap
};

void PrintTo(const ShardPerturbation& p, std::ostream* os) {
  *os << p.param << "[" << p.row << ", " << p.col << "] (rank " << p.rank << ")";
}

class OptimizedLayerTp4Shard : public ::testing::TestWithParam<ShardPerturbation> {};

TEST_P(OptimizedLayerTp4Shard, PerturbedShardNamesTheFirstDivergentTap) {
  const ShardPerturbation& sp = GetParam();
  // h=16, a=g=4, d=8, ffn=32, GLU, tp=4 with SP: per rank one query group (rows 24 r .. 24 r + 23
  // of linear_qkv: q 8, k 8, v 8), 8 of linear_proj's 32 input columns, 8 gate rows (8 r ..) and 8
  // linear rows (32 + 8 r ..) of linear_fc1, 8 of linear_fc2's 32 input columns.
  const DenseCase c = parse_case_id(
      "dense(h=16,a=4,g=4,d=8,ffn=32,norm=rms,act=silu,glu=1,bias=1,qkv_bias=0,rope=none,rot=1,qkln=0,mask=causal,s=8,"
      "b="
      "2,dtype=fp32,tp=4,sp=1,drop=0,seed=17)");
  DenseInputs in = make_inputs(c);
  Record ref_taps, opt_taps;
  reference_forward(c, in, false, &ref_taps);
  Tensor w = in.params.at(sp.param).clone();
  w.data_mut<float>()[sp.row * w.size(1) + sp.col] += 0.5f;
  in.params[sp.param] = w;
  optimized_forward(c, in, RunOptions{}, &opt_taps);
  const TapDiff d =
      diff_taps(opt_taps, ref_taps, [](const RecordEntry&, const Tensor&) { return Tolerance::for_dtype(DType::F32); });
  ASSERT_EQ(d.first_divergence_name(), sp.first_divergence) << d.format();
  const Comparison& row = d.rows[static_cast<std::size_t>(d.first_divergence)];
  EXPECT_EQ(row.worst_index % row.shape.back(), sp.worst_channel) << row.worst_index_str() << "\n" << d.format();
  EXPECT_NE(d.format().find(std::string(sp.first_divergence) + " "), std::string::npos);
  EXPECT_NE(d.format().find("<-- first divergence"), std::string::npos);
}

INSTANTIATE_TEST_SUITE_P(
    Shards, OptimizedLayerTp4Shard,
    ::testing::Values(
        ShardPerturbation{"self_attention.linear_qkv.weight", 24 * 1 + 5, 3, 1, "tap.self_attention.linear_qkv.0", 29},
        ShardPerturbation{"self_attention.linear_proj.weight", 7, 3 * 8 + 2, 3, "tap.self_attention.linear_proj.0", 7},
        ShardPerturbation{"mlp.linear_fc1.weight", 3 * 8 + 4, 0, 3, "tap.mlp.linear_fc1.0", 28},
        ShardPerturbation{"mlp.linear_fc1.weight", 32 + 2 * 8 + 1, 0, 2, "tap.mlp.linear_fc1.0", 49},
        ShardPerturbation{"mlp.linear_fc2.weight", 11, 0 * 8 + 5, 0, "tap.mlp.linear_fc2.0", 11}),
    [](const ::testing::TestParamInfo<ShardPerturbation>& i) {
      std::string n =
          std::string(i.param.param) + "_rank" + std::to_string(i.param.rank) + "_row" + std::to_string(i.param.row);
      for (char& ch : n)
        if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
      return n;
    });

TEST(OptimizedLayer, BadInputGivesClearErrors) {
  const DenseCase c = parse_case_id(
      "dense(h=16,a=4,g=2,d=8,ffn=32,norm=ln,act=gelu,glu=0,bias=1,qkv_bias=0,rope=none,rot=1,qkln=0,mask=causal,s=4,b="
      "1,dtype=fp32,tp=1,sp=0,drop=0,seed=6)");
  const DenseInputs in = make_inputs(c);
  auto expect_msg = [](auto&& f, const std::string& part) {
    try {
      f();
      ADD_FAILURE() << "no exception, expected one mentioning '" << part << "'";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  // a weight of the wrong shape names the key and both shapes
  auto params = in.params;
  params["mlp.linear_fc1.weight"] = Tensor::zeros(DType::F32, {31, 16});
  expect_msg([&] { opt::DenseTransformerLayer l(in.config, params, {}); }, "mlp.linear_fc1.weight");
  expect_msg([&] { opt::DenseTransformerLayer l(in.config, params, {}); }, "[31, 16]");
  params = in.params;
  params.erase("self_attention.linear_proj.weight");
  expect_msg([&] { opt::DenseTransformerLayer l(in.config, params, {}); },
             "missing parameter 'self_attention.linear_proj.weight'");
  // TP that does not divide the query groups
  opt::LayerOptions o;
  o.tp = 4;
  expect_msg([&] { opt::DenseTransformerLayer l(in.config, in.params, o); }, "num_query_groups 2");
  o.tp = 1;
  o.sp = true;
  expect_msg([&] { opt::DenseTransformerLayer l(in.config, in.params, o); }, "sequence parallelism needs tp > 1");
  // hidden states of the wrong size, a bad mask, short rotary_pos_emb
  opt::DenseTransformerLayer layer(in.config, in.params, {});
  expect_msg([&] { layer.forward(Tensor::zeros(DType::F32, {4, 1, 15}), nullptr, nullptr); }, "[4, 1, 15]");
  const Tensor bad_mask = Tensor::from_vector<bool>({1, 1, 4, 3}, std::vector<bool>(12, false));
  expect_msg([&] { layer.forward(in.hidden_states, &bad_mask, nullptr); }, "[1, 1, 4, 3]");
  const Tensor short_rope = Tensor::zeros(DType::F32, {3, 1, 1, 8});
  expect_msg([&] { layer.forward(in.hidden_states, nullptr, &short_rope); }, "rotary_pos_emb");
  TransformerConfig cfg = in.config;
  cfg.window_size = std::vector<int>{2, 0};
  expect_msg([&] { opt::DenseTransformerLayer l(cfg, in.params, {}); }, "window_size");
}
