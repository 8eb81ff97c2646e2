// MoETransformerLayer and MoELayer: the three _forward_mlp phases
// compose bitwise to the whole _forward_mlp; a constructed-answer test whose outputs reveal which
// experts processed each token; clear errors for inconsistent configs and a bad padding_mask.
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <cmath>
#include <random>

#include "reference/moe/moe_transformer_layer.h"
#include "tests/reference/moe/moe_case.h"
#include "tests/reference/moe/moe_test_util.h"

namespace twin::reference::moe {
namespace {

using testing::f64_tensor;
using testing::random_mat;
using testing::random_moe_state_dict;
using testing::small_moe_config;

const Precision kFp32{ComputeMode::FP32, DType::F32};
const Precision kExact{ComputeMode::Exact, DType::F32};

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() && std::equal(a.raw(), a.raw() + a.nbytes(), b.raw());
}

std::unique_ptr<MoETransformerLayer> make_layer(const TransformerConfig& c, const StateDict& sd,
                                                const Precision& p = kFp32) {
  const ModuleSpec spec = get_gpt_layer_local_moe_spec(*c.num_moe_experts);
  auto layer = std::make_unique<MoETransformerLayer>(c, spec.submodules, 1, std::nullopt, p);
  layer->training = true;
  layer->moe_layer().load_state_dict(sd, "mlp.");  // the norms keep gamma 1, beta 0
  return layer;
}

// The three phases, called one after the other with the plain structs between them, give the
// whole _forward_mlp bitwise: output, every tap and every loss.
// Drawn in fp32, bf16 and fp16 (the phases must agree bitwise in every stored dtype).
RC_GTEST_PROP(MoETransformerLayerProperties, ThreePhasesComposeBitwiseToForwardMlp, ()) {
  const testing::MoECase mc = *proptest::rerunnable<testing::MoECase>(rc::gen::exec([] {
    testing::MoECase m;
    m.s = *rc::gen::inRange(1, 6);
    m.b = *rc::gen::inRange(1, 4);
    m.E = *rc::gen::inRange(2, 7);
    m.k = *rc::gen::inRange(1, m.E + 1);
    m.pre_softmax = m.k == 1;  // small_moe_config's choice
    m.dispatcher = *rc::gen::element<std::string>("allgather", "alltoall");
    m.lb = *rc::gen::element<std::string>("aux_loss", "seq_aux_loss", "global_aux_loss", "none");
    m.z_loss = 1e-3;
    m.glu = *rc::gen::arbitrary<bool>();
    if (*rc::gen::arbitrary<bool>()) {
      m.shared = 4;
      m.shared_gate = *rc::gen::arbitrary<bool>();
    } else {
      m.bias = *rc::gen::arbitrary<bool>();
    }
    if (*rc::gen::arbitrary<bool>()) {
      m.cap = *rc::gen::inRange(2, 16) / 10.0;
      m.drop = *rc::gen::element<std::string>("probs", "position");
    }
    if (*rc::gen::arbitrary<bool>()) {  // a padding mask, its first token real
      m.pad.assign(static_cast<std::size_t>(m.tokens()), '0');
      for (std::size_t i = 1; i < m.pad.size(); ++i) m.pad[i] = *rc::gen::arbitrary<bool>() ? '1' : '0';
    }
    m.dtype = *proptest::gen_case_dtype();
    m.seed = *rc::gen::arbitrary<std::uint64_t>();
    return m;
  }));
  const int s = mc.s, b = mc.b;
  const TransformerConfig c = testing::to_config(mc);
  std::mt19937_64 rng(mc.seed);
  const StateDict sd = testing::moe_state_dict(mc, c, rng);
  const Mat hidden_states =
      reference::testing::round_mat(random_mat(rng, static_cast<Index>(s) * b, c.hidden_size), mc.dtype);
  const Tensor padding_mask = testing::padding_mask_of(mc);
  LayerInputs inputs;
  if (mc.pad != "none") inputs.padding_mask = &padding_mask;
  const Precision p = testing::precision_of(mc);

  auto whole_layer = make_layer(c, sd, p);
  TapRecord whole_taps;
  const Mat whole = whole_layer->_forward_mlp(hidden_states, s, b, inputs, Taps(&whole_taps));

  auto phased_layer = make_layer(c, sd, p);
  TapRecord phased_taps;
  const Taps taps(&phased_taps);
  const MoERouterPhaseOutput routed = phased_layer->_forward_mlp_router(hidden_states, s, b, inputs, taps);
  const MoEExpertComputeOutput expert = phased_layer->_forward_mlp_expert_compute(routed, taps);
  const Mat phased = phased_layer->_forward_mlp_postprocess(routed.residual, expert.expert_output,
                                                            routed.shared_expert_output, expert.mlp_bias, taps);

  RC_ASSERT(whole.rows() == phased.rows() && whole.cols() == phased.cols());
  RC_ASSERT(std::equal(whole.data(), whole.data() + whole.size(), phased.data()));
  RC_ASSERT(whole_layer->moe_layer().aux_losses == phased_layer->moe_layer().aux_losses);
  RC_ASSERT(whole_taps.entries.size() == phased_taps.entries.size());
  for (std::size_t i = 0; i < whole_taps.entries.size(); ++i) {
    RC_ASSERT(whole_taps.entries[i].key() == phased_taps.entries[i].key());
    RC_ASSERT(same_bytes(whole_taps.entries[i].value, phased_taps.entries[i].value));
  }
}

// Constructed answer: hidden = E = 4, top-2 softmax routing with router weight 10 I, token t =
// 0.1 + 1.0 e_a + 0.5 e_b, so its logits pick experts a (11 + ...) and b; expert e has
// linear_fc1 = I (bias 0), relu, linear_fc2 = (e + 1) I and linear_fc2.bias = e (the expert id).
// With p_a = 1 / (1 + exp(-5)), p_b = 1 - p_a, the output must be
//   p_a ((a + 1) x + a) + p_b ((b + 1) x + b)
// (the probability scales the activation before fc2 and the bias after it): each token's output
// reveals its two experts. Checked for both dispatchers, in Exact mode.
TEST(MoEConstructedAnswer, OutputsRevealTheExpertsOfEachToken) {
  const int E = 4, h = 4;
  TransformerConfig c = small_moe_config(E, 2);
  c.hidden_size = h;
  c.num_attention_heads = 2;
  c.moe_ffn_hidden_size = h;
  c.activation_func = "relu";
  c.add_bias_linear = true;
  c.moe_router_load_balancing_type = "none";
  c.moe_aux_loss_coeff = 0.0;

  // Every ordered pair (a, b), a != b, once: 12 tokens as s = 6, b = 2.
  std::vector<std::pair<int, int>> pairs;
  for (int a = 0; a < E; ++a)
    for (int b = 0; b < E; ++b)
      if (a != b) pairs.emplace_back(a, b);
  const Index T = static_cast<Index>(pairs.size());
  Mat x = Mat::Constant(T, h, 0.1);
  for (Index t = 0; t < T; ++t) {
    x(t, pairs[t].first) += 1.0;
    x(t, pairs[t].second) += 0.5;
  }

  StateDict sd;
  sd.set("mlp.router.weight", f64_tensor(Mat(10.0 * Mat::Identity(E, h)), {E, h}));
  sd.set("mlp.router.bias", f64_tensor(Mat::Zero(1, E), {E}));
  for (int e = 0; e < E; ++e) {
    const std::string k = "mlp.experts.local_experts." + std::to_string(e) + ".";
    sd.set(k + "linear_fc1.weight", f64_tensor(Mat(Mat::Identity(h, h)), {h, h}));
    sd.set(k + "linear_fc1.bias", f64_tensor(Mat::Zero(1, h), {h}));
    sd.set(k + "linear_fc2.weight", f64_tensor(Mat((e + 1.0) * Mat::Identity(h, h)), {h, h}));
    sd.set(k + "linear_fc2.bias", f64_tensor(Mat::Constant(1, h, static_cast<double>(e)), {h}));
  }
  const double p_a = 1.0 / (1.0 + std::exp(-5.0)), p_b = 1.0 - p_a;

  for (const char* dispatcher : {"allgather", "alltoall"}) {
    SCOPED_TRACE(dispatcher);
    c.moe_token_dispatcher_type = dispatcher;
    MoELayer layer(c, kExact);
    layer.load_state_dict(sd, "mlp.");
    MlpArgs args;
    args.lead = {6, 2};
    TapRecord rec;
    const Mat out = layer.forward(x, args, Taps(&rec, "mlp.")).output;
    for (Index t = 0; t < T; ++t) {
      const auto [a, b] = pairs[t];
      for (Index j = 0; j < h; ++j) {
        const double expected = p_a * ((a + 1) * x(t, j) + a) + p_b * ((b + 1) * x(t, j) + b);
        EXPECT_NEAR(out(t, j), expected, 1e-12) << "token " << t << " experts (" << a << ", " << b << ")";
      }
    }
    // Every expert is chosen by 2 * (E - 1) = 6 tokens; dispatched rows are expert-major.
    const Tensor& tokens_per_expert = *rec.find("mlp.experts.tokens_per_expert", Role::TapIn);
    for (int e = 0; e < E; ++e) EXPECT_EQ(tokens_per_expert.at_f64(e), 6.0);
    const Tensor& dispatched = *rec.find("mlp.experts.dispatched_input", Role::TapIn);
    for (Index row = 0; row < dispatched.size(0); ++row) {
      const int e = static_cast<int>(row / 6);
      EXPECT_GE(dispatched.at_f64(row * h + e), 0.5) << "row " << row << " is not a token of expert " << e;
    }
  }
}

// ---- clear errors -----------------------------------------------------------------------------

template <class E, class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  return "(no " + std::string(typeid(E).name()) + " thrown)";
}

