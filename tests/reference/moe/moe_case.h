// The MoE property case (tests/case_id.h): every router, dispatcher, expert and loss knob the MoE
// properties draw, the token layout [s, b], a padding mask, the stored dtype and the seed of the
// parameters and inputs, as one printable, rerunnable id:
//   moe(s=2,b=1,E=4,k=2,score=softmax,pre_softmax=0,groups=0,group_topk=0,topk_scale=0,glu=1,
//       act=silu,dispatcher=alltoall,lb=aux_loss,z_loss=0.001,expert_bias=0,shared=0,shared_gate=0,
//       bias=0,cap=0,drop=probs,pad_cap=0,pad=none,dtype=bf16,seed=7)
// Zero means "not set" for groups, topk_scale, z_loss, shared and cap.
#pragma once

#include <random>
#include <string>
#include <vector>

#include "tests/case_id.h"
#include "tests/reference/counted_bound.h"
#include "tests/reference/moe/moe_test_util.h"

namespace twin::reference::moe::testing {

struct MoECase : proptest::PropertyCase {
  static constexpr const char* kKind = "moe";
  int s = 1, b = 1, E = 2, k = 1;
  std::string score = "softmax";  // softmax | sigmoid
  bool pre_softmax = false;
  int groups = 0, group_topk = 0;  // group-limited routing when groups > 0
  double topk_scale = 0.0;         // moe_router_topk_scaling_factor (0: None)
  bool glu = false;
  std::string act = "gelu";
  std::string dispatcher = "allgather";  // allgather | alltoall
  std::string lb = "aux_loss";           // aux_loss | seq_aux_loss | global_aux_loss | none
  double z_loss = 0.0;
  bool expert_bias = false;
  int shared = 0;  // moe_shared_expert_intermediate_size (0: no shared experts)
  bool shared_gate = false;
  bool bias = false;  // add_bias_linear
  double cap = 0.0;   // moe_expert_capacity_factor (0: None)
  std::string drop = "probs";
  bool pad_cap = false;
  std::string pad = "none";  // padding_mask [b, s] as 0/1 in row-major order, or none
  DType dtype = DType::F32;
  std::uint64_t seed = 0;

  int tokens() const { return s * b; }
  template <class V>
  void fields(V& v) {
    v("s", s);
    v("b", b);
    v("E", E);
    v("k", k);
    v("score", score);
    v("pre_softmax", pre_softmax);
    v("groups", groups);
    v("group_topk", group_topk);
    v("topk_scale", topk_scale);
    v("glu", glu);
    v("act", act);
    v("dispatcher", dispatcher);
    v("lb", lb);
    v("z_loss", z_loss);
    v("expert_bias", expert_bias);
    v("shared", shared);
    v("shared_gate", shared_gate);
    v("bias", bias);
    v("cap", cap);
    v("drop", drop);
    v("pad_cap", pad_cap);
    v("pad", pad);
    v("dtype", dtype);
    v("seed", seed);
  }
};

// The case's TransformerConfig; bf16 / fp16 set Megatron's flags (Float16Module) and params_dtype.
inline TransformerConfig to_config(const MoECase& m) {
  TransformerConfig c = small_moe_config(m.E, m.k);
  c.moe_router_score_function = m.score;
  c.moe_router_pre_softmax = m.pre_softmax;
  if (m.groups > 0) {
    c.moe_router_num_groups = m.groups;
    c.moe_router_group_topk = m.group_topk;
  }
  if (m.topk_scale != 0.0) c.moe_router_topk_scaling_factor = m.topk_scale;
  c.gated_linear_unit = m.glu;
  c.activation_func = m.act;
  c.moe_token_dispatcher_type = m.dispatcher;
  c.moe_router_load_balancing_type = m.lb;
  if (m.z_loss != 0.0) c.moe_z_loss_coeff = m.z_loss;
  c.moe_router_enable_expert_bias = m.expert_bias;
  if (m.shared > 0) {
    c.moe_shared_expert_intermediate_size = m.shared;
    c.moe_shared_expert_gate = m.shared_gate;
  }
  c.add_bias_linear = m.bias;
  if (m.cap != 0.0) {
    c.moe_expert_capacity_factor = m.cap;
    c.moe_token_drop_policy = m.drop;
    c.moe_pad_expert_input_to_capacity = m.pad_cap;
  }
  c.bf16 = m.dtype == DType::BF16;
  c.fp16 = m.dtype == DType::F16;
  c.params_dtype = m.dtype == DType::BF16 ? "bfloat16" : m.dtype == DType::F16 ? "float16" : "float32";
  return c;
}

// The padding mask [b, s] (True = padding), or an undefined tensor for pad=none.
inline Tensor padding_mask_of(const MoECase& m) {
  if (m.pad == "none") return Tensor();
  std::vector<bool> bits(m.pad.size());
  for (std::size_t i = 0; i < bits.size(); ++i) bits[i] = m.pad[i] == '1';
  return Tensor::from_vector<bool>({m.b, m.s}, bits);
}

// Every parameter of the case's MoELayer (random_moe_state_dict, plus the expert bias), each value
// rounded to the case's dtype: parameters as Megatron holds them.
inline StateDict moe_state_dict(const MoECase& m, const TransformerConfig& c, std::mt19937_64& rng) {
  StateDict sd = random_moe_state_dict(c, rng);
  if (c.moe_router_enable_expert_bias) {
    const Index E = *c.num_moe_experts;
    sd.set("mlp.router.expert_bias", f64_tensor(random_mat(rng, 1, E, 0.2), {E}));
  }
  StateDict out;
  for (const auto& [key, t] : sd.tensors()) {
    std::vector<double> v = t.to_f64();
    for (double& x : v) x = round_to(m.dtype, round_to(DType::F32, x));
    out.set(key, Tensor::from_doubles(DType::F64, t.shape(), v));
  }
  return out;
}

// The precision the case's layer stores in.
inline Precision precision_of(const MoECase& m) { return Precision{ComputeMode::FP32, m.dtype}; }

}  // namespace twin::reference::moe::testing
