// Property tests of the MoE reference: random router configs and random
// normal inputs (ties have probability zero), checked against invariants rather than a second
// implementation.
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>

#include "reference/moe/moe_layer.h"
#include "tests/reference/moe/moe_test_util.h"

namespace twin::reference::moe {
namespace {

using testing::random_mat;
using testing::random_moe_state_dict;
using testing::small_moe_config;

struct Options {
  bool capacity = false;       // may set moe_expert_capacity_factor
  bool capacity_fits = false;  // capacity <= tokens whenever padding to capacity (alltoall needs it)
  bool shared = true;          // may add shared experts
};

// A random MoE config that validates.
TransformerConfig gen_config(const Options& o, Index tokens) {
  const int E = *rc::gen::inRange(2, 9);
  const int k = *rc::gen::inRange(1, E + 1);
  TransformerConfig c = small_moe_config(E, k);
  c.moe_router_score_function = *rc::gen::element<std::string>("softmax", "sigmoid");
  c.moe_router_pre_softmax = (k == 1 && c.moe_router_score_function == "softmax") ? true : *rc::gen::arbitrary<bool>();
  if (*rc::gen::arbitrary<bool>()) {  // group-limited routing
    std::vector<int> divisors;
    for (int g = 2; g <= E; ++g)
      if (E % g == 0) divisors.push_back(g);
    if (!divisors.empty()) {
      const int G = *rc::gen::elementOf(divisors);
      const int group_topk = *rc::gen::inRange(1, G + 1);
      if (k <= group_topk * (E / G)) {
        c.moe_router_num_groups = G;
        c.moe_router_group_topk = group_topk;
      }
    }
  }
  if (*rc::gen::arbitrary<bool>()) c.moe_router_topk_scaling_factor = 2.5;
  c.gated_linear_unit = *rc::gen::arbitrary<bool>();
  c.activation_func = *rc::gen::element<std::string>("gelu", "silu");
  c.moe_token_dispatcher_type = *rc::gen::element<std::string>("allgather", "alltoall");
  c.moe_router_load_balancing_type =
      *rc::gen::element<std::string>("aux_loss", "seq_aux_loss", "global_aux_loss", "none");
  if (*rc::gen::arbitrary<bool>()) c.moe_z_loss_coeff = 1e-3;
  if (c.moe_router_score_function == "sigmoid" && *rc::gen::arbitrary<bool>()) c.moe_router_enable_expert_bias = true;
  if (o.shared && *rc::gen::arbitrary<bool>()) {
    c.moe_shared_expert_intermediate_size = 5;
    c.moe_shared_expert_gate = *rc::gen::arbitrary<bool>();
  } else {
    c.add_bias_linear = *rc::gen::arbitrary<bool>();
  }
  if (o.capacity && *rc::gen::arbitrary<bool>()) {
    c.moe_expert_capacity_factor = *rc::gen::inRange(1, 21) / 10.0;
    c.moe_token_drop_policy = *rc::gen::element<std::string>("probs", "position");
    c.moe_pad_expert_input_to_capacity = *rc::gen::arbitrary<bool>();
    if (o.capacity_fits && c.moe_pad_expert_input_to_capacity &&
        get_capacity(tokens * k, E, *c.moe_expert_capacity_factor) > tokens)
      c.moe_pad_expert_input_to_capacity = false;
  }
  return c;
}

StateDict gen_state_dict(const TransformerConfig& c, std::mt19937_64& rng) {
  StateDict sd = random_moe_state_dict(c, rng);
  if (c.moe_router_enable_expert_bias) {
    const Index E = *c.num_moe_experts;
    sd.set("mlp.router.expert_bias", testing::f64_tensor(random_mat(rng, 1, E, 0.2), {E}));
  }
  return sd;
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
const Precision kFp32{ComputeMode::FP32, DType::F32};

// Without capacity dropping, permuting the tokens permutes the outputs and leaves every loss
// unchanged. Exact mode: the only differences are double summation orders (Eigen's GEMM kernels
// and the loss sums visit rows in another order), far below 1e-12 relative.
RC_GTEST_PROP(MoEProperties, TokenPermutationPermutesOutputsAndKeepsLosses, ()) {
  const Index T = *rc::gen::inRange(1, 13);
  const TransformerConfig c = gen_config(Options{}, T);
  std::mt19937_64 rng(*rc::gen::arbitrary<std::uint64_t>());
  const StateDict sd = gen_state_dict(c, rng);
  const Mat x = random_mat(rng, T, c.hidden_size);
  std::vector<Index> perm(T);
  std::iota(perm.begin(), perm.end(), Index{0});
  std::shuffle(perm.begin(), perm.end(), rng);
  Mat px(T, c.hidden_size);
  for (Index i = 0; i < T; ++i) px.row(i) = x.row(perm[i]);

  // One sequence (b = 1): the per-sequence loss sees every token too.
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
RC_GTEST_PROP(MoEProperties, PermuteThenUnpermuteWithProbsOneOverKIsIdentity, ()) {
  const Index T = *rc::gen::inRange(1, 17), E = *rc::gen::inRange(1, 9), H = *rc::gen::inRange(1, 6);
  const Index k = *rc::gen::inRange<Index>(1, E + 1);
  std::mt19937_64 rng(*rc::gen::arbitrary<std::uint64_t>());
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
  const Index s = *rc::gen::inRange(1, 7), b = *rc::gen::inRange(1, 4);
  TransformerConfig c = gen_config(Options{}, s * b);
  if (*rc::gen::arbitrary<bool>()) {
    c.moe_expert_capacity_factor = static_cast<double>(*c.num_moe_experts) / c.moe_router_topk;  // capacity >= T
    c.moe_token_drop_policy = *rc::gen::element<std::string>("probs", "position");
  }
  std::mt19937_64 rng(*rc::gen::arbitrary<std::uint64_t>());
  const Run r = run_layer(c, gen_state_dict(c, rng), kFp32, random_mat(rng, s * b, c.hidden_size), s, b);
  const Tensor& map = *r.taps.find("mlp.router.1");
  const BoolMat m = to_bool_mat(map, s * b, *c.num_moe_experts);
  for (Index t = 0; t < m.rows(); ++t) RC_ASSERT(m.row(t).count() == c.moe_router_topk);
}

// No expert ever holds more tokens than its capacity; padding to capacity fills every expert to
// exactly the capacity.
RC_GTEST_PROP(MoEProperties, NoExpertExceedsCapacity, ()) {
  const Index s = *rc::gen::inRange(1, 7), b = *rc::gen::inRange(1, 4), T = s * b;
  TransformerConfig c = gen_config(Options{}, T);
  c.moe_expert_capacity_factor = *rc::gen::inRange(1, 21) / 10.0;
  c.moe_token_drop_policy = *rc::gen::element<std::string>("probs", "position");
  c.moe_pad_expert_input_to_capacity = *rc::gen::arbitrary<bool>();
  const Index capacity = get_capacity(T * c.moe_router_topk, *c.num_moe_experts, *c.moe_expert_capacity_factor);
  if (c.moe_pad_expert_input_to_capacity && capacity > T) c.moe_token_dispatcher_type = "allgather";
  std::mt19937_64 rng(*rc::gen::arbitrary<std::uint64_t>());
  const Run r = run_layer(c, gen_state_dict(c, rng), kFp32, random_mat(rng, T, c.hidden_size), s, b);
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
  const Index s = *rc::gen::inRange(1, 7), b = *rc::gen::inRange(1, 4), T = s * b;
  TransformerConfig c = gen_config(Options{}, T);
  c.moe_router_load_balancing_type = *rc::gen::element<std::string>("aux_loss", "seq_aux_loss", "global_aux_loss");
  c.moe_z_loss_coeff = 1e-3;
  std::vector<bool> pad(static_cast<std::size_t>(T));
  for (Index i = 0; i < T; ++i) pad[i] = *rc::gen::arbitrary<bool>();
  pad[static_cast<std::size_t>(*rc::gen::inRange<Index>(0, T))] = false;  // at least one real token
  const Tensor padding_mask = Tensor::from_vector<bool>({b, s}, pad);     // [b, s]
  std::mt19937_64 rng(*rc::gen::arbitrary<std::uint64_t>());
  const StateDict sd = gen_state_dict(c, rng);
  const Mat x = random_mat(rng, T, c.hidden_size);
  Mat y = x;
  const Mat noise = random_mat(rng, T, c.hidden_size, 3.0);
  for (Index bi = 0; bi < b; ++bi)
    for (Index si = 0; si < s; ++si)
      if (pad[bi * s + si]) y.row(si * b + bi) = noise.row(si * b + bi);  // token t = s_idx * b + b_idx
  const Run rx = run_layer(c, sd, kFp32, x, s, b, &padding_mask);
  const Run ry = run_layer(c, sd, kFp32, y, s, b, &padding_mask);
  RC_ASSERT(!rx.aux.empty());
  RC_ASSERT(rx.aux == ry.aux);
}

// allgather and alltoall dispatch agree bitwise: outputs, the experts' inputs and every tap.
RC_GTEST_PROP(MoEProperties, AllgatherAndAlltoallAgreeBitwise, ()) {
  const Index s = *rc::gen::inRange(1, 7), b = *rc::gen::inRange(1, 4);
  TransformerConfig c = gen_config(Options{true, true, true}, s * b);
  std::mt19937_64 rng(*rc::gen::arbitrary<std::uint64_t>());
  const StateDict sd = gen_state_dict(c, rng);
  const Mat x = random_mat(rng, s * b, c.hidden_size);
  c.moe_token_dispatcher_type = "allgather";
  const Run ag = run_layer(c, sd, kFp32, x, s, b);
  c.moe_token_dispatcher_type = "alltoall";
  const Run a2a = run_layer(c, sd, kFp32, x, s, b);
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
  const Index s = *rc::gen::inRange(1, 7), b = *rc::gen::inRange(1, 4);
  const TransformerConfig c = gen_config(Options{true, true, true}, s * b);
  std::mt19937_64 rng(*rc::gen::arbitrary<std::uint64_t>());
  const StateDict sd = gen_state_dict(c, rng);
  const Mat x = random_mat(rng, s * b, c.hidden_size);
  const Run whole = run_layer(c, sd, kFp32, x, s, b);

  MoELayer layer(c, kFp32);
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