TEST(MoEErrors, TopkLargerThanNumberOfExperts) {
  TransformerConfig c = small_moe_config(4, 5);
  const std::string msg = error_of<ConfigError>([&] { MoELayer layer(c, kFp32); });
  EXPECT_NE(msg.find("moe_router_topk (5)"), std::string::npos) << msg;
  EXPECT_NE(msg.find("num_moe_experts (4)"), std::string::npos) << msg;
}

TEST(MoEErrors, GroupsThatDoNotDivideTheExperts) {
  TransformerConfig c = small_moe_config(6, 2);
  c.moe_router_num_groups = 4;
  c.moe_router_group_topk = 2;
  const std::string msg = error_of<ConfigError>([&] { MoELayer layer(c, kFp32); });
  EXPECT_NE(msg.find("num_moe_experts (6) should be divisible by moe_router_num_groups (4)"), std::string::npos) << msg;
}

TEST(MoEErrors, GroupTopkNotReachingTopkExperts) {
  TransformerConfig c = small_moe_config(8, 4);
  c.moe_router_num_groups = 4;  // 2 experts per group, 1 group chosen: only 2 reachable
  c.moe_router_group_topk = 1;
  const std::string msg = error_of<MoEError>([&] { MoELayer layer(c, kFp32); });
  EXPECT_NE(msg.find("moe_router_topk (4) exceeds the 2 experts"), std::string::npos) << msg;
}

