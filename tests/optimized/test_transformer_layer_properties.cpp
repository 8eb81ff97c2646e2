// Property tests of the optimized dense layer on the simulator. RapidCheck draws >= 100 tiny cases
// per property (tests/parity/dense_case_gen.h) and shrinks a failure to a minimal case whose id
// reruns it: `twin case '<id>'`.
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "parity/bounds.h"
#include "parity/dense_run.h"
#include "tests/parity/dense_case_gen.h"

using namespace twin;
using namespace twin::parity;

namespace {
bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}
}  // namespace

// For every dtype, TP size, SP and dropout: optimized == reference within the bound.
RC_GTEST_PROP(OptimizedLayerProperty, OptimizedEqualsReferenceWithinBound, ()) {
  CaseLimits lim;
  lim.allow_dropout = true;
  const DenseCase c = *gen_dense_case(lim);
  const CaseResult r = run_case(c);
  RC_LOG() << r.report();
  RC_ASSERT(r.pass());
}

// Past one 32-key tile of the attention kernel (s in [33, 37], up to 40 with SP): the online
// softmax carries its max and sum from the first tile into the second, and the causal mask cuts
// the second tile mid-row, at every dtype, TP size, SP, layer number and query-key layer scaling.
RC_GTEST_PROP(OptimizedLayerProperty, SecondKeyTileEqualsReferenceWithinBound, ()) {
  CaseLimits lim;
  lim.min_s = 33;
  lim.max_b = 1;
  lim.max_groups_per_rank = 1;
  const DenseCase c = *gen_dense_case(lim);
  const CaseResult r = run_case(c);
  RC_LOG() << r.report();
  RC_ASSERT(r.pass());
}

// TP 1, 2 and 4 and SP on/off give the same result within the bound.
RC_GTEST_PROP(OptimizedLayerProperty, TensorAndSequenceParallelMatchTp1, ()) {
  CaseLimits lim;
  lim.force_tp = true;
  lim.tp = *rc::gen::element(2, 4);
  const DenseCase c = *gen_dense_case(lim);
  const DenseInputs in = make_inputs(c);
  DenseCase c1 = c;
  c1.tp = 1;
  c1.sp = false;
  const Tensor exact = reference_forward(c, in, true), ref = reference_forward(c, in, false);
  const Tolerance tol = reference_error_bound(c.dtype, max_abs_diff(ref, exact), max_abs(ref));
  const Tensor base = optimized_forward(c1, in, RunOptions{});
  DenseCase other = c;
  other.sp = !c.sp && c.s % c.tp == 0;  // the SP twin of the case when the sequence splits
  for (const DenseCase& v : {c, other}) {
    const Tensor got = optimized_forward(v, in, RunOptions{});
    const Comparison cmp = compare("tp" + std::to_string(v.tp) + (v.sp ? "+sp" : ""), got, base, tol);
    RC_LOG() << to_id(v) << " vs tp=1: max abs " << cmp.max_abs << " bound atol " << tol.atol << " at "
             << cmp.worst_index_str();
    RC_ASSERT(cmp.pass);
  }
}

// Two runs of the optimized twin are bitwise equal.
RC_GTEST_PROP(OptimizedLayerProperty, TwoRunsAreBitwiseEqual, ()) {
  CaseLimits lim;
  lim.allow_dropout = true;
  const DenseCase c = *gen_dense_case(lim);
  const DenseInputs in = make_inputs(c);
  RC_ASSERT(bitwise_equal(optimized_forward(c, in, RunOptions{}), optimized_forward(c, in, RunOptions{})));
}

// A CUDA-graph replay of the layer is bitwise equal to eager execution, at tp 1, 2 and 4 with and
// without SP (the simulator captures each rank's collectives with its kernels).
RC_GTEST_PROP(OptimizedLayerProperty, GraphReplayIsBitwiseEqualToEager, ()) {
  CaseLimits lim;
  lim.allow_dropout = true;
  const DenseCase c = *gen_dense_case(lim);
  RC_TAG("tp " + std::to_string(c.tp) + (c.sp ? " + sp" : ""));
  const DenseInputs in = make_inputs(c);
  RunOptions graph;
  graph.use_graph = true;
  RC_ASSERT(bitwise_equal(optimized_forward(c, in, graph), optimized_forward(c, in, RunOptions{})));
}

// Dropout masks of both twins are identical for one seed: with dropout active in attention and both
// bias-dropout-adds, the outputs agree within the bound (one differing mask element moves an output
// by about |x| / (1 - p), far outside it), at every TP size and with SP, whose ranks number their
// elements globally. (The element-level mask equality is OptimizedOps.DropoutMasksOfBothTwinsAreIdentical.)
RC_GTEST_PROP(OptimizedLayerProperty, DropoutMasksAgreeWithTheReference, ()) {
  DenseCase c = *gen_dense_case();
  c.dropout = *rc::gen::element(0.1, 0.5);
  const CaseResult r = run_case(c);
  RC_LOG() << r.report();
  RC_ASSERT(r.pass());
}

// The core_attention tap's error magnitudes per (token, head) (core/attention_bound.h), computed
// by each twin its own way: the reference from q k^T in fp64 with the mask, the optimized twin
// from its attention kernel's row maxima (the softmax statistics) and the v columns of its
// linear_qkv output, gathered across the ranks. Both read values the twins computed apart (scores,
// v), which differ by the stores in the activation dtype and the fp32 sums of length h
// (linear_qkv) or hn (q . k): every magnitude agrees within twice that, at every dtype, TP size,
// mask and with dropout.
RC_GTEST_PROP(OptimizedLayerProperty, CoreAttentionMagnitudesAreTheReferences, ()) {
  CaseLimits lim;
  lim.allow_dropout = true;
  const DenseCase c = *gen_dense_case(lim);
  RC_LOG() << to_id(c) << "\n";
  const DenseInputs in = make_inputs(c);
  Record ref, opt;
  reference_forward(c, in, false, &ref);
  RunOptions o;
  o.taps = true;
  optimized_forward(c, in, o, &opt);
  auto magnitudes = [](const Record& rec) {
    for (const RecordEntry& e : rec.entries)
      if (e.role == Role::Tap && e.name == "self_attention.core_attention") return e.block_magnitude;
    return Tensor();
  };
  const Tensor want = magnitudes(ref), got = magnitudes(opt);
  RC_ASSERT(want.defined() && got.defined());
  RC_ASSERT(want.shape() == (Shape{c.s, c.b, c.heads}));
  RC_ASSERT(got.shape() == want.shape());
  const double rel = 2.0 * (2.0 * unit_roundoff(c.dtype) +
                            2.0 * gamma_n(std::max(c.hidden, c.kv_channels), unit_roundoff(DType::F32)));
  for (std::int64_t i = 0; i < want.numel(); ++i) {
    RC_LOG() << i << ": reference " << want.at_f64(i) << ", optimized " << got.at_f64(i) << "\n";
    RC_ASSERT(want.at_f64(i) > 0.0);
    RC_ASSERT(std::fabs(got.at_f64(i) - want.at_f64(i)) <= rel * want.at_f64(i));
  }
}
