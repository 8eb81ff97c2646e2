// Property tests of the optimized MoE layer on the simulator: RapidCheck draws >= 100 random MoE
// layer configs (router score function, pre-softmax, group-limited top-k, scaling, expert bias,
// capacity and drop policies, losses, shared experts and gate, biases, GLU, fp32, bf16 and fp16) and
// checks the optimized twin against the reference MoETransformerLayer.
//
// The bound is the dense twin's (parity/bounds.h reference_error_bound): the reference runs twice,
// mirroring Megatron's rounding (FP32 mode) and exactly (fp64, no rounding); the optimized output
// may differ from the reference by the dtype default plus twice the reference's own error.
// Routing maps and tokens per expert must be equal; a case whose maps differ only because two
// scores of one token lie within the logits' rounding of each other (a near-tie that either
// implementation may resolve either way) is discarded, never passed.
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <algorithm>
#include <memory>
#include <set>

#include "optimized/moe/moe_transformer_layer.h"
#include "parity/bounds.h"
#include "parity/golden.h"
#include "parity/dense_case.h"
#include "tests/case_id.h"
#include "tests/optimized/moe_case.h"
#include "reference/moe/moe_transformer_layer.h"

using namespace twin;
using namespace twin::parity;
using namespace twin::moe_case;

// Every dtype: optimized == reference over two forwards of the same layers (the global aux loss
// and the expert-bias counter carry state from the first to the second). Routing maps and tokens
// per expert are equal; the output is within twice the reference's own error; and EVERY entry of
// both records (taps, tap_in, router probabilities and logits, the expert inputs, aux losses,
// state) is compared by the golden engine within its counted bound, a key recorded on one side
// only failing.
RC_GTEST_PROP(OptimizedMoEProperty, OptimizedEqualsReferenceWithinBound, ()) {
  const MoECase first = make_case(*gen_opt_moe_case());
  RC_LOG() << describe(first) << "\n";
  RC_TAG(dtype_name(first.dense.dtype), first.config.moe_router_load_balancing_type);
  const auto ref_layer = make_reference(first, false), exact_layer = make_reference(first, true);
  opt::MoETransformerLayer opt_layer(first.config, first.params, opt::LayerOptions{});
  for (const MoECase& m : {first, with_second_input(first)}) {
    Record ref_rec, opt_rec;
    const Tensor ref = reference_forward(m, *ref_layer, &ref_rec), exact = reference_forward(m, *exact_layer, nullptr);
    const Tensor got = optimized_forward(m, opt_layer, &opt_rec);
    std::set<std::string> ref_keys, opt_keys;
    for (const RecordEntry& e : ref_rec.entries) ref_keys.insert(e.key());
    for (const RecordEntry& e : opt_rec.entries) opt_keys.insert(e.key());
    for (const std::string& k : opt_keys)
      if (!ref_keys.count(k)) RC_FAIL(k + ": only the optimized twin recorded it");
    for (const std::string& k : ref_keys)
      if (!opt_keys.count(k) && !inside_an_expert(k)) RC_FAIL(k + ": only the reference recorded it");
    Expected expected;
    for (auto& [key, t] : expected_of(ref_rec))
      if (!inside_an_expert(key)) expected.emplace_back(key, t);
    const std::vector<Comparison> rows = compare_record(opt_rec, expected, "optimized");
    const auto failed = std::find_if(rows.begin(), rows.end(), [](const Comparison& c) { return !c.pass; });
    if (!bitwise_equal(*ref_rec.find("mlp.router.1"), *opt_rec.find("mlp.router.1")) ||
        (failed != rows.end() && failed->name == "tap.mlp.router.0")) {
      // Routing decided by a near-tie: two logits of a token within both twins' logits difference
      // plus two roundings, which either implementation may order either way (the top-k choice, and
      // with pad_to_capacity which tied token fills an expert's capacity).
      const Tensor& rl = *ref_rec.find("mlp.router.logits");
      const Tensor& ol = *opt_rec.find("mlp.router.logits");
      const double gap = 2 * max_abs_diff(rl, ol) + 4 * unit_roundoff(rl.dtype()) * max_abs(rl);
      RC_LOG() << "routing differs; near-tie gap " << gap << "\n";
      RC_ASSERT(has_near_tie(rl, *m.config.num_moe_experts, gap));
      RC_DISCARD("routing decided by a near-tie");
    }
    std::map<std::string, RoundingCount> ref_counts;
    for (const RecordEntry& e : ref_rec.entries) ref_counts.emplace(e.key(), e.rounding);
    for (const RecordEntry& e : opt_rec.entries)
      if (!(e.rounding == ref_counts.at(e.key())))
        RC_FAIL(e.key() + ": optimized counts " + e.rounding.describe() + ", reference " +
                ref_counts.at(e.key()).describe());
    for (const Comparison& row : rows)
      if (!row.pass)
        RC_FAIL(row.name + ": max abs " + std::to_string(row.max_abs) + ", share of the bound used " +
                std::to_string(row.share_used) + " " + row.message);
    const Tolerance tol = reference_error_bound(m.dense.dtype, max_abs_diff(ref, exact), max_abs(ref));
    const Comparison cmp = compare("output.hidden_states", got, ref, tol);
    RC_LOG() << "max abs " << cmp.max_abs << " bound atol " << tol.atol << " rtol " << tol.rtol << " at "
             << cmp.worst_index_str() << "\n";
    RC_ASSERT(cmp.pass);
  }
}

