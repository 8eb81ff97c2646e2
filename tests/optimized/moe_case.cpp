// The optimized MoE layer's property-test cases (moe_case.h).
#include "tests/optimized/moe_case.h"

#include <algorithm>
#include <cstring>
#include <random>
#include <regex>

#include "parity/bounds.h"
#include "parity/golden.h"

namespace twin::moe_case {

using namespace twin::parity;

Tensor random(DType dt, Shape shape, double scale, std::mt19937_64& rng) {
  std::normal_distribution<double> n(0.0, scale);
  std::vector<double> v(static_cast<std::size_t>(shape_numel(shape)));
  for (auto& x : v) x = n(rng);
  return Tensor::from_doubles(dt, std::move(shape), v);
}

rc::Gen<OptMoECase> gen_opt_moe_case(int experts_multiple_of) {
  return proptest::rerunnable<OptMoECase>(rc::gen::exec([experts_multiple_of] {
    OptMoECase o;
    o.dtype = *proptest::gen_case_dtype();
    o.s = *rc::gen::inRange(1, 7);
    o.b = *rc::gen::inRange(1, 3);
    o.rms = *rc::gen::arbitrary<bool>();
    o.glu = *rc::gen::arbitrary<bool>();
    o.act = *rc::gen::element<std::string>("gelu", "silu");
    o.bias = *rc::gen::arbitrary<bool>();
    o.rope = *rc::gen::element<std::string>("none", "half");
    o.seed = *rc::gen::inRange<std::uint64_t>(1, 1000000);
    const int em = experts_multiple_of;
    const int E = o.E = em * *rc::gen::inRange(std::max(1, 2 / em), 8 / em + 1),
              k = o.k = *rc::gen::inRange(1, std::min(E, 4) + 1);
    o.ffn = *rc::gen::element(8, 24);
    o.score = *rc::gen::element<std::string>("softmax", "sigmoid");
    o.pre = o.score == "softmax" && (k == 1 || *rc::gen::arbitrary<bool>());
    if (*rc::gen::inRange(0, 3) == 0) {
      std::vector<int> divisors;
      for (int g = 2; g <= E; ++g)
        if (E % g == 0) divisors.push_back(g);
      if (!divisors.empty()) {
        const int G = *rc::gen::elementOf(divisors), gk = *rc::gen::inRange(1, G + 1);
        if (k <= gk * (E / G)) {
          o.groups = G;
          o.group_topk = gk;
        }
      }
    }
    o.scale = *rc::gen::inRange(0, 3) == 0;
    o.dispatcher = *rc::gen::element<std::string>("allgather", "alltoall");
    o.lb = *rc::gen::element<std::string>("aux_loss", "seq_aux_loss", "global_aux_loss", "none");
    o.z_loss = *rc::gen::arbitrary<bool>();
    o.expert_bias = o.score == "sigmoid" && *rc::gen::arbitrary<bool>();
    if (!o.bias && *rc::gen::arbitrary<bool>()) {
      o.shared = true;
      o.gate = *rc::gen::arbitrary<bool>();
    }
    if (*rc::gen::inRange(0, 3) == 0) {
      const std::int64_t T = std::int64_t(o.s) * o.b;
      o.capacity = *rc::gen::inRange(2, 16) / 8.0;
      o.drop = *rc::gen::element<std::string>("probs", "position");
      o.pad =
          *rc::gen::arbitrary<bool>() && reference::moe::get_capacity(T * k, E, o.capacity) <= T;  // alltoall needs it
    }
    return o;
  }));
}

void shape_for_tensor_parallel(OptMoECase& o, int tp) {
  o.s = tp * ((o.s + tp - 1) / tp);
  o.capacity = 0.0;
  o.pad = false;
}

MoECase make_case(const OptMoECase& o, int heads) {
  MoECase m;
  DenseCase& d = m.dense;
  d.heads = d.groups = heads;
  d.dtype = o.dtype;
  d.s = o.s;
  d.b = o.b;
  d.rms = o.rms;
  d.glu = o.glu;
  d.act = o.act;
  d.bias = o.bias;
  d.rope = o.rope == "half" ? RopeKind::Half : RopeKind::None;
  d.seed = o.seed;
  const DenseInputs in = make_inputs(d);
  TransformerConfig& c = m.config = in.config;
  m.hidden_states = in.hidden_states;
  m.attention_mask = in.attention_mask;
  m.rotary_pos_emb = in.rotary_pos_emb;

  const int E = o.E;
  c.num_moe_experts = E;
  c.moe_router_topk = o.k;
  c.moe_ffn_hidden_size = o.ffn;
  c.moe_router_score_function = o.score;
  c.moe_router_pre_softmax = o.pre;
  if (o.groups > 0) {
    c.moe_router_num_groups = o.groups;
    c.moe_router_group_topk = o.group_topk;
  }
  if (o.scale) c.moe_router_topk_scaling_factor = 2.5;
  c.moe_token_dispatcher_type = o.dispatcher;
  c.moe_router_load_balancing_type = o.lb;
  c.moe_aux_loss_coeff = c.moe_router_load_balancing_type == "none" ? 0.0 : 0.01;
  if (o.z_loss) c.moe_z_loss_coeff = 1e-3;
  c.moe_router_enable_expert_bias = o.expert_bias;
  if (o.shared) {
    c.moe_shared_expert_intermediate_size = 12;
    c.moe_shared_expert_gate = o.gate;
  }
  if (o.capacity > 0.0) {
    c.moe_expert_capacity_factor = o.capacity;
    c.moe_token_drop_policy = o.drop;
    c.moe_pad_expert_input_to_capacity = o.pad;
  }

  // Params: the attention half from the dense case, the MoE's drawn here.
  std::mt19937_64 rng(d.seed * 7919);
  for (const auto& [key, t] : in.params)
    if (key.rfind("mlp.", 0) != 0) m.params[key] = t;
  const DType dt = d.dtype;
  const std::int64_t h = c.hidden_size, ffn = *c.moe_ffn_hidden_size, glu = c.gated_linear_unit ? 2 : 1;
  m.params["mlp.router.weight"] = random(dt, {E, h}, 0.5, rng);
  if (c.add_bias_linear) m.params["mlp.router.bias"] = random(dt, {E}, 0.1, rng);
  if (c.moe_router_enable_expert_bias) m.params["mlp.router.expert_bias"] = random(DType::F32, {E}, 0.2, rng);
  for (int e = 0; e < E; ++e) {
    const std::string p = "mlp.experts.local_experts." + std::to_string(e) + ".";
    m.params[p + "linear_fc1.weight"] = random(dt, {glu * ffn, h}, 0.3, rng);
    m.params[p + "linear_fc2.weight"] = random(dt, {h, ffn}, 0.3, rng);
    if (c.add_bias_linear) {
      m.params[p + "linear_fc1.bias"] = random(dt, {glu * ffn}, 0.1, rng);
      m.params[p + "linear_fc2.bias"] = random(dt, {h}, 0.1, rng);
    }
  }
  if (c.moe_shared_expert_intermediate_size) {
    const std::int64_t sh = *c.moe_shared_expert_intermediate_size;
    m.params["mlp.shared_experts.linear_fc1.weight"] = random(dt, {glu * sh, h}, 0.3, rng);
    m.params["mlp.shared_experts.linear_fc2.weight"] = random(dt, {h, sh}, 0.3, rng);
    if (c.moe_shared_expert_gate) m.params["mlp.shared_experts.gate_weight"] = random(dt, {1, h}, 0.3, rng);
  }
  return m;
}

std::string describe(const MoECase& m) {
  const TransformerConfig& c = m.config;
  return fmt::format(
      "moe({}, E={}, k={}, score={}, pre={}, groups={}/{}, scale={}, expert_bias={}, dispatcher={}, lb={}, z={}, "
      "shared={}{}, capacity={} {} pad={}, bias={})",
      to_id(m.dense), *c.num_moe_experts, c.moe_router_topk, c.moe_router_score_function, c.moe_router_pre_softmax,
      c.moe_router_num_groups.value_or(0), c.moe_router_group_topk.value_or(0),
      c.moe_router_topk_scaling_factor.value_or(0), c.moe_router_enable_expert_bias, c.moe_token_dispatcher_type,
      c.moe_router_load_balancing_type, c.moe_z_loss_coeff.has_value(),
      c.moe_shared_expert_intermediate_size.value_or(0), c.moe_shared_expert_gate ? "+gate" : "",
      c.moe_expert_capacity_factor.value_or(0), c.moe_token_drop_policy, c.moe_pad_expert_input_to_capacity,
      c.add_bias_linear);
}

std::unique_ptr<reference::moe::MoETransformerLayer> make_reference(const MoECase& m, bool exact) {
  using namespace twin::reference;
  const TransformerConfig& c = m.config;
  const ModuleSpec spec =
      moe::get_gpt_layer_local_moe_spec(*c.num_moe_experts, false, c.qk_layernorm, c.normalization, c.qk_l2_norm);
  auto layer = std::make_unique<moe::MoETransformerLayer>(
      c, spec.submodules, 1, std::nullopt, Precision::from_config(c, exact ? ComputeMode::Exact : ComputeMode::FP32));
  layer->load_state_dict(StateDict(m.params));
  layer->training = true;  // the losses run; the dropout probabilities are 0
  return layer;
}

Tensor reference_forward(const MoECase& m, reference::moe::MoETransformerLayer& layer, Record* rec) {
  using namespace twin::reference;
  LayerInputs li;
  li.attention_mask = m.attention_mask.defined() ? &m.attention_mask : nullptr;
  li.rotary_pos_emb = m.rotary_pos_emb.defined() ? &m.rotary_pos_emb : nullptr;
  CountRoundings counting;
  return layer.forward(m.hidden_states, li, rec ? Taps(rec) : Taps()).first;
}

Tensor reference_forward(const MoECase& m, bool exact, Record* rec) {
  return reference_forward(m, *make_reference(m, exact), rec);
}

opt::MoEForwardInputs optimized_inputs(const MoECase& m) {
  opt::MoEForwardInputs in;
  in.attention_mask = m.attention_mask.defined() ? &m.attention_mask : nullptr;
  in.rotary_pos_emb = m.rotary_pos_emb.defined() ? &m.rotary_pos_emb : nullptr;
  return in;
}

Tensor optimized_forward(const MoECase& m, opt::MoETransformerLayer& layer, Record* rec) {
  opt::ForwardOptions fo;
  fo.training = true;
  fo.record_taps = rec != nullptr;
  CountRoundings counting;
  auto out = layer.forward(m.hidden_states, optimized_inputs(m), fo);
  if (rec) *rec = std::move(out.record);
  return out.hidden_states;
}

Tensor optimized_forward(const MoECase& m, Record* rec, int ep) {
  TransformerConfig c = m.config;
  c.expert_model_parallel_size = ep;
  opt::MoETransformerLayer layer(c, m.params, opt::LayerOptions{});
  return optimized_forward(m, layer, rec);
}

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

bool has_near_tie(const Tensor& logits, std::int64_t E, double gap) {
  const std::int64_t T = logits.numel() / E;
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t i = 0; i < E; ++i)
      for (std::int64_t j = i + 1; j < E; ++j)
        if (std::abs(logits.at_f64(t * E + i) - logits.at_f64(t * E + j)) <= gap) return true;
  return false;
}

