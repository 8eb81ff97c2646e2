// Property tests of the MoE reference: random router configs and random
// normal inputs (ties have probability zero), checked against invariants rather than a second
// implementation.
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <algorithm>
#include <functional>
#include <numeric>
#include <random>

#include "reference/moe/moe_layer.h"
#include "tests/reference/moe/moe_case.h"
#include "tests/reference/moe/moe_test_util.h"

namespace twin::reference::moe {
namespace {

using testing::random_mat;
using testing::random_moe_state_dict;
using testing::small_moe_config;

using testing::MoECase;

struct Options {
  bool capacity = false;       // may set moe_expert_capacity_factor
  bool capacity_fits = false;  // capacity <= tokens whenever padding to capacity (alltoall needs it)
  bool shared = true;          // may add shared experts
  bool dtypes = true;          // draws fp32 | bf16 | fp16 (false: fp32, for Exact-mode properties)
  int max_s = 6, max_b = 3;
};

// A random MoE case whose config validates; `tweak` then sets what one property needs (inside the
// generator, so the printed id is the case the property ran).
rc::Gen<MoECase> gen_moe_case(Options o, std::function<void(MoECase&)> tweak = {}) {
  return proptest::rerunnable<MoECase>(rc::gen::exec([o, tweak] {
    MoECase m;
    m.s = *rc::gen::inRange(1, o.max_s + 1);
    m.b = *rc::gen::inRange(1, o.max_b + 1);
    m.E = *rc::gen::inRange(2, 9);
    m.k = *rc::gen::inRange(1, m.E + 1);
    m.score = *rc::gen::element<std::string>("softmax", "sigmoid");
    m.pre_softmax = (m.k == 1 && m.score == "softmax") ? true : *rc::gen::arbitrary<bool>();
    if (*rc::gen::arbitrary<bool>()) {  // group-limited routing
      std::vector<int> divisors;
      for (int g = 2; g <= m.E; ++g)
        if (m.E % g == 0) divisors.push_back(g);
      if (!divisors.empty()) {
        const int G = *rc::gen::elementOf(divisors);
        const int group_topk = *rc::gen::inRange(1, G + 1);
        if (m.k <= group_topk * (m.E / G)) {
          m.groups = G;
          m.group_topk = group_topk;
        }
      }
    }
    if (*rc::gen::arbitrary<bool>()) m.topk_scale = 2.5;
    m.glu = *rc::gen::arbitrary<bool>();
    m.act = *rc::gen::element<std::string>("gelu", "silu");
    m.dispatcher = *rc::gen::element<std::string>("allgather", "alltoall");
    m.lb = *rc::gen::element<std::string>("aux_loss", "seq_aux_loss", "global_aux_loss", "none");
    if (*rc::gen::arbitrary<bool>()) m.z_loss = 1e-3;
    if (m.score == "sigmoid" && *rc::gen::arbitrary<bool>()) m.expert_bias = true;
    if (o.shared && *rc::gen::arbitrary<bool>()) {
      m.shared = 5;
      m.shared_gate = *rc::gen::arbitrary<bool>();
    } else {
      m.bias = *rc::gen::arbitrary<bool>();
    }
    if (o.capacity && *rc::gen::arbitrary<bool>()) {
      m.cap = *rc::gen::inRange(1, 21) / 10.0;
      m.drop = *rc::gen::element<std::string>("probs", "position");
      m.pad_cap = *rc::gen::arbitrary<bool>();
      if (o.capacity_fits && m.pad_cap && get_capacity(Index{m.tokens()} * m.k, m.E, m.cap) > m.tokens())
        m.pad_cap = false;
    }
    if (o.dtypes) m.dtype = *proptest::gen_case_dtype();
    if (tweak) tweak(m);
    m.seed = *rc::gen::arbitrary<std::uint64_t>();
    return m;
  }));
}

// The case's hidden states [s * b, h], in its dtype (after its parameters in the seed's stream).
Mat hidden_states(const MoECase& m, const TransformerConfig& c, std::mt19937_64& rng) {
  return reference::testing::round_mat(random_mat(rng, m.tokens(), c.hidden_size), m.dtype);
}

struct Run {
  Mat output;
  AuxLosses aux;
  TapRecord taps;
};

Run run_layer(const TransformerConfig& c, const StateDict& sd, const Precision& p, const Mat& x, Index s, Index b,
              const Tensor* padding_mask = nullptr) {
  MoELayer layer(c, p);
  layer.load_state_dict(sd, "mlp.");
  MlpArgs args;
  args.lead = {s, b};
  args.training = true;
  args.padding_mask = padding_mask;
  Run r;
  r.output = layer.forward(x, args, Taps(&r.taps, "mlp.")).output;
  r.aux = layer.aux_losses;
  return r;
}

bool bitwise_equal(const Mat& a, const Mat& b) {
  return a.rows() == b.rows() && a.cols() == b.cols() && std::equal(a.data(), a.data() + a.size(), b.data());
}

const Precision kExact{ComputeMode::Exact, DType::F32};

// Without capacity dropping, permuting the tokens permutes the outputs and leaves every loss
// unchanged. Exact mode: the only differences are double summation orders (Eigen's GEMM kernels
// and the loss sums visit rows in another order), far below 1e-12 relative.
RC_GTEST_PROP(MoEProperties, TokenPermutationPermutesOutputsAndKeepsLosses, ()) {
  Options o;
  o.dtypes = false;  // Exact mode rounds nowhere
  o.max_s = 12;
  o.max_b = 1;  // one sequence (b = 1): the per-sequence loss sees every token too
  const MoECase mc = *gen_moe_case(o);
  const Index T = mc.tokens();
  const TransformerConfig c = to_config(mc);
  std::mt19937_64 rng(mc.seed);
  const StateDict sd = moe_state_dict(mc, c, rng);
  const Mat x = hidden_states(mc, c, rng);
  std::vector<Index> perm(T);
  std::iota(perm.begin(), perm.end(), Index{0});
  std::shuffle(perm.begin(), perm.end(), rng);
  Mat px(T, c.hidden_size);
  for (Index i = 0; i < T; ++i) px.row(i) = x.row(perm[i]);

  const Run a = run_layer(c, sd, kExact, x, T, 1);
  const Run pa = run_layer(c, sd, kExact, px, T, 1);
  for (Index i = 0; i < T; ++i)
    for (Index j = 0; j < x.cols(); ++j)
      RC_ASSERT(std::fabs(pa.output(i, j) - a.output(perm[i], j)) <= 1e-12 * (1.0 + std::fabs(a.output(perm[i], j))));
  RC_ASSERT(a.aux.size() == pa.aux.size());
  for (const auto& [name, v] : a.aux) RC_ASSERT(std::fabs(pa.aux.at(name) - v) <= 1e-12 * (1.0 + std::fabs(v)));
}

// permute followed by unpermute with probabilities 1/k gives back the input (k copies of x / k,
// summed: within k roundings of x).
// The permutation case: T tokens of width H, E experts, top k (fp64 throughout: DType::F64 below).
struct PermuteCase : proptest::PropertyCase {
  static constexpr const char* kKind = "moe_permute";
  int T = 1, E = 1, H = 1, k = 1;
  std::uint64_t seed = 0;
  template <class V>
  void fields(V& v) {
    v("T", T);
    v("E", E);
    v("H", H);
    v("k", k);
    v("seed", seed);
  }
};

RC_GTEST_PROP(MoEProperties, PermuteThenUnpermuteWithProbsOneOverKIsIdentity, ()) {
  const PermuteCase pc = *proptest::rerunnable<PermuteCase>(rc::gen::exec([] {
    PermuteCase c;
    c.T = *rc::gen::inRange(1, 17);
    c.E = *rc::gen::inRange(1, 9);
    c.H = *rc::gen::inRange(1, 6);
    c.k = *rc::gen::inRange(1, c.E + 1);
    c.seed = *rc::gen::arbitrary<std::uint64_t>();
    return c;
  }));
  const Index T = pc.T, E = pc.E, H = pc.H, k = pc.k;
  std::mt19937_64 rng(pc.seed);
  const Mat tokens = random_mat(rng, T, H);
  const TopK top = topk_rows(random_mat(rng, T, E), static_cast<int>(k));
  BoolMat routing_map = BoolMat::Constant(T, E, false);
  Mat probs = Mat::Zero(T, E);
  for (Index t = 0; t < T; ++t)
    for (Index j = 0; j < k; ++j) {
      routing_map(t, top.indices(t, j)) = true;
      probs(t, top.indices(t, j)) = 1.0 / static_cast<double>(k);
    }
  const Permuted p = permute(tokens, routing_map, nullptr, std::nullopt, false);
  RC_ASSERT(p.tokens.rows() == T * k);
  const Mat back = unpermute(p.tokens, p.sorted_indices, T, DType::F64, Rounding{}, &probs, &routing_map);
  for (Index i = 0; i < tokens.size(); ++i)
    RC_ASSERT(std::fabs(back.data()[i] - tokens.data()[i]) <= 4.0 * k * 0x1.0p-53 * std::fabs(tokens.data()[i]));
}

// Every routing-map row holds exactly k experts when nothing is dropped (no capacity factor, or
// one so large that no expert can overflow).
RC_GTEST_PROP(MoEProperties, EveryRowHasExactlyKExpertsWithoutDropping, ()) {
  const MoECase mc = *gen_moe_case(Options{}, [](MoECase& m) {
    if (*rc::gen::arbitrary<bool>()) {
      m.cap = static_cast<double>(m.E) / m.k;  // capacity >= T
      m.drop = *rc::gen::element<std::string>("probs", "position");
    }
  });
  const Index s = mc.s, b = mc.b;
  const TransformerConfig c = to_config(mc);
  std::mt19937_64 rng(mc.seed);
  const StateDict sd = moe_state_dict(mc, c, rng);
  const Run r = run_layer(c, sd, precision_of(mc), hidden_states(mc, c, rng), s, b);
  const Tensor& map = *r.taps.find("mlp.router.1");
  const BoolMat m = to_bool_mat(map, s * b, *c.num_moe_experts);
  for (Index t = 0; t < m.rows(); ++t) RC_ASSERT(m.row(t).count() == c.moe_router_topk);
}

// No expert ever holds more tokens than its capacity; padding to capacity fills every expert to
// exactly the capacity.
RC_GTEST_PROP(MoEProperties, NoExpertExceedsCapacity, ()) {
  const MoECase mc = *gen_moe_case(Options{}, [](MoECase& m) {
    m.cap = *rc::gen::inRange(1, 21) / 10.0;
    m.drop = *rc::gen::element<std::string>("probs", "position");
    m.pad_cap = *rc::gen::arbitrary<bool>();
    if (m.pad_cap && get_capacity(Index{m.tokens()} * m.k, m.E, m.cap) > m.tokens()) m.dispatcher = "allgather";
  });
  const Index s = mc.s, b = mc.b, T = mc.tokens();
  const TransformerConfig c = to_config(mc);
  const Index capacity = get_capacity(T * c.moe_router_topk, *c.num_moe_experts, *c.moe_expert_capacity_factor);
  std::mt19937_64 rng(mc.seed);
  const StateDict sd = moe_state_dict(mc, c, rng);
  const Run r = run_layer(c, sd, precision_of(mc), hidden_states(mc, c, rng), s, b);
  const BoolMat m = to_bool_mat(*r.taps.find("mlp.router.1"), T, *c.num_moe_experts);
  const Tensor& tokens_per_expert = *r.taps.find("mlp.experts.tokens_per_expert", Role::TapIn);
  for (Index e = 0; e < m.cols(); ++e) {
    if (capacity <= T) RC_ASSERT(m.col(e).count() <= capacity);
    if (c.moe_pad_expert_input_to_capacity) RC_ASSERT(m.col(e).count() == std::min(capacity, T));
    RC_ASSERT(static_cast<Index>(tokens_per_expert.at_f64(e)) == m.col(e).count());
  }
}

// Padding tokens (padding_mask [b, s], True = padding) change no loss: replacing their hidden
// states leaves every loss bitwise unchanged (they are still routed and computed).
RC_GTEST_PROP(MoEProperties, PaddingTokensChangeNoLoss, ()) {
  const MoECase mc = *gen_moe_case(Options{}, [](MoECase& m) {
    m.lb = *rc::gen::element<std::string>("aux_loss", "seq_aux_loss", "global_aux_loss");
    m.z_loss = 1e-3;
    m.pad.assign(static_cast<std::size_t>(m.tokens()), '0');
    for (char& bit : m.pad) bit = *rc::gen::arbitrary<bool>() ? '1' : '0';
    m.pad[static_cast<std::size_t>(*rc::gen::inRange(0, m.tokens()))] = '0';  // at least one real token
  });
  const Index s = mc.s, b = mc.b, T = mc.tokens();
  const TransformerConfig c = to_config(mc);
  const Tensor padding_mask = padding_mask_of(mc);  // [b, s]
  std::mt19937_64 rng(mc.seed);
  const StateDict sd = moe_state_dict(mc, c, rng);
  const Mat x = hidden_states(mc, c, rng);
  Mat y = x;
  const Mat noise = reference::testing::round_mat(random_mat(rng, T, c.hidden_size, 3.0), mc.dtype);
  for (Index bi = 0; bi < b; ++bi)
    for (Index si = 0; si < s; ++si)
      if (mc.pad[bi * s + si] == '1') y.row(si * b + bi) = noise.row(si * b + bi);  // token t = s_idx * b + b_idx
  const Run rx = run_layer(c, sd, precision_of(mc), x, s, b, &padding_mask);
  const Run ry = run_layer(c, sd, precision_of(mc), y, s, b, &padding_mask);
  RC_ASSERT(!rx.aux.empty());
  RC_ASSERT(rx.aux == ry.aux);
}

// allgather and alltoall dispatch agree bitwise: outputs, the experts' inputs and every tap.
RC_GTEST_PROP(MoEProperties, AllgatherAndAlltoallAgreeBitwise, ()) {
  const MoECase mc = *gen_moe_case(Options{true, true, true});
  const Index s = mc.s, b = mc.b;
  TransformerConfig c = to_config(mc);
  std::mt19937_64 rng(mc.seed);
  const StateDict sd = moe_state_dict(mc, c, rng);
  const Mat x = hidden_states(mc, c, rng);
  c.moe_token_dispatcher_type = "allgather";
  const Run ag = run_layer(c, sd, precision_of(mc), x, s, b);
  c.moe_token_dispatcher_type = "alltoall";
  const Run a2a = run_layer(c, sd, precision_of(mc), x, s, b);
  RC_ASSERT(bitwise_equal(ag.output, a2a.output));
  RC_ASSERT(ag.aux == a2a.aux);
  RC_ASSERT(ag.taps.entries.size() == a2a.taps.entries.size());
  for (std::size_t i = 0; i < ag.taps.entries.size(); ++i) {
    const Tensor& t = ag.taps.entries[i].value;
    RC_ASSERT(ag.taps.entries[i].key() == a2a.taps.entries[i].key());
    const Tensor& u = a2a.taps.entries[i].value;
    RC_ASSERT(t.shape() == u.shape());
    RC_ASSERT(t.nbytes() == u.nbytes());
    RC_ASSERT(std::equal(t.raw(), t.raw() + t.nbytes(), u.raw()));
  }
}

// MoELayer's three groups (route, expert_compute, postprocess) compose bitwise to forward.
RC_GTEST_PROP(MoEProperties, MoELayerGroupsComposeBitwiseToForward, ()) {
  const MoECase mc = *gen_moe_case(Options{true, true, true});
  const Index s = mc.s, b = mc.b;
  const TransformerConfig c = to_config(mc);
  std::mt19937_64 rng(mc.seed);
  const StateDict sd = moe_state_dict(mc, c, rng);
  const Mat x = hidden_states(mc, c, rng);
  const Run whole = run_layer(c, sd, precision_of(mc), x, s, b);

  MoELayer layer(c, precision_of(mc));
  layer.load_state_dict(sd, "mlp.");
  MlpArgs args;
  args.lead = {s, b};
  args.training = true;
  TapRecord rec;
  const Taps taps(&rec, "mlp.");
  const MoERouteOutput routed = layer.forward_route(x, args, taps);
  const OutputWithBias expert =
      layer.forward_expert_compute(routed.hidden_states_and_probs, routed.token_dispatcher_attrs, taps);
  const Mat out = layer.forward_postprocess(expert.output, routed.shared_expert_output, taps);
  RC_ASSERT(bitwise_equal(out, whole.output));
  RC_ASSERT(layer.aux_losses == whole.aux);
}

}  // namespace
}  // namespace twin::reference::moe