// Two runs of the optimized MoE layer are bitwise equal (outputs and every recorded entry).
RC_GTEST_PROP(OptimizedMoEProperty, TwoRunsAreBitwiseEqual, ()) {
  const MoECase m = make_case(*gen_opt_moe_case());
  RC_LOG() << describe(m) << "\n";
  Record a, b;
  RC_ASSERT(bitwise_equal(optimized_forward(m, &a), optimized_forward(m, &b)));
  RC_ASSERT(a.entries.size() == b.entries.size());
  for (std::size_t i = 0; i < a.entries.size(); ++i) {
    RC_LOG() << a.entries[i].key() << "\n";
    RC_ASSERT(a.entries[i].key() == b.entries[i].key());
    RC_ASSERT(bitwise_equal(a.entries[i].value, b.entries[i].value));
  }
}

// A CUDA-graph replay of the router and postprocess phases (the expert compute eager between them)
// is bitwise equal to eager execution, on the first replay and on a second one with new inputs of
// the same shape (the graphs then run on the re-uploaded inputs).
RC_GTEST_PROP(OptimizedMoEProperty, GraphReplayIsBitwiseEqualToEager, ()) {
  const MoECase m = make_case(*gen_opt_moe_case());
  RC_LOG() << describe(m) << "\n";
  opt::MoEForwardInputs in;
  in.attention_mask = m.attention_mask.defined() ? &m.attention_mask : nullptr;
  in.rotary_pos_emb = m.rotary_pos_emb.defined() ? &m.rotary_pos_emb : nullptr;
  opt::ForwardOptions eager, graph;
  eager.training = graph.training = true;
  graph.use_graph = true;
  opt::MoETransformerLayer a(m.config, m.params, opt::LayerOptions{}), b(m.config, m.params, opt::LayerOptions{});
  RC_ASSERT(bitwise_equal(a.forward(m.hidden_states, in, graph).hidden_states,
                          b.forward(m.hidden_states, in, eager).hidden_states));
  RC_ASSERT(a.tokens_per_expert() == b.tokens_per_expert());
  // Second call: other hidden states, the captured graphs replayed.
  std::vector<double> v = m.hidden_states.to_f64();
  for (std::size_t i = 0; i < v.size(); i += 3) v[i] = -v[i];  // negation is exact in any dtype
  const Tensor x2 = Tensor::from_doubles(m.hidden_states.dtype(), m.hidden_states.shape(), v);
  RC_ASSERT(bitwise_equal(a.forward(x2, in, graph).hidden_states, b.forward(x2, in, eager).hidden_states));
  RC_ASSERT(a.tokens_per_expert() == b.tokens_per_expert());
}

// Expert parallelism: ep = 2, 4 and 8 (those dividing num_moe_experts; even E drawn) run ep
// simulated ranks with the drawn dispatcher, each rank computing its E / ep local experts on the
// rows of all ranks. Routing is exact: the routing map, the router's probabilities and the tokens
// per expert are bitwise the ep = 1 ones. The output is within the reference's bound at every ep.
// On the simulator every entry up to the experts' output is moreover bitwise the ep = 1 one, with
// the same rounding count: each row meets its expert's weights and probability in the ep = 1
// arithmetic (the simulator's GEMM computes each row from that row alone), and communication
// moves values without rounding. With the alltoall dispatcher the combine adds each token's expert
// rows in the ep = 1 order on the token's own rank, so the rest is bitwise too; the allgather
// dispatcher's reduce-scatter adds the ranks' partial sums, whose roundings its count carries.
RC_GTEST_PROP(OptimizedMoEProperty, ExpertParallelSizesAgree, ()) {
  const MoECase m = make_case(*gen_opt_moe_case(2));
  const int E = *m.config.num_moe_experts;
  RC_LOG() << describe(m) << "\n";
  Record ref_rec, one;
  const Tensor ref = reference_forward(m, false, &ref_rec), exact = reference_forward(m, true, nullptr);
  const Tensor base = optimized_forward(m, &one, 1);
  const Tolerance tol = reference_error_bound(m.dense.dtype, max_abs_diff(ref, exact), max_abs(ref));
  int runs = 0;
  for (int ep : {2, 4, 8}) {
    if (E % ep != 0) continue;
    ++runs;
    RC_LOG() << "ep " << ep << "\n";
    Record rec;
    const Tensor got = optimized_forward(m, &rec, ep);
    RC_ASSERT(bitwise_equal(*rec.find("mlp.router.1"), *one.find("mlp.router.1")));
    RC_ASSERT(bitwise_equal(*rec.find("mlp.experts.tokens_per_expert", Role::TapIn),
                            *one.find("mlp.experts.tokens_per_expert", Role::TapIn)));
    if (bitwise_equal(*one.find("mlp.router.1"), *ref_rec.find("mlp.router.1"))) {  // else a near-tie (above)
      const Comparison cmp = compare("output.hidden_states", got, ref, tol);
      RC_LOG() << "max abs " << cmp.max_abs << " bound atol " << tol.atol << " rtol " << tol.rtol << "\n";
      RC_ASSERT(cmp.pass);
    }
    const bool alltoall = m.config.moe_token_dispatcher_type == "alltoall";
    if (alltoall) RC_ASSERT(bitwise_equal(got, base));
    // The same taps as at ep 1 but the experts' linears' (recorded at ep 1 only: at ep > 1 each
    // expert's rows are on its owner rank), in the same order.
    Record at_ep1;
    for (const RecordEntry& e : one.entries)
      if (e.key().find(".linear_fc") == std::string::npos || e.key().find("local_experts.") == std::string::npos)
        at_ep1.entries.push_back(e);
    RC_ASSERT(one.entries.size() - at_ep1.entries.size() == std::size_t(2 * E));
    RC_ASSERT(rec.entries.size() == at_ep1.entries.size());
    bool combined = false;  // from the combine (mlp.0) on
    for (std::size_t i = 0; i < rec.entries.size(); ++i) {
      RC_LOG() << rec.entries[i].key() << "\n";
      RC_ASSERT(rec.entries[i].key() == at_ep1.entries[i].key());
      combined = combined || rec.entries[i].key() == "tap.mlp.0";
      if (combined && !alltoall) continue;
      RC_ASSERT(rec.entries[i].rounding == at_ep1.entries[i].rounding);
      RC_ASSERT(bitwise_equal(rec.entries[i].value, at_ep1.entries[i].value));
    }
    RC_ASSERT(combined);
  }
  RC_ASSERT(runs >= 1);  // every even E in [2, 8] has ep = 2
}