bool inside_an_expert(const std::string& key) {
  static const std::regex gemm(R"(tap\.mlp\.experts\.local_experts\.[0-9]+\.linear_fc[12]\.[01])");
  return std::regex_match(key, gemm);
}

MoECase with_second_input(MoECase m) {
  std::vector<double> v = m.hidden_states.to_f64();
  for (std::size_t i = 0; i < v.size(); i += 3) v[i] = -v[i];
  m.hidden_states = Tensor::from_doubles(m.hidden_states.dtype(), m.hidden_states.shape(), v);
  return m;
}

MoECase make_backward_case() {
  OptMoECase o = *gen_opt_moe_case();
  o.bias = false;
  return make_case(o);
}

void discard_if_routed_on_a_near_tie(const Record& ref, const Record& got, std::int64_t E) {
  if (bitwise_equal(*ref.find("mlp.router.1"), *got.find("mlp.router.1"))) return;
  const Tensor& rl = *ref.find("mlp.router.logits");
  const double gap = 2 * max_abs_diff(rl, *got.find("mlp.router.logits")) + 4 * unit_roundoff(rl.dtype()) * max_abs(rl);
  RC_ASSERT(has_near_tie(rl, E, gap));
  RC_DISCARD("routing decided by a near-tie");
}

Tensor output_gradient(const MoECase& m) {
  std::mt19937_64 rng(m.dense.seed * 31 + 7);
  return random(m.dense.dtype, m.hidden_states.shape(), 1.0, rng);
}

