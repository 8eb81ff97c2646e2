// The optimized twin's rounding counts against the reference's, module by module: the bound of
// every golden comparison comes from the count the compared twin records itself, so neither twin
// may widen its own bound. For the same config both twins must count the same stores and
// reductions at every recorded tensor, the exceptions written here with their rule. The
// reference's own counts are pinned against Megatron's torch ops in tests/reference/
// test_rounding_counts.cpp.
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <map>
#include <set>
#include <string>

#include "parity/dense_run.h"
#include "tests/parity/dense_case_gen.h"

using namespace twin;
using namespace twin::parity;

namespace {

std::map<std::string, RoundingCount> counts_of(const Record& r) {
  std::map<std::string, RoundingCount> m;
  for (const RecordEntry& e : r.entries) m.emplace(e.key(), e.rounding);
  return m;
}

// The reference's count of a dense-layer tensor as the optimized twin at tp ranks counts it.
// Megatron's row-parallel linears (linear_proj, linear_fc2) each reduce over K / tp on a rank and
// then sum the tp partial outputs (all-reduce, or reduce-scatter with SP) in the activation dtype:
// tp - 1 more stores and K (1 - 1 / tp) less reduction length than the one GEMM of the unsharded
// layer, for every tensor computed from that linear's output on.
RoundingCount sharded(RoundingCount r, const std::string& key, const DenseCase& c) {
  if (c.tp == 1) return r;
  static const std::set<std::string> after_fc2 = {"tap.mlp.linear_fc2.0", "tap.mlp.0", "output.hidden_states"};
  static const std::set<std::string> after_proj = {"tap.self_attention.linear_proj.0",
                                                   "tap.self_attention.0",
                                                   "tap.pre_mlp_layernorm",
                                                   "tap.mlp.linear_fc1.0",
                                                   "tap.mlp.linear_fc2.0",
                                                   "tap.mlp.0",
                                                   "output.hidden_states"};
  auto row_parallel = [&](std::int64_t K) {
    r.store(c.dtype, c.tp - 1);
    r.reduction -= K - K / c.tp;
  };
  if (after_proj.count(key)) row_parallel(std::int64_t(c.heads) * c.kv_channels);
  if (after_fc2.count(key)) row_parallel(c.ffn);
  return r;
}

}  // namespace

// Random dense layers (every dtype, tp 1, 2 and 4, SP on and off): every tensor both twins record
// carries the same count, the row-parallel sums' rule above aside.
RC_GTEST_PROP(OptimizedRoundingCounts, DenseLayerCountsEqualTheReferences, ()) {
  const DenseCase c = *gen_dense_case();
  const DenseInputs in = make_inputs(c);
  Record ref, opt;
  reference_forward(c, in, reference::ComputeMode::FP32, &ref);
  RunOptions o;
  o.taps = true;
  optimized_forward(c, in, o, &opt);
  const auto want = counts_of(ref);
  int compared = 0;
  for (const auto& [key, got] : counts_of(opt)) {
    const auto it = want.find(key);
    RC_ASSERT(it != want.end());
    const RoundingCount want_here = sharded(it->second, key, c);
    RC_LOG() << key << ": optimized " << got.describe() << ", reference " << want_here.describe() << "\n";
    RC_ASSERT(got == want_here);
    ++compared;
  }
  RC_ASSERT(compared == int(want.size()));
}
