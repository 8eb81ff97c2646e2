// The optimized dense layer as a whole, on the simulator: the golden fixtures through the
// optimized twin's fixture handler (every tap and the output), the reference on fixed cases with
// a tap-by-tap diff, and clear errors for bad input.
#include <gtest/gtest.h>

#include <filesystem>

#include "fixtures/fixture.h"
#include "optimized/transformer_layer.h"
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