// ---- backward ----------------------------------------------------------------------------------

// Every dtype: the optimized MoE layer's gradients (the input's and every parameter's: attention
// half, router, each expert, shared experts and gate) equal the reference's within the bound the
// golden engine derives from the optimized twin's counted rounding points and each gradient's
// magnitude, which counts no more than the reference's. Routing decided by a near-tie is discarded
// as in the forward's property.
RC_GTEST_PROP(OptimizedMoEProperty, BackwardEqualsReferenceWithinBound, ()) {
  const MoECase m = make_backward_case();
  RC_LOG() << describe(m) << "\n";
  RC_TAG(dtype_name(m.dense.dtype), m.config.moe_router_load_balancing_type);
  const Tensor dout = output_gradient(m);
  const Record ref = reference_with_gradients(m, dout), got = optimized_with_gradients(m, dout);
  discard_if_routed_on_a_near_tie(ref, got, *m.config.num_moe_experts);
  Expected expected;
  std::map<std::string, RoundingCount> ref_counts;
  for (const RecordEntry& e : ref.entries)
    if (e.role == Role::Grad) {
      expected.emplace_back(e.key(), e.value);
      ref_counts.emplace(e.key(), e.rounding);
    }
  // The counts that set the bound, checked against the reference's: never more in any field (a
  // larger count would widen the bound). They may be fewer by exactly the attention half's weight
  // gradients: the optimized twin keeps a weight gradient's GEMM off the chain to the input's
  // gradient (attention_backward.cuh's leaves), the reference's Linear::backward counts it on the
  // chain; MoELayer's own backward counts as the reference does.
  Record got_grads;  // the forward's entries are the forward property's
  for (const RecordEntry& e : got.entries) {
    if (e.role != Role::Grad) continue;
    got_grads.entries.push_back(e);
    const RoundingCount& r = ref_counts.at(e.key());
    if (e.rounding.bf16 > r.bf16 || e.rounding.fp16 > r.fp16 || e.rounding.fp32 > r.fp32 ||
        e.rounding.reduction > r.reduction)
      RC_FAIL(e.key() + ": optimized counts " + e.rounding.describe() + ", more than the reference's " + r.describe());
  }
  RC_ASSERT(got_grads.entries.size() == expected.size());
  for (const Comparison& row : compare_record(got_grads, expected, "optimized"))
    if (!row.pass)
      RC_FAIL(row.name + ": max abs " + std::to_string(row.max_abs) + ", share of the bound used " +
              std::to_string(row.share_used) + " " + row.message);
}

// The gradients' entries of a record (the forward's are the forward properties').
Record gradients_of(const Record& r) {
  Record g;
  for (const RecordEntry& e : r.entries)
    if (e.role == Role::Grad) g.entries.push_back(e);
  return g;
}