Record reference_with_gradients(const MoECase& m, const Tensor& dout) {
  using namespace twin::reference;
  const auto layer = make_reference(m, false);
  LayerInputs li;
  li.attention_mask = m.attention_mask.defined() ? &m.attention_mask : nullptr;
  li.rotary_pos_emb = m.rotary_pos_emb.defined() ? &m.rotary_pos_emb : nullptr;
  Record rec;
  CountRoundings counting;
  TransformerLayerSaved saved;
  layer->forward(m.hidden_states, li, Taps(&rec), &saved);
  const TransformerLayerGrads g = layer->backward(dout, std::move(saved));
  for (const ParamGrad& p : g.params)
    rec.add(Role::Grad, "param." + p.name, p.stored(layer->precision.storage_dtype())).magnitude = p.magnitude;
  rec.add(Role::Grad, "input.hidden_states", g.hidden_states);
  return rec;
}

Record optimized_with_gradients(const MoECase& m, const Tensor& dout, int ep, int tp, bool processes) {
  TransformerConfig c = m.config;
  c.expert_model_parallel_size = ep;
  opt::LayerOptions lo;
  lo.tp = tp;
  lo.sp = tp > 1;
  lo.processes = processes;
  opt::MoETransformerLayer layer(c, m.params, lo);
  opt::ForwardOptions fo;
  fo.training = true;
  fo.record_taps = true;
  fo.keep_for_backward = true;
  CountRoundings counting;
  Record rec = layer.forward(m.hidden_states, optimized_inputs(m), fo).record;
  const opt::LayerGradients g = layer.backward(dout, /*with_magnitudes=*/true);
  for (const opt::ParamGradient& p : g.params) rec.add(Role::Grad, "param." + p.name, p.value).magnitude = p.magnitude;
  rec.add(Role::Grad, "input.hidden_states", g.hidden_states);
  return rec;
}

}  // namespace twin::moe_case
