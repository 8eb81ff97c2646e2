// Property tests of the optimized dense layer with multi-latent attention (layer/mla_attention.cuh)
// on the simulator, forward and backward, against the reference's MLASelfAttention. RapidCheck
// draws >= 100 tiny MLA layers per property: with and without q_lora_rank, the latent norms,
// YaRN and plain RoPE, fp32 and bf16, masks, dropout, v_head_dim below and equal to the query's
// head dim; a failure prints its case.
//
// Bound: the whole-layer rule (parity::reference_error_bound) of every tensor: twice the
// reference's own max error against its fp64 (Exact) run of the same forward and backward, plus
// one ulp of the tensor's magnitude, plus the dtype's default: what any correct implementation of
// Megatron's math meets, not only this one.
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <cstring>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "optimized/transformer_layer.h"
#include "parity/bounds.h"
#include "reference/transformer_layer.h"
#include "tests/optimized/sim_util.h"

using namespace twin;
namespace ref = twin::reference;

namespace {

struct MlaCase {
  TransformerConfig config;
  int s = 0, b = 0;
  bool training = false;
  std::uint64_t seed = 0;
  std::map<std::string, Tensor> params;
  Tensor hidden_states, grad_output, attention_mask;
  std::string describe;
};

// A tiny dense layer with MLA: np in {2, 4}, the latent widths and q_lora_rank even (so tp 2
// splits them), v_head_dim up to the query's head dim.
MlaCase gen_mla_case() {
  MlaCase k;
  TransformerConfig& c = k.config;
  const DType dt = *rc::gen::element(DType::F32, DType::BF16);
  c.bf16 = dt == DType::BF16;
  const int np = *rc::gen::element(2, 4);
  c.num_layers = 2;
  c.hidden_size = 4 * *rc::gen::inRange(2, 5);
  c.num_attention_heads = np;
  c.num_query_groups = np;
  c.kv_channels = c.hidden_size / np;
  c.ffn_hidden_size = 2 * *rc::gen::inRange(2, 7);
  c.normalization = *rc::gen::element(std::string("LayerNorm"), std::string("RMSNorm"));
  c.activation_func = *rc::gen::element(std::string("gelu"), std::string("silu"));
  c.gated_linear_unit = *rc::gen::arbitrary<bool>();
  c.add_bias_linear = *rc::gen::arbitrary<bool>();
  c.qk_layernorm = *rc::gen::arbitrary<bool>();
  c.attention_softmax_in_fp32 = true;
  c.multi_latent_attention = true;
  c.position_embedding_type = "rope";
  c.q_lora_rank = *rc::gen::arbitrary<bool>() ? std::optional<int>(2 * *rc::gen::inRange(2, 5)) : std::nullopt;
  c.kv_lora_rank = 2 * *rc::gen::inRange(2, 5);
  c.qk_head_dim = 2 * *rc::gen::inRange(1, 4);
  c.qk_pos_emb_head_dim = 2 * *rc::gen::inRange(1, 3);
  c.v_head_dim = *rc::gen::inRange(1, c.qk_head_dim + c.qk_pos_emb_head_dim + 1);
  c.rope_type = *rc::gen::element(std::string("rope"), std::string("yarn"));
  if (c.rope_type == "yarn") {
    c.rotary_scaling_factor = *rc::gen::element(1.0, 4.0, 40.0);
    c.original_max_position_embeddings = *rc::gen::inRange(2, 64);
    c.mscale = *rc::gen::element(0.0, 0.5, 1.0);
    c.mscale_all_dim = *rc::gen::element(0.0, 0.5, 1.0);
  }
  k.training = *rc::gen::element(0, 0, 1) == 1;
  if (k.training) c.hidden_dropout = c.attention_dropout = 0.25;
  k.seed = *rc::gen::inRange<std::uint64_t>(0, 1u << 20);
  k.s = 2 * *rc::gen::inRange(1, 4);
  k.b = *rc::gen::inRange(1, 3);
  const int mask = *rc::gen::inRange(0, 3);  // causal, an explicit random one, none
  c.attn_mask_type = mask == 2 ? "padding" : "causal";
  const std::uint64_t data = *rc::gen::arbitrary<std::uint32_t>();

  const int h = c.hidden_size, qh = c.qk_head_dim + c.qk_pos_emb_head_dim, kvw = c.kv_lora_rank + c.qk_pos_emb_head_dim;
  const int fc1 = (c.gated_linear_unit ? 2 : 1) * c.ffn();
  const bool ln = c.normalization == "LayerNorm";
  std::uint64_t next = data * 977;
  auto add = [&](const std::string& key, Shape shape, double scale, double centre = 0.0) {
    k.params[key] = test::random_tensor(dt, std::move(shape), centre - scale, centre + scale, ++next);
  };
  auto norm = [&](const std::string& name, std::int64_t width) {
    add(name + ".weight", {width}, 0.5, 1.0);
    if (ln) add(name + ".bias", {width}, 0.1);
  };
  norm("input_layernorm", h);
  if (c.q_lora_rank) {
    add("self_attention.linear_q_down_proj.weight", {*c.q_lora_rank, h}, 0.5);
    if (c.qk_layernorm) norm("self_attention.q_layernorm", *c.q_lora_rank);
    add("self_attention.linear_q_up_proj.weight", {np * qh, *c.q_lora_rank}, 0.5);
  } else {
    add("self_attention.linear_q_proj.weight", {np * qh, h}, 0.5);
  }
  add("self_attention.linear_kv_down_proj.weight", {kvw, h}, 0.5);
  if (c.qk_layernorm) norm("self_attention.kv_layernorm", c.kv_lora_rank);
  add("self_attention.linear_kv_up_proj.weight", {np * (c.qk_head_dim + c.v_head_dim), c.kv_lora_rank}, 0.5);
  add("self_attention.linear_proj.weight", {h, np * c.v_head_dim}, 0.5);
  if (c.add_bias_linear) add("self_attention.linear_proj.bias", {h}, 0.1);
  norm("pre_mlp_layernorm", h);
  add("mlp.linear_fc1.weight", {fc1, h}, 0.5);
  if (c.add_bias_linear) add("mlp.linear_fc1.bias", {fc1}, 0.1);
  add("mlp.linear_fc2.weight", {h, c.ffn()}, 0.5);
  if (c.add_bias_linear) add("mlp.linear_fc2.bias", {h}, 0.1);
  k.hidden_states = test::random_tensor(dt, {k.s, k.b, h}, -1, 1, ++next);
  k.grad_output = test::random_tensor(dt, {k.s, k.b, h}, -1, 1, ++next);
  if (mask == 1) {
    std::vector<bool> m(std::size_t(k.b) * k.s * k.s);
    std::uint64_t x = next;
    for (std::size_t i = 0; i < m.size(); ++i)
      m[i] = ((x = x * 6364136223846793005ull + 1442695040888963407ull) >> 62) == 0;
    k.attention_mask = Tensor::from_vector<bool>({k.b, 1, k.s, k.s}, m);
  }
  std::ostringstream d;
  d << dtype_name(dt) << " h " << h << " np " << np << " q_lora "
    << (c.q_lora_rank ? std::to_string(*c.q_lora_rank) : "none") << " kv_lora " << c.kv_lora_rank << " qk "
    << c.qk_head_dim << " pe " << c.qk_pos_emb_head_dim << " v " << c.v_head_dim << " " << c.rope_type << " "
    << c.normalization << (c.qk_layernorm ? " latent norms" : "") << " s " << k.s << " b " << k.b << " mask " << mask
    << (k.training ? " dropout" : "");
  k.describe = d.str();
  return k;
}

// Every tensor a twin gives for the case: "output", "grad.input", "grad.param.<key>".
using Tensors = std::map<std::string, Tensor>;

Tensors reference_run(const MlaCase& k, ref::ComputeMode mode) {
  const TransformerConfig& c = k.config;
  const ref::Precision p = ref::Precision::from_config(c, mode);
  const ref::ModuleSpec spec =
      ref::get_gpt_layer_local_spec(std::nullopt, c.qk_layernorm, c.normalization, false,
                                    ref::attn_mask_type_from_name(c.attn_mask_type), /*multi_latent_attention=*/true);
  ref::TransformerLayer layer(c, spec.submodules, 1, std::nullopt, p);
  layer.load_state_dict(k.params);
  layer.training = k.training;
  layer.rng = ref::DropoutRng{k.seed, 0};
  ref::LayerInputs li;
  li.attention_mask = k.attention_mask.defined() ? &k.attention_mask : nullptr;
  ref::TransformerLayerSaved saved;
  auto [out, ctx] = layer.forward(k.hidden_states, li, ref::Taps(), &saved);
  const ref::TransformerLayerGrads g = layer.backward(k.grad_output, std::move(saved));
  Tensors t = {{"output", out}, {"grad.input", g.hidden_states}};
  for (const ref::ParamGrad& pg : g.params) t["grad.param." + pg.name] = pg.stored(p.storage_dtype());
  return t;
}

// graph: the forward and the backward each run twice with use_graph, the second a replay of the
// graph the first captured.
Tensors optimized_run(const MlaCase& k, int tp, bool sp, bool graph = false) {
  opt::LayerOptions lo;
  lo.tp = tp;
  lo.sp = sp;
  lo.attn_mask_type = k.config.attn_mask_type;
  opt::DenseTransformerLayer layer(k.config, k.params, lo);
  opt::ForwardOptions fo;
  fo.training = k.training;
  fo.seed = k.seed;
  fo.keep_for_backward = true;
  fo.use_graph = graph;
  const Tensor* mask = k.attention_mask.defined() ? &k.attention_mask : nullptr;
  opt::LayerOutput out = layer.forward(k.hidden_states, mask, nullptr, fo);
  if (graph) out = layer.forward(k.hidden_states, mask, nullptr, fo);
  opt::LayerGradients g = layer.backward(k.grad_output, false, graph);
  if (graph) g = layer.backward(k.grad_output, false, graph);
  Tensors t = {{"output", out.hidden_states}, {"grad.input", g.hidden_states}};
  for (const opt::ParamGradient& pg : g.params) t["grad.param." + pg.name] = pg.value;
  return t;
}

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

// Each tensor of `got` within the whole-layer bound of the reference's (FP32 against Exact).
void assert_within_bound(const std::string& what, const Tensors& got, const Tensors& reference, const Tensors& exact,
                         const Tensors& expected, DType dt) {
  RC_ASSERT(got.size() == expected.size());
  for (const auto& [name, t] : got) {
    RC_ASSERT(expected.count(name) == 1u);
    const Tensor& e = expected.at(name);
    const Tolerance tol = parity::reference_error_bound(dt, parity::max_abs_diff(reference.at(name), exact.at(name)),
                                                        parity::max_abs(reference.at(name)));
    const Comparison cmp = compare(what + " " + name, t, e, tol);
    RC_LOG() << cmp.name << ": max abs " << cmp.max_abs << " (share " << cmp.share_used << ")\n";
    RC_ASSERT(cmp.pass);
  }
}

}  // namespace