// Expert parallelism: ep drawn among 2, 4 and 8 (those dividing num_moe_experts), both
// dispatchers. Every
// gradient is within the bound counted at that ep against the reference's: an expert's weight
// gradient sums every rank's replica of its rows, scaled by 1 / ep (DDP's scaling); with the
// allgather dispatcher a token's input gradient adds the ranks' partial sums. With the alltoall
// dispatcher each row's gradient reaches its expert's rank and comes back with its probability's,
// moved without rounding and computed from that row alone, so the input's gradient and every
// gradient but the experts' weights' are moreover bitwise the ep = 1 ones.
RC_GTEST_PROP(OptimizedMoEProperty, BackwardExpertParallelSizesAgree, ()) {
  OptMoECase o = *gen_opt_moe_case(2);
  o.bias = false;
  const MoECase m = make_case(o);
  const bool alltoall = m.config.moe_token_dispatcher_type == "alltoall";
  RC_LOG() << describe(m) << "\n";
  const Tensor dout = output_gradient(m);
  const Record ref_full = reference_with_gradients(m, dout), one = optimized_with_gradients(m, dout, 1);
  const Record ref = gradients_of(ref_full), one_grads = gradients_of(one);
  // routing decided by a near-tie (the forward's property) leaves only the ep = 1 comparison
  const bool same_routing = bitwise_equal(*one.find("mlp.router.1"), *ref_full.find("mlp.router.1"));
  std::vector<int> sizes;  // every even E in [2, 8] has ep = 2
  for (int ep : {2, 4, 8})
    if (*m.config.num_moe_experts % ep == 0) sizes.push_back(ep);
  const int ep = *rc::gen::elementOf(sizes);
  RC_TAG(ep, m.config.moe_token_dispatcher_type);
  RC_LOG() << "ep " << ep << "\n";
  const Record got = gradients_of(optimized_with_gradients(m, dout, ep));
  RC_ASSERT(got.entries.size() == one_grads.entries.size());
  for (std::size_t i = 0; i < got.entries.size(); ++i) {
    const RecordEntry& e = got.entries[i];
    RC_LOG() << e.key() << "\n";
    RC_ASSERT(e.key() == one_grads.entries[i].key());
    if (alltoall && e.key().find(".local_experts.") == std::string::npos)
      RC_ASSERT(bitwise_equal(e.value, one_grads.entries[i].value));
  }
  if (!same_routing) return;
  Expected expected;
  for (const RecordEntry& e : ref.entries) expected.emplace_back(e.key(), e.value);
  for (const Comparison& row : compare_record(got, expected, "optimized"))
    if (!row.pass)
      RC_FAIL(row.name + ": max abs " + std::to_string(row.max_abs) + ", share of the bound used " +
              std::to_string(row.share_used) + " " + row.message);
}

namespace {

// A drawn case the backward covers (no biases) on one rank, at ep = 2 (even E), at tp = 2 with
// sequence parallelism (shaped by shape_for_tensor_parallel) or at both (one group of 2): the
// case, its config and the layer's options at that layout, logged.
struct ParallelBackwardCase {
  MoECase m;
  TransformerConfig config;
  opt::LayerOptions options;
};
ParallelBackwardCase gen_parallel_backward_case() {
  OptMoECase o = *gen_opt_moe_case(2);
  o.bias = false;
  const std::string layout = *rc::gen::element<std::string>("one rank", "ep 2", "tp 2", "tp 2 + ep 2");
  const bool tp = layout.rfind("tp 2", 0) == 0, ep = layout.find("ep 2") != std::string::npos;
  if (tp) shape_for_tensor_parallel(o, 2);
  ParallelBackwardCase k{make_case(o, tp ? 4 : 2), {}, {}};
  RC_LOG() << describe(k.m) << " " << layout << "\n";
  RC_TAG(layout);
  k.config = k.m.config;
  k.config.expert_model_parallel_size = ep ? 2 : 1;
  k.options.tp = tp ? 2 : 1;
  k.options.sp = tp;
  return k;
}

// The forward options a backward needs: training, the activations kept.
opt::ForwardOptions forward_for_backward() {
  opt::ForwardOptions fo;
  fo.training = true;
  fo.keep_for_backward = true;
  return fo;
}

// Two backward results bitwise equal: the input's gradient and every parameter's, by name (and
// each magnitude with `magnitudes`).
void assert_gradients_bitwise_equal(const opt::LayerGradients& a, const opt::LayerGradients& b,
                                    bool magnitudes = false) {
  RC_ASSERT(bitwise_equal(a.hidden_states, b.hidden_states));
  RC_ASSERT(a.params.size() == b.params.size());
  for (std::size_t i = 0; i < a.params.size(); ++i) {
    RC_LOG() << a.params[i].name << "\n";
    RC_ASSERT(a.params[i].name == b.params[i].name);
    RC_ASSERT(bitwise_equal(a.params[i].value, b.params[i].value));
    if (magnitudes) RC_ASSERT(a.params[i].magnitude == b.params[i].magnitude);
  }
}

}  // namespace

// A CUDA-graph replay of the backward's postprocess and router phases (the expert phase eager
// between them) is bitwise equal to the eager backward, on the first replay and on a second
// backward after a forward with other hidden states of the same shape (the graphs replayed on the
// new activations), on one rank, at ep = 2 and at tp = 2 (sequence parallel).
RC_GTEST_PROP(OptimizedMoEProperty, BackwardGraphReplayIsBitwiseEqualToEager, ()) {
  const ParallelBackwardCase k = gen_parallel_backward_case();
  const MoECase& m = k.m;
  opt::MoETransformerLayer graph(k.config, m.params, k.options), eager(k.config, m.params, k.options);
  const opt::ForwardOptions fo = forward_for_backward();
  const Tensor dout = output_gradient(m);
  for (const MoECase& x : {m, with_second_input(m)}) {
    graph.forward(x.hidden_states, optimized_inputs(x), fo);
    eager.forward(x.hidden_states, optimized_inputs(x), fo);
    assert_gradients_bitwise_equal(graph.backward(dout, false, /*use_graph=*/true), eager.backward(dout));
  }
}

