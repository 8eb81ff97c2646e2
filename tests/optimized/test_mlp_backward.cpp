// The MLP half of the optimized dense backward (optimized/mlp_backward.cuh) against the reference's
// steps (bias_dropout_add_backward, MLP::backward, the norm's backward, the residual's sum) on the
// same saved forward tensors (the reference's forward, stored in the dtype), on the simulator.
//
// Bound: a chain of ops, so the whole-layer rule (parity::reference_error_bound): the optimized
// twin may be off from the reference by twice the reference's own max error against its fp64
// (Exact) run of the same backward on the same saved tensors, plus one ulp of the gradient's
// magnitude, plus the dtype's default. Each case also runs twice with bitwise equal results.
#include <gtest/gtest.h>

#include <cstring>
#include <fmt/format.h>
#include <map>
#include <random>

#include "optimized/mlp_backward.cuh"
#include "parity/bounds.h"
#include "reference/fused_bias_dropout.h"
#include "reference/mlp.h"
#include "reference/torch_norm.h"
#include "tests/optimized/sim_util.h"

using namespace twin;
using namespace twin::test;
namespace k = twin::opt::sim;
namespace ref = twin::reference;
using parity::max_abs;

namespace {

struct MlpCase {
  DType dt;
  bool rms, glu, bias;
  std::string act;
  double p;
  int n, h, ffn;
  std::string id() const {
    return fmt::format("mlp_half_backward(dtype={},norm={},act={},glu={},bias={},p={},n={},h={},ffn={})", dt_name(dt),
                       rms ? "rms" : "ln", act, int(glu), int(bias), p, n, h, ffn);
  }
};

// The reference's gradients of one case, in mode `mode`, from the saved tensors.
struct RefGrads {
  ref::Mat dhidden, d_ln2_w, d_ln2_b, d_fc1_w, d_fc1_b, d_fc2_w, d_fc2_b;
};

Tensor bits(const rt::DeviceBuffer& b, DType dt, Shape s) { return from_device(b, dt, std::move(s)); }

void run_case(const MlpCase& c) {
  const DType dt = c.dt;
  const int w = c.glu ? 2 * c.ffn : c.ffn;
  const ref::Precision pr{ref::ComputeMode::FP32, dt}, ex{ref::ComputeMode::Exact, dt};
  TransformerConfig cfg;
  cfg.hidden_size = c.h;
  cfg.ffn_hidden_size = c.ffn;
  cfg.num_attention_heads = 1;
  cfg.activation_func = c.act;
  cfg.gated_linear_unit = c.glu;
  cfg.add_bias_linear = c.bias;
  // Parameters and inputs, values of dt.
  const Tensor hidden = random_tensor(dt, {c.n, c.h}, -2, 2, 1), dout = random_tensor(dt, {c.n, c.h}, -1, 1, 2);
  const Tensor ln_w = random_tensor(dt, {c.h}, 0.5, 1.5, 3), ln_b = random_tensor(dt, {c.h}, -0.5, 0.5, 4);
  const Tensor w1 = random_tensor(dt, {w, c.h}, -0.3, 0.3, 5), b1 = random_tensor(dt, {w}, -0.3, 0.3, 6);
  const Tensor w2 = random_tensor(dt, {c.h, c.ffn}, -0.3, 0.3, 7), b2 = random_tensor(dt, {c.h}, -0.3, 0.3, 8);
  auto make_norm = [&](const ref::Precision& p) -> std::unique_ptr<ref::Norm> {
    std::unique_ptr<ref::Norm> nm;
    if (c.rms)
      nm = std::make_unique<ref::RMSNorm>(c.h, 1e-5, false, p);
    else
      nm = std::make_unique<ref::LayerNorm>(c.h, 1e-5, false, p);
    nm->load_state_dict(ref::StateDict({{"weight", ln_w}, {"bias", ln_b}}), "");
    return nm;
  };
  auto make_mlp = [&](const ref::Precision& p) {
    auto m = std::make_unique<ref::MLP>(cfg, p);
    std::map<std::string, Tensor> sd = {{"linear_fc1.weight", w1}, {"linear_fc2.weight", w2}};
    if (c.bias) {
      sd["linear_fc1.bias"] = b1;
      sd["linear_fc2.bias"] = b2;
    }
    m->load_state_dict(ref::StateDict(sd), "");
    return m;
  };
  // The reference's forward in dt: the saved tensors both backwards start from.
  const ref::Mat hid = ref::to_mat(hidden, c.n, c.h, "hidden");
  const ref::Mat ln2 = make_norm(pr)->forward(hid);
  auto mlp = make_mlp(pr);
  ref::MlpSaved saved;
  ref::MlpArgs args;
  args.lead = {c.n};
  args.training = c.p > 0;
  mlp->forward(ln2, args, ref::Taps(), &saved);
  const ref::Mat fc1_pre = mlp->linear_fc1.forward(ln2).output;  // skip_bias_add: before the bias
  const ref::DropoutRng rng{77, 5};

  auto reference = [&](const ref::Precision& p) {
    RefGrads g;
    const ref::BiasDropoutAddGrads bda =
        ref::bias_dropout_add_backward(ref::to_mat(dout, c.n, c.h, "dout"), c.p, c.p > 0, rng, p);
    const ref::MlpGrads mg = make_mlp(p)->backward(bda.x, ref::MlpSaved(saved), args);  // a copy: it is consumed
    const ref::NormGrads ng = make_norm(p)->backward(mg.hidden_states, hid);
    g.dhidden = p.act(ng.input + bda.residual);  // autograd's sum of the two paths, stored
    g.d_ln2_w = ng.weight;
    g.d_ln2_b = ng.bias;
    for (const auto& pg : mg.params) {
      if (pg.name == "linear_fc1.weight") g.d_fc1_w = pg.mat();
      if (pg.name == "linear_fc1.bias") g.d_fc1_b = pg.mat();
      if (pg.name == "linear_fc2.weight") g.d_fc2_w = pg.mat();
      if (pg.name == "linear_fc2.bias") g.d_fc2_b = pg.mat();
    }
    return g;
  };
  const RefGrads r = reference(pr), e = reference(ex);

  // The optimized backward on the same saved tensors.
  const std::size_t es = dtype_size(dt);
  auto dev = [&](const ref::Mat& m, Shape s) { return to_device(pr.to_tensor(m, std::move(s))); };
  auto d_hidden = to_device(hidden), d_ln2 = dev(ln2, {c.n, c.h}), d_fc1 = dev(fc1_pre, {c.n, w}),
       d_act = dev(saved.linear_fc2.input, {c.n, c.ffn}), d_dout = to_device(dout);
  auto d_lnw = to_device(ln_w), d_w1 = to_device(w1), d_b1 = to_device(b1), d_w2 = to_device(w2);
  rt::DeviceBuffer g_hidden(sim(), std::size_t(c.n) * c.h * es), g_lnw(sim(), c.h * es), g_lnb(sim(), c.h * es),
      g_w1(sim(), std::size_t(w) * c.h * es), g_b1(sim(), w * es), g_w2(sim(), std::size_t(c.h) * c.ffn * es),
      g_b2(sim(), c.h * es), s_mlp(sim(), std::size_t(c.n) * c.h * es), s_act(sim(), std::size_t(c.n) * c.ffn * es),
      s_fc1(sim(), std::size_t(c.n) * w * es), s_ln2(sim(), std::size_t(c.n) * c.h * es);
  const std::size_t ws_bytes = k::mlp_half_backward_workspace_bytes(c.rms, c.n, c.h, c.ffn, c.glu);
  rt::DeviceBuffer ws(sim(), ws_bytes);
  opt::MlpHalfBackward a;
  a.dt = dt;
  a.n = c.n;
  a.h = c.h;
  a.ffn = c.ffn;
  a.glu = c.glu;
  a.rms = c.rms;
  a.act = twin::opt::act_from_name(c.act);
  a.drop = opt::DropoutArgs::make(c.p, c.p > 0, rng.seed, rng.offset);
  a.hidden = d_hidden.get();
  a.ln2 = d_ln2.get();
  a.fc1 = d_fc1.get();
  a.act_out = d_act.get();
  a.ln2_w = d_lnw.get();
  a.fc1_w = d_w1.get();
  a.fc1_b = c.bias ? d_b1.get() : nullptr;
  a.fc2_w = d_w2.get();
  a.fc2_bias = c.bias;
  a.dout = d_dout.get();
  a.dhidden = g_hidden.get();
  a.d_ln2_w = g_lnw.get();
  a.d_ln2_b = c.rms ? nullptr : g_lnb.get();
  a.d_fc1_w = g_w1.get();
  a.d_fc1_b = c.bias ? g_b1.get() : nullptr;
  a.d_fc2_w = g_w2.get();
  a.d_fc2_b = c.bias ? g_b2.get() : nullptr;
  a.d_mlp = s_mlp.get();
  a.d_act = s_act.get();
  a.d_fc1 = s_fc1.get();
  a.d_ln2 = s_ln2.get();
  a.workspace = ws.get();
  a.workspace_bytes = ws_bytes;

  struct Out {
    std::string name;
    const rt::DeviceBuffer* buf;
    const ref::Mat* r;
    const ref::Mat* e;
    Shape shape;
  };
  std::vector<Out> outs = {{"dhidden", &g_hidden, &r.dhidden, &e.dhidden, {c.n, c.h}},
                           {"pre_mlp_layernorm.weight", &g_lnw, &r.d_ln2_w, &e.d_ln2_w, {c.h}},
                           {"linear_fc1.weight", &g_w1, &r.d_fc1_w, &e.d_fc1_w, {w, c.h}},
                           {"linear_fc2.weight", &g_w2, &r.d_fc2_w, &e.d_fc2_w, {c.h, c.ffn}}};
  if (!c.rms) outs.push_back({"pre_mlp_layernorm.bias", &g_lnb, &r.d_ln2_b, &e.d_ln2_b, {c.h}});
  if (c.bias) {
    outs.push_back({"linear_fc1.bias", &g_b1, &r.d_fc1_b, &e.d_fc1_b, {w}});
    outs.push_back({"linear_fc2.bias", &g_b2, &r.d_fc2_b, &e.d_fc2_b, {c.h}});
  }
  k::mlp_half_backward(a, nullptr);
  std::vector<Tensor> first;
  for (const Out& o : outs) first.push_back(bits(*o.buf, dt, o.shape));
  k::mlp_half_backward(a, nullptr);
  for (std::size_t i = 0; i < outs.size(); ++i) {
    const Out& o = outs[i];
    const Tensor again = bits(*o.buf, dt, o.shape);
    EXPECT_EQ(0, std::memcmp(first[i].raw(), again.raw(), first[i].nbytes()))
        << c.id() << " " << o.name << " differs between two runs";
    ASSERT_EQ(o.r->size(), first[i].numel()) << c.id() << " " << o.name;
    const Tensor expected = pr.to_tensor(*o.r, o.shape);
    const double ref_err = (*o.r - *o.e).cwiseAbs().maxCoeff();
    const Comparison cmp = compare(c.id() + " " + o.name, first[i], expected,
                                   parity::reference_error_bound(dt, ref_err, max_abs(expected)));
    EXPECT_TRUE(cmp.pass) << cmp.name << ": max abs " << cmp.max_abs << " at " << cmp.worst_index_str() << " actual "
                          << cmp.worst_actual << " expected " << cmp.worst_expected << " (" << cmp.tol.reason << ")";
  }
}

}  // namespace

TEST(OptimizedBackward, MlpHalfMatchesReference) {
  const MlpCase cases[] = {
      {DType::F32, false, false, true, "gelu", 0.0, 12, 32, 48},
      {DType::BF16, false, false, true, "gelu", 0.1, 12, 32, 48},
      {DType::BF16, true, true, false, "silu", 0.0, 9, 24, 40},
      {DType::F32, true, true, true, "silu", 0.1, 9, 24, 40},
      {DType::BF16, false, true, true, "squared_relu", 0.0, 300, 16, 24},
  };
  for (const MlpCase& c : cases)
    if (selected(c.id())) run_case(c);
}