// Optimized == reference within the bound, forward and every gradient, at the drawn tensor-parallel
// size (1, 2, 2 with SP); two runs bitwise equal.
RC_GTEST_PROP(OptimizedMlaProperty, EqualsTheReferenceWithinBoundAndRunsBitwiseEqual, ()) {
  const MlaCase k = gen_mla_case();
  const int layout = *rc::gen::inRange(0, 3);
  const int tp = layout == 0 ? 1 : 2;
  const bool sp = layout == 2;
  RC_LOG() << k.describe << " tp " << tp << (sp ? " sp" : "") << "\n";
  const Tensors r = reference_run(k, ref::ComputeMode::FP32), e = reference_run(k, ref::ComputeMode::Exact);
  const Tensors got = optimized_run(k, tp, sp), again = optimized_run(k, tp, sp);
  for (const auto& [name, t] : got) RC_ASSERT(bitwise_equal(t, again.at(name)));
  assert_within_bound("optimized vs reference", got, r, e, r, params_dtype(k.config));
}

// Tensor parallelism 2 (with and without SP) agrees with tp 1 within the same bound.
RC_GTEST_PROP(OptimizedMlaProperty, TensorParallelSizesAgree, ()) {
  const MlaCase k = gen_mla_case();
  RC_LOG() << k.describe << "\n";
  const Tensors r = reference_run(k, ref::ComputeMode::FP32), e = reference_run(k, ref::ComputeMode::Exact);
  const Tensors tp1 = optimized_run(k, 1, false);
  for (bool sp : {false, true})
    assert_within_bound(sp ? "tp 2 + sp vs tp 1" : "tp 2 vs tp 1", optimized_run(k, 2, sp), r, e, tp1,
                        params_dtype(k.config));
}

// A CUDA-graph replay of the forward and of the backward is bitwise equal to eager execution, at
// the drawn tensor-parallel size (the simulator captures each rank's collectives with its kernels).
RC_GTEST_PROP(OptimizedMlaProperty, GraphReplayIsBitwiseEqualToEager, ()) {
  const MlaCase k = gen_mla_case();
  const int layout = *rc::gen::inRange(0, 3);
  RC_LOG() << k.describe << " layout " << layout << "\n";
  const Tensors eager = optimized_run(k, layout ? 2 : 1, layout == 2),
                replay = optimized_run(k, layout ? 2 : 1, layout == 2, /*graph=*/true);
  for (const auto& [name, t] : eager) {
    RC_LOG() << name << "\n";
    RC_ASSERT(bitwise_equal(t, replay.at(name)));
  }
}