// The backward's three phases called one by one (_backward_mlp_postprocess,
// _backward_mlp_expert_compute, _backward_mlp_router) compose to backward(): every gradient, its
// magnitude and the rounding count at the end bitwise the same, on one rank, at ep = 2 (the drawn
// dispatcher's duals between the ranks) and at tp = 2 (sequence parallel), each after its own
// forward of the same inputs.
RC_GTEST_PROP(OptimizedMoEProperty, BackwardPhasesOneByOneAreBackward, ()) {
  const ParallelBackwardCase k = gen_parallel_backward_case();
  const MoECase& m = k.m;
  const opt::ForwardOptions fo = forward_for_backward();
  const Tensor dout = output_gradient(m);
  opt::MoETransformerLayer whole(k.config, m.params, k.options), phased(k.config, m.params, k.options);
  opt::LayerGradients a, b;
  RoundingCount a_end, b_end;
  {
    CountRoundings counting;
    whole.forward(m.hidden_states, optimized_inputs(m), fo);
    a = whole.backward(dout, /*with_magnitudes=*/true);
    a_end = rounding_now();
  }
  {
    CountRoundings counting;
    phased.forward(m.hidden_states, optimized_inputs(m), fo);
    phased._backward_mlp_postprocess(dout);
    phased._backward_mlp_expert_compute();
    b = phased._backward_mlp_router(/*with_magnitudes=*/true);
    b_end = rounding_now();
  }
  assert_gradients_bitwise_equal(a, b, /*magnitudes=*/true);
  RC_ASSERT(a_end == b_end);
}

// Two backward runs of the optimized MoE layer (each after its forward) are bitwise equal.
RC_GTEST_PROP(OptimizedMoEProperty, TwoBackwardRunsAreBitwiseEqual, ()) {
  const MoECase m = make_backward_case();
  RC_LOG() << describe(m) << "\n";
  const Tensor dout = output_gradient(m);
  const Record a = optimized_with_gradients(m, dout), b = optimized_with_gradients(m, dout);
  RC_ASSERT(a.entries.size() == b.entries.size());
  for (std::size_t i = 0; i < a.entries.size(); ++i) {
    RC_LOG() << a.entries[i].key() << "\n";
    RC_ASSERT(a.entries[i].key() == b.entries[i].key());
    RC_ASSERT(bitwise_equal(a.entries[i].value, b.entries[i].value));
  }
}

namespace {

// A drawn case the layer runs forward and backward at tensor-parallel size tp (2 or 4, drawn) with
// sequence parallelism (shape_for_tensor_parallel, and make_case's 4 heads and query groups), no
// biases (the backward's).
struct TpCase {
  MoECase m;
  int tp = 1, ep = 1;  // ep = 1, or ep = tp (num_moe_experts a multiple of tp)
};
TpCase gen_tp_case() {
  const int tp = *rc::gen::element(2, 4);
  const int ep = *rc::gen::element(1, tp);
  OptMoECase o = *gen_opt_moe_case(ep);
  shape_for_tensor_parallel(o, tp);
  o.bias = false;
  TpCase k{make_case(o, 4), tp, ep};
  RC_LOG() << describe(k.m) << " tp " << tp << " ep " << ep << "\n";
  RC_TAG(tp, ep, dtype_name(k.m.dense.dtype));
  return k;
}

}  // namespace

// Tensor parallelism with sequence parallelism, tp 2 or 4: each rank routes its slice of the tokens
// (the router's load-balancing counts all-reduced, the z-loss's coefficient / tp) through every
// expert whole, or at ep = tp through the drawn dispatcher to the experts' owners; the shared
// experts a tensor-parallel MLP. The record holds the same entries in the same order as at tp 1
// (at ep = tp but the experts' inner linears', recorded on one rank only), put together as the
// whole layer's; every forward entry and every gradient is within the bound the golden engine
// derives from the counted rounding points (the ranks' partial sums included) against the
// reference's; a second run is bitwise the first. Routing decided by a near-tie is discarded as in
// the forward's property.
RC_GTEST_PROP(OptimizedMoEProperty, TensorParallelSizesAgree, ()) {
  const TpCase k = gen_tp_case();
  const MoECase& m = k.m;
  const Tensor dout = output_gradient(m);
  const Record ref = reference_with_gradients(m, dout);
  Record one;
  for (const RecordEntry& e : optimized_with_gradients(m, dout).entries)
    if (k.ep == 1 || !inside_an_expert(e.key())) one.entries.push_back(e);
  const Record got = optimized_with_gradients(m, dout, k.ep, k.tp),
               again = optimized_with_gradients(m, dout, k.ep, k.tp);
  RC_ASSERT(got.entries.size() == one.entries.size());
  RC_ASSERT(again.entries.size() == got.entries.size());
  for (std::size_t i = 0; i < got.entries.size(); ++i) {
    RC_LOG() << got.entries[i].key() << "\n";
    RC_ASSERT(got.entries[i].key() == one.entries[i].key());
    RC_ASSERT(again.entries[i].key() == got.entries[i].key());
    RC_ASSERT(bitwise_equal(again.entries[i].value, got.entries[i].value));
  }
  discard_if_routed_on_a_near_tie(ref, got, *m.config.num_moe_experts);
  Expected expected;
  for (auto& [key, t] : expected_of(ref))
    if (!inside_an_expert(key)) expected.emplace_back(key, t);
  for (const Comparison& row : compare_record(got, expected, "optimized"))
    if (!row.pass)
      RC_FAIL(row.name + ": max abs " + std::to_string(row.max_abs) + ", share of the bound used " +
              std::to_string(row.share_used) + " " + row.message);
}

