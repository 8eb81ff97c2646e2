// Property tests of the optimized Retro decoder on the simulator: RapidCheck draws >= 100 random
// Retro cases per property (chunk length, neighbours, retrieved chunks, encoder layers, sequence
// lengths divisible by the chunk length and not, with and without context_mask, fp32, bf16 and fp16,
// dropout on and off; later layer, first layer with the retriever encoder, 6- and 9-layer
// blocks; eager and CUDA-graph replay; forward and backward). A failure prints the case id; TWIN_CASE='<id>' reruns it
// (tests/case_id.h).
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "tests/optimized/retro/retro_case.h"

using namespace twin;
using namespace twin::test;

namespace {

// Small sizes: the simulator runs every thread of every kernel. Blocks are rarer (6-9 layers).
// tp drawn from `tps`; above 1 the heads (a multiple of tp) and ffn = 4 tp shard evenly. The
// drawn case is the whole case a property runs, so its id reruns it (tests/case_id.h).
rc::Gen<RetroCase> gen_retro_case(std::vector<int> tps = {1}) {
  return proptest::rerunnable<RetroCase>(rc::gen::exec([tps] {
    RetroCase c;
    c.kind =
        *rc::gen::weightedElement<RetroKind>({{4, RetroKind::Later}, {4, RetroKind::First}, {1, RetroKind::Block}});
    c.m = *rc::gen::inRange(1, 5);
    c.k = *rc::gen::inRange(1, 4);
    c.chunks = *rc::gen::inRange(1, 3);
    c.encoder_layers = *rc::gen::inRange(1, 3);
    // ns a multiple of m or not (the padding of the first chunk, the attending pad)
    const int l = *rc::gen::inRange(1, 4);
    c.ns = *rc::gen::element(l * c.m, std::max(1, l * c.m - *rc::gen::inRange(0, c.m)));
    c.bs = *rc::gen::inRange(1, 3);
    c.tp = *proptest::gen_uniform_element(tps);
    c.heads = c.tp * *rc::gen::inRange(1, 3);
    c.head_dim = *rc::gen::element(4, 8);
    c.ffn = c.tp > 1 ? 4 * c.tp : *rc::gen::element(8, 16);
    c.block_layers = c.kind == RetroKind::Block ? *rc::gen::element(6, 9) : 6;
    c.dtype = *proptest::gen_case_dtype();
    c.context_mask = c.kind != RetroKind::Later && *rc::gen::arbitrary<bool>();
    c.bias = *rc::gen::weightedElement<bool>({{3, true}, {1, false}});
    c.dropout = *rc::gen::element(0.0, 0.0, 0.2);
    c.seed = *rc::gen::inRange<std::uint64_t>(1, 1000000);
    return c;
  }));
}

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

}  // namespace

// Every tensor both twins record (outputs, the context, the taps, and the backward's gradients of
// every parameter, the hidden states and the context) within compare_record's bound from the
// counted rounding points and the optimized twin's magnitudes. With dropout on, one differing mask
// element would move an output or gradient by about |x| / (1 - p), far outside the bound: the
// dropout streams match too, forward and backward.
RC_GTEST_PROP(OptimizedRetroProperty, OptimizedEqualsReferenceWithinBound, ()) {
  const RetroCase c = *gen_retro_case();
  RC_LOG() << to_id(c) << "\n";
  const RetroRun ref = run_reference(c, /*backward=*/true), opt = run_optimized(c, false, /*backward=*/true);
  bool outputs = false, grads = false;
  for (const auto& cmp : compare_runs(opt, ref)) {
    outputs |= cmp.name == "output.hidden_states";
    grads |= cmp.name == "grad.input.hidden_states";
    if (!cmp.pass)
      RC_LOG() << cmp.name << ": max abs " << cmp.max_abs << " share used " << cmp.share_used << " at "
               << cmp.worst_index_str() << " " << cmp.message << "\n";
    RC_ASSERT(cmp.pass);
  }
  RC_ASSERT(outputs && grads);
  // The optimized twin's own count at each forward entry is the reference's, and at each gradient
  // never more in any field: neither twin widens its bound. (A gradient may count fewer: the
  // optimized twin keeps a parameter gradient's reduction off the path to the input's gradient,
  // where the reference's Linear::backward counts it on.)
  std::map<std::string, RoundingCount> counts;
  for (const RecordEntry& e : ref.record.entries) counts.emplace(e.key(), e.rounding);
  for (const RecordEntry& e : opt.record.entries) {
    const RoundingCount& r = counts.at(e.key());
    const RoundingCount& o = e.rounding;
    const bool ok = e.role == Role::Grad
                        ? o.bf16 <= r.bf16 && o.fp16 <= r.fp16 && o.fp32 <= r.fp32 && o.reduction <= r.reduction
                        : o == r;
    if (!ok) RC_FAIL(e.key() + ": optimized counts " + o.describe() + ", reference " + r.describe());
  }
}