TEST(MoEErrors, TopOneSoftmaxWithoutPreSoftmax) {
  TransformerConfig c = small_moe_config(4, 1);
  c.moe_router_pre_softmax = false;
  const std::string msg = error_of<ConfigError>([&] { MoELayer layer(c, kFp32); });
  EXPECT_NE(msg.find("Please use --moe-router-pre-softmax when topk is 1"), std::string::npos) << msg;
  c.moe_router_score_function = "sigmoid";  // top-1 sigmoid is fine
  EXPECT_NO_THROW(MoELayer(c, kFp32));
}

TEST(MoEErrors, PaddingMaskOfTheWrongShape) {
  const TransformerConfig c = small_moe_config(4, 2);
  std::mt19937_64 rng(7);
  MoELayer layer(c, kFp32);
  layer.load_state_dict(random_moe_state_dict(c, rng), "mlp.");
  const Index s = 3, b = 2;
  const Tensor wrong = Tensor::from_vector<bool>({s, b}, std::vector<bool>(s * b, false));  // [s, b], not [b, s]
  MlpArgs args;
  args.lead = {s, b};
  args.padding_mask = &wrong;
  const std::string msg =
      error_of<ShapeError>([&] { layer.forward(random_mat(rng, s * b, c.hidden_size), args, Taps()); });
  EXPECT_NE(msg.find("padding_mask"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[2, 3]"), std::string::npos) << msg;  // expected [b, s]
  EXPECT_NE(msg.find("[3, 2]"), std::string::npos) << msg;  // got
}

TEST(MoEErrors, SharedExpertsWithBias) {
  TransformerConfig c = small_moe_config(4, 2);
  c.moe_shared_expert_intermediate_size = 8;
  c.add_bias_linear = true;
  const std::string msg = error_of<MoEError>([&] { MoELayer layer(c, kFp32); });
  EXPECT_NE(msg.find("bias is not supported in the shared experts"), std::string::npos) << msg;
}

TEST(MoEErrors, RecordedRoutingMapThatIsNotACapacityOutcome) {
  TransformerConfig c = small_moe_config(4, 2);
  c.moe_expert_capacity_factor = 0.5;
  c.moe_token_drop_policy = "position";
  std::mt19937_64 rng(11);
  MoELayer layer(c, kFp32);
  layer.load_state_dict(random_moe_state_dict(c, rng), "mlp.");
  const Mat x = random_mat(rng, 8, c.hidden_size);
  MlpArgs args;
  args.lead = {4, 2};
  const Tensor every_pair =
      Tensor::from_vector<bool>({8, 4}, std::vector<bool>(32, true));  // every token to every expert
  args.recorded_routing_map = &every_pair;
  std::string msg = error_of<MoEError>([&] { layer.forward(x, args, Taps()); });
  EXPECT_NE(msg.find("recorded routing map gives token 0 4 experts, moe_router_topk is 2"), std::string::npos) << msg;
  std::vector<bool> first_two(32, false);  // every token to experts 0 and 1: a top-2 choice, past the capacity 2
  for (int t = 0; t < 8; ++t) first_two[std::size_t(t * 4)] = first_two[std::size_t(t * 4 + 1)] = true;
  const Tensor over_capacity = Tensor::from_vector<bool>({8, 4}, first_two);
  args.recorded_routing_map = &over_capacity;
  msg = error_of<MoEError>([&] { layer.forward(x, args, Taps()); });
  EXPECT_NE(msg.find("recorded routing map gives expert 0 8 tokens, the capacity rule gives 2"), std::string::npos)
      << msg;
}

}  // namespace
}  // namespace twin::reference::moe