// What tensor parallelism does not run is named before anything runs.
TEST(OptimizedMoETensorParallel, UnsupportedConfigsAreNamed) {
  TransformerConfig c;
  c.hidden_size = 16;
  c.num_attention_heads = 4;
  c.num_moe_experts = 4;
  opt::LayerOptions tp2;
  tp2.tp = 2;
  EXPECT_NE(opt::moe_layer_unsupported(c, tp2).find("without sequence_parallel"), std::string::npos);
  tp2.sp = true;
  EXPECT_EQ(opt::moe_layer_unsupported(c, tp2), "");
  c.expert_model_parallel_size = 2;  // ep = tp: one group
  EXPECT_EQ(opt::moe_layer_unsupported(c, tp2), "");
  c.expert_model_parallel_size = 4;
  EXPECT_NE(opt::moe_layer_unsupported(c, tp2).find("other than ep = tp"), std::string::npos);
  c.expert_model_parallel_size = 1;
  c.moe_expert_capacity_factor = 1.0;
  EXPECT_NE(opt::moe_layer_unsupported(c, tp2).find("capacity"), std::string::npos);
  c.moe_expert_capacity_factor.reset();
  c.moe_shared_expert_intermediate_size = 6;
  tp2.tp = 4;
  EXPECT_NE(opt::moe_layer_unsupported(c, tp2).find("moe_shared_expert_intermediate_size"), std::string::npos);
  c.moe_shared_expert_intermediate_size = 8;
  EXPECT_EQ(opt::moe_layer_unsupported(c, tp2), "");
  c.num_query_groups = 2;  // 4 heads in 2 groups: tp 4 splits no group
  EXPECT_NE(opt::moe_layer_unsupported(c, tp2).find("num_query_groups"), std::string::npos);
}

// The configurations expert parallelism does not run are named, before anything runs.
TEST(OptimizedMoEExpertParallel, UnsupportedConfigsAreNamed) {
  TransformerConfig c;
  c.num_moe_experts = 6;
  c.moe_token_dispatcher_type = "alltoall";
  c.expert_model_parallel_size = 4;
  EXPECT_NE(opt::moe_layer_unsupported(c).find("not divisible"), std::string::npos);
  c.expert_model_parallel_size = 2;
  EXPECT_EQ(opt::moe_layer_unsupported(c), "");
  opt::LayerOptions gpu;
  gpu.backend = rt::Backend::Cuda;
  EXPECT_NE(opt::moe_layer_unsupported(c, gpu).find("GPU"), std::string::npos);
  c.moe_token_dispatcher_type = "allgather";
  EXPECT_EQ(opt::moe_layer_unsupported(c), "");
  c.expert_model_parallel_size = 0;
  EXPECT_NE(opt::moe_layer_unsupported(c).find(">= 1"), std::string::npos);
}

// On one rank, at ep = 2, at tp = 2 (sequence parallel) and at both, each rank captures its router
// and postprocess phases into its own graphs (the tensor-parallel collectives inside them, the
// dispatcher's communication eager between them): a replay is bitwise equal to eager execution, on
// the first replay and on a second one with new inputs of the same shape.
RC_GTEST_PROP(OptimizedMoEProperty, ParallelGraphReplayIsBitwiseEqualToEager, ()) {
  const ParallelBackwardCase k = gen_parallel_backward_case();
  const MoECase& m = k.m;
  opt::MoEForwardInputs in;
  in.attention_mask = m.attention_mask.defined() ? &m.attention_mask : nullptr;
  in.rotary_pos_emb = m.rotary_pos_emb.defined() ? &m.rotary_pos_emb : nullptr;
  opt::ForwardOptions eager, graph;
  eager.training = graph.training = true;
  graph.use_graph = true;
  opt::MoETransformerLayer a(k.config, m.params, k.options), b(k.config, m.params, k.options);
  RC_ASSERT(bitwise_equal(a.forward(m.hidden_states, in, graph).hidden_states,
                          b.forward(m.hidden_states, in, eager).hidden_states));
  RC_ASSERT(a.tokens_per_expert() == b.tokens_per_expert());
  std::vector<double> v = m.hidden_states.to_f64();
  for (std::size_t i = 0; i < v.size(); i += 3) v[i] = -v[i];  // negation is exact in any dtype
  const Tensor x2 = Tensor::from_doubles(m.hidden_states.dtype(), m.hidden_states.shape(), v);
  RC_ASSERT(bitwise_equal(a.forward(x2, in, graph).hidden_states, b.forward(x2, in, eager).hidden_states));
  RC_ASSERT(a.tokens_per_expert() == b.tokens_per_expert());
}