// Two runs of the optimized twin give the same bits (outputs, every tap and every gradient).
RC_GTEST_PROP(OptimizedRetroProperty, TwoRunsAreBitwiseEqual, ()) {
  const RetroCase c = *gen_retro_case();
  RC_LOG() << to_id(c) << "\n";
  const RetroRun a = run_optimized(c, false, true), b = run_optimized(c, false, true);
  RC_ASSERT(a.record.entries.size() == b.record.entries.size());
  for (std::size_t i = 0; i < a.record.entries.size(); ++i) {
    RC_LOG() << a.record.entries[i].name << "\n";
    RC_ASSERT(a.record.entries[i].name == b.record.entries[i].name);
    RC_ASSERT(bitwise_equal(a.record.entries[i].value, b.record.entries[i].value));
  }
}

// At tensor_model_parallel_size 2 and 4 (heads, query groups and ffn sharded as Megatron, the
// row-parallel sums and the column-parallel input gradients all-reduced across simulated ranks,
// the sharded taps and the parameter gradients' shards put back together) the outputs, every tap
// and every gradient equal the reference's within the bound (the ranks' joined count: the
// reference's points plus the sums over ranks) and the TP = 1 twin's within the same bound.
RC_GTEST_PROP(OptimizedRetroProperty, TensorParallelMatchesReferenceAndTp1, ()) {
  const RetroCase c = *gen_retro_case({2, 4});
  RC_LOG() << to_id(c) << "\n";
  const RetroRun ref = run_reference(c, true), opt = run_optimized(c, false, true);
  RetroCase c1 = c;
  c1.tp = 1;
  const RetroRun opt1 = run_optimized(c1, false, true);
  std::size_t compared = 0;
  for (const RetroRun* expected : {&ref, &opt1})
    for (const auto& cmp : compare_runs(opt, *expected)) {
      compared += cmp.name.rfind("output.", 0) == 0 || cmp.name == "grad.input.hidden_states" ||
                  cmp.name == "tap.mlp.linear_fc1.0" || cmp.name == "tap.layers.0.mlp.linear_fc1.0";
      if (!cmp.pass)
        RC_LOG() << cmp.name << ": max abs " << cmp.max_abs << " share used " << cmp.share_used << " " << cmp.message
                 << "\n";
      RC_ASSERT(cmp.pass);
    }
  RC_ASSERT(compared >= 6u);
}

// A CUDA-graph replay of the layer / block equals eager execution bit for bit, at TP 1, 2 and 4
// (the simulator captures the ranks' collectives with their kernels), with the same rounding
// count at the outputs. The graph is captured on other inputs and replayed on the case's
// (run_optimized), so a replay that recomputed nothing would fail.
RC_GTEST_PROP(OptimizedRetroProperty, GraphReplayIsBitwiseEqualToEager, ()) {
  const RetroCase c = *gen_retro_case({1, 1, 2, 4});
  RC_LOG() << to_id(c) << "\n";
  const RetroRun eager = run_optimized(c), graph = run_optimized(c, true);
  RC_ASSERT(bitwise_equal(graph.hidden_states, eager.hidden_states));
  RC_ASSERT(graph.context.has_value() == eager.context.has_value());
  if (eager.context) RC_ASSERT(bitwise_equal(*graph.context, *eager.context));
  std::size_t outputs = 0;
  for (const RecordEntry& e : eager.record.entries)
    for (const RecordEntry& g : graph.record.entries)
      if (e.role == Role::Output && g.role == Role::Output && e.name == g.name) {
        ++outputs;
        RC_LOG() << e.name << ": eager " << e.rounding.describe() << ", replay " << g.rounding.describe() << "\n";
        RC_ASSERT(e.rounding == g.rounding);
      }
  RC_ASSERT(outputs == (eager.context ? 2u : 1u));
}