namespace {

// Whether two records are bitwise one record: the same entries in the same order, each with the
// same value bits, rounding count and magnitude, and the same tap call counts.
void assert_records_equal(const Record& a, const Record& b) {
  RC_ASSERT(a.entries.size() == b.entries.size());
  for (std::size_t i = 0; i < a.entries.size(); ++i) {
    RC_LOG() << a.entries[i].key() << "\n";
    RC_ASSERT(a.entries[i].key() == b.entries[i].key());
    RC_ASSERT(bitwise_equal(a.entries[i].value, b.entries[i].value));
    RC_ASSERT(a.entries[i].rounding == b.entries[i].rounding);
    RC_ASSERT(a.entries[i].magnitude == b.entries[i].magnitude);
  }
  RC_ASSERT(a.calls == b.calls);
}

// Megatron's partial-CUDA-graph phases called one by one (_forward_mlp_router,
// _forward_mlp_expert_compute, _forward_mlp_postprocess) are forward(): the output, every record
// entry (taps, tap_in, aux losses, the expert-bias counter, with their rounding counts), the
// rounding count after it and the tokens per expert bitwise equal, on a fresh layer and again on a
// second input, where the state one forward leaves (the global aux loss's steps, the expert-bias
// counter) must carry the same way. ep: expert_model_parallel_size (the phases then run every rank).
void check_phases_one_by_one_are_forward(const MoECase& m, int ep) {
  TransformerConfig c = m.config;
  c.expert_model_parallel_size = ep;
  opt::MoEForwardInputs in;
  in.attention_mask = m.attention_mask.defined() ? &m.attention_mask : nullptr;
  in.rotary_pos_emb = m.rotary_pos_emb.defined() ? &m.rotary_pos_emb : nullptr;
  opt::ForwardOptions fo;
  fo.training = true;
  fo.record_taps = true;
  opt::MoETransformerLayer whole(c, m.params, opt::LayerOptions{}), phased(c, m.params, opt::LayerOptions{});
  std::vector<double> v = m.hidden_states.to_f64();
  for (std::size_t i = 0; i < v.size(); i += 3) v[i] = -v[i];  // negation is exact in any dtype
  const Tensor x2 = Tensor::from_doubles(m.hidden_states.dtype(), m.hidden_states.shape(), v);
  for (const Tensor* x : {&m.hidden_states, &x2}) {
    opt::LayerOutput a, b;
    RoundingCount a_end, b_end;
    {
      CountRoundings counting;
      a = whole.forward(*x, in, fo);
      a_end = rounding_now();
    }
    {
      CountRoundings counting;
      phased._forward_mlp_router(*x, in, fo);
      phased._forward_mlp_expert_compute();
      b = phased._forward_mlp_postprocess();
      b_end = rounding_now();
    }
    RC_ASSERT(bitwise_equal(a.hidden_states, b.hidden_states));
    RC_ASSERT(whole.tokens_per_expert() == phased.tokens_per_expert());
    assert_records_equal(a.record, b.record);
    RC_ASSERT(a_end == b_end);
  }
}

}  // namespace

RC_GTEST_PROP(OptimizedMoEProperty, PhasesOneByOneAreForward, ()) {
  const MoECase m = make_case(*gen_opt_moe_case());
  RC_LOG() << describe(m) << "\n";
  check_phases_one_by_one_are_forward(m, 1);
}

// The same at expert-parallel size 2 (even E drawn), the drawn dispatcher between the ranks.
RC_GTEST_PROP(OptimizedMoEProperty, ExpertParallelPhasesOneByOneAreForward, ()) {
  const MoECase m = make_case(*gen_opt_moe_case(2));
  RC_LOG() << describe(m) << "\n";
  check_phases_one_by_one_are_forward(m, 2);
}

// A phase called before its predecessor throws, naming the phase that must run first, and leaves
// the forward in flight intact: completing it in order still gives forward()'s output.
TEST(OptimizedMoEPhases, OutOfOrderCallsNameTheMissingPhase) {
  OptMoECase o;
  o.s = 3;
  o.b = 2;
  o.E = 4;
  o.k = 2;
  o.lb = "aux_loss";
  o.shared = true;
  const MoECase m = make_case(o);
  opt::MoEForwardInputs in;
  in.attention_mask = m.attention_mask.defined() ? &m.attention_mask : nullptr;
  in.rotary_pos_emb = m.rotary_pos_emb.defined() ? &m.rotary_pos_emb : nullptr;
  opt::ForwardOptions fo;
  fo.training = true;
  opt::MoETransformerLayer layer(m.config, m.params, opt::LayerOptions{});
  auto message = [](const std::function<void()>& call) {
    try {
      call();
    } catch (const std::logic_error& e) {
      return std::string(e.what());
    }
    return std::string("(no exception)");
  };
  auto expert_compute = [&] { layer._forward_mlp_expert_compute(); };
  auto postprocess = [&] { layer._forward_mlp_postprocess(); };
  const std::string need_router = "needs _forward_mlp_router";
  const std::string need_experts = "needs _forward_mlp_expert_compute first";
  EXPECT_NE(message(expert_compute).find(need_router), std::string::npos) << message(expert_compute);
  EXPECT_NE(message(postprocess).find("needs _forward_mlp_router and _forward_mlp_expert_compute first"),
            std::string::npos)
      << message(postprocess);
  layer._forward_mlp_router(m.hidden_states, in, fo);
  EXPECT_NE(message(postprocess).find(need_experts), std::string::npos) << message(postprocess);
  layer._forward_mlp_expert_compute();
  // the router's outputs are consumed: a second expert compute needs a new router phase
  EXPECT_NE(message(expert_compute).find(need_router), std::string::npos) << message(expert_compute);
  const Tensor phased = layer._forward_mlp_postprocess().hidden_states;
  EXPECT_NE(message(postprocess).find("needs _forward_mlp_router"), std::string::npos) << message(postprocess);
  opt::MoETransformerLayer fresh(m.config, m.params, opt::LayerOptions{});
  EXPECT_TRUE(bitwise_equal(phased, fresh.forward(m.hidden_states, in, fo).hidden_states));
  // after a completed forward, forward() still runs (the phases are back at the start)
  EXPECT_TRUE(bitwise_equal(phased, layer.forward(m.hidden_states, in, fo).hidden_states));
  // a router phase that rejects its input drops the forward in flight before it
  layer._forward_mlp_router(m.hidden_states, in, fo);
  const Tensor bad = Tensor::empty(m.hidden_states.dtype(), {m.hidden_states.size(0), m.hidden_states.size(1), 3});
  EXPECT_THROW(layer._forward_mlp_router(bad, in, fo), ShapeError);
  EXPECT_NE(message(expert_compute).find(need_router), std::string::npos) << message(expert_compute);
}

// At ep = 2 an out-of-order call is refused before any rank runs (no rank waits in a collective
// for another), and the forward in flight completes afterwards.
// The backward's phases out of order, or without a forward kept for backward, name what is
// missing; after a throw the right call still runs.
TEST(OptimizedMoEPhases, BackwardOutOfOrderCallsNameTheMissingPhase) {
  OptMoECase o;
  o.E = 4;
  o.k = 2;
  const MoECase m = make_case(o);
  opt::MoETransformerLayer layer(m.config, m.params, opt::LayerOptions{});
  const Tensor dout = output_gradient(m);
  auto throws_naming = [](auto&& call, const std::string& what) {
    try {
      call();
    } catch (const std::logic_error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
      return;
    }
    ADD_FAILURE() << "no std::logic_error naming " << what;
  };
  opt::ForwardOptions fo;
  fo.training = true;
  layer.forward(m.hidden_states, optimized_inputs(m), fo);
  throws_naming([&] { layer._backward_mlp_postprocess(dout); }, "keep_for_backward");
  fo.keep_for_backward = true;
  layer.forward(m.hidden_states, optimized_inputs(m), fo);
  throws_naming([&] { layer._backward_mlp_expert_compute(); }, "needs _backward_mlp_postprocess first");
  throws_naming([&] { layer._backward_mlp_router(); }, "needs _backward_mlp_expert_compute first");
  layer._backward_mlp_postprocess(dout);
  throws_naming([&] { layer._backward_mlp_router(); }, "needs _backward_mlp_expert_compute first");
  layer._backward_mlp_expert_compute();
  const opt::LayerGradients g = layer._backward_mlp_router();
  EXPECT_TRUE(bitwise_equal(g.hidden_states, layer.backward(dout).hidden_states));
  throws_naming([&] { layer._backward_mlp_router(); }, "needs _backward_mlp_expert_compute first");
}

TEST(OptimizedMoEPhases, OutOfOrderCallsAtExpertParallelSize2) {
  OptMoECase o;
  o.s = 3;
  o.E = 4;
  o.k = 2;
  o.dispatcher = "alltoall";
  MoECase m = make_case(o);
  m.config.expert_model_parallel_size = 2;
  opt::MoETransformerLayer layer(m.config, m.params, opt::LayerOptions{});
  opt::MoEForwardInputs in;
  in.attention_mask = m.attention_mask.defined() ? &m.attention_mask : nullptr;
  in.rotary_pos_emb = m.rotary_pos_emb.defined() ? &m.rotary_pos_emb : nullptr;
  EXPECT_THROW(layer._forward_mlp_expert_compute(), std::logic_error);
  layer._forward_mlp_router(m.hidden_states, in);
  try {
    layer._forward_mlp_postprocess();
    ADD_FAILURE() << "_forward_mlp_postprocess ran before _forward_mlp_expert_compute";
  } catch (const std::logic_error& e) {
    EXPECT_NE(std::string(e.what()).find("needs _forward_mlp_expert_compute first"), std::string::npos) << e.what();
  }
  layer._forward_mlp_expert_compute();
  const Tensor phased = layer._forward_mlp_postprocess().hidden_states;
  opt::MoETransformerLayer fresh(m.config, m.params, opt::LayerOptions{});
  EXPECT_TRUE(bitwise_equal(phased, fresh.forward(m.hidden_states, in).hidden_states));
}
