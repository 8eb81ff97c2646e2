// The attention half of the optimized dense backward (optimized/attention_backward.cuh) against the
// reference's steps (bias_dropout_add_backward, SelfAttention::backward, the norm's backward, the
// residual's sum: reference TransformerLayer::backward's last three modules) on the same saved
// forward tensors (the reference's forward, stored in the dtype), on the simulator. The softmax
// statistics the backward reads come from the optimized attention forward on the same q, k, v.
//
// Bound: a chain of ops, so the whole-layer rule (parity::reference_error_bound): the optimized
// twin may be off from the reference by twice the reference's own max error against its fp64
// (Exact) run of the same backward on the same saved tensors, plus one ulp of the gradient's
// magnitude, plus the dtype's default. Each case also runs twice with bitwise equal results.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fmt/format.h>
#include <map>

#include "optimized/attention_backward.cuh"
#include "parity/bounds.h"
#include "reference/attention.h"
#include "reference/fused_bias_dropout.h"
#include "reference/rotary_pos_embedding.h"
#include "reference/torch_norm.h"
#include "tests/optimized/sim_util.h"

using namespace twin;
using namespace twin::test;
namespace k = twin::opt::sim;
namespace ref = twin::reference;
using parity::max_abs;

namespace {

enum class Rope { None, Halves, Interleaved };

struct AttnCase {
  DType dt;
  bool rms, bias, causal;
  Rope rope;
  double rot_percent;
  double p;  // attention and hidden dropout
  int s, b, h, np, ng, hn;
  std::string id() const {
    return fmt::format(
        "attention_half_backward(dtype={},norm={},bias={},causal={},rope={},rot={},p={},s={},b={},h={},np={},ng={},"
        "hn={})",
        dt_name(dt), rms ? "rms" : "ln", int(bias), int(causal),
        rope == Rope::None     ? "none"
        : rope == Rope::Halves ? "halves"
                               : "interleaved",
        rot_percent, p, s, b, h, np, ng, hn);
  }
};

struct RefGrads {
  ref::Mat dx, d_ln1_w, d_ln1_b, d_qkv_w, d_qkv_b, d_proj_w, d_proj_b;
};

void run_case(const AttnCase& c) {
  const DType dt = c.dt;
  const int n = c.s * c.b, r = c.np / c.ng, gs = (r + 2) * c.hn, qw = c.ng * gs, cw = c.np * c.hn;
  const ref::Precision pr{ref::ComputeMode::FP32, dt}, ex{ref::ComputeMode::Exact, dt};
  TransformerConfig cfg;
  cfg.hidden_size = c.h;
  cfg.num_attention_heads = c.np;
  cfg.num_query_groups = c.ng;
  cfg.kv_channels = c.hn;
  cfg.ffn_hidden_size = 4 * c.h;
  cfg.add_bias_linear = c.bias;
  cfg.attention_dropout = c.p;
  cfg.hidden_dropout = c.p;
  cfg.bf16 = dt == DType::BF16;
  cfg.fp16 = dt == DType::F16;
  cfg.rotary_interleaved = c.rope == Rope::Interleaved;
  // Parameters and inputs, values of dt.
  const Tensor x = random_tensor(dt, {c.s, c.b, c.h}, -2, 2, 11), dh1 = random_tensor(dt, {c.s, c.b, c.h}, -1, 1, 12);
  const Tensor ln_w = random_tensor(dt, {c.h}, 0.5, 1.5, 13), ln_b = random_tensor(dt, {c.h}, -0.5, 0.5, 14);
  const Tensor wqkv = random_tensor(dt, {qw, c.h}, -0.3, 0.3, 15), bqkv = random_tensor(dt, {qw}, -0.3, 0.3, 16);
  const Tensor wproj = random_tensor(dt, {c.h, cw}, -0.3, 0.3, 17), bproj = random_tensor(dt, {c.h}, -0.3, 0.3, 18);
  Tensor rope;
  int rot = 0;
  if (c.rope != Rope::None) {
    const ref::RotaryEmbedding emb(c.hn, c.rot_percent, c.rope == Rope::Interleaved);
    rope = emb.forward(c.s);  // [s, 1, 1, rot] fp32 angles
    rot = emb.dim();
  }
  auto make_norm = [&](const ref::Precision& p) -> std::unique_ptr<ref::Norm> {
    std::unique_ptr<ref::Norm> nm;
    if (c.rms)
      nm = std::make_unique<ref::RMSNorm>(c.h, 1e-5, false, p);
    else
      nm = std::make_unique<ref::LayerNorm>(c.h, 1e-5, false, p);
    nm->load_state_dict(ref::StateDict({{"weight", ln_w}, {"bias", ln_b}}), "");
    return nm;
  };
  auto make_attn = [&](const ref::Precision& p) {
    auto a = std::make_unique<ref::SelfAttention>(cfg, ref::SelfAttentionSubmodules{}, 1,
                                                  c.causal ? ref::AttnMaskType::causal : ref::AttnMaskType::no_mask, p);
    std::map<std::string, Tensor> sd = {{"linear_qkv.weight", wqkv}, {"linear_proj.weight", wproj}};
    if (c.bias) {
      sd["linear_qkv.bias"] = bqkv;
      sd["linear_proj.bias"] = bproj;
    }
    a->load_state_dict(ref::StateDict(sd), "");
    return a;
  };
  const ref::DropoutRng attn_rng{77, 5}, bda_rng{77, 6};  // the layer's offsets + 0 and + 1
  ref::AttentionArgs args;
  args.s = c.s;
  args.b = c.b;
  args.rotary_pos_emb = c.rope != Rope::None ? &rope : nullptr;
  args.training = c.p > 0;
  args.rng = attn_rng;
  // The reference's forward in dt: the saved tensors both backwards start from.
  const ref::Mat xm = ref::to_mat(x, n, c.h, "x");
  const ref::Mat ln1 = make_norm(pr)->forward(xm);
  ref::SelfAttentionSaved saved;
  make_attn(pr)->forward(ln1, args, ref::Taps(), &saved);

  auto reference = [&](const ref::Precision& p) {
    RefGrads g;
    const ref::BiasDropoutAddGrads bda =
        ref::bias_dropout_add_backward(ref::to_mat(dh1, n, c.h, "dh1"), c.p, c.p > 0, bda_rng, p);
    const ref::AttentionGrads ag = make_attn(p)->backward(bda.x, saved, args);
    const ref::NormGrads ng = make_norm(p)->backward(ag.hidden_states, xm);
    g.dx = p.act(ng.input + bda.residual);  // autograd's sum of the two paths, stored
    g.d_ln1_w = ng.weight;
    g.d_ln1_b = ng.bias;
    for (const auto& pg : ag.params) {
      if (pg.name == "linear_qkv.weight") g.d_qkv_w = pg.mat();
      if (pg.name == "linear_qkv.bias") g.d_qkv_b = pg.mat();
      if (pg.name == "linear_proj.weight") g.d_proj_w = pg.mat();
      if (pg.name == "linear_proj.bias") g.d_proj_b = pg.mat();
    }
    return g;
  };
  const RefGrads rg = reference(pr), eg = reference(ex);

  // The saved q, k, v back in the fused linear_qkv layout [n, ng * (r + 2) * hn].
  ref::Mat qkv(n, qw);
  for (int t = 0; t < n; ++t)
    for (int g = 0; g < c.ng; ++g) {
      for (int i = 0; i < r; ++i) qkv.row(t).segment(g * gs + i * c.hn, c.hn) = saved.query.row(t * c.np + g * r + i);
      qkv.row(t).segment(g * gs + r * c.hn, c.hn) = saved.key.row(t * c.ng + g);
      qkv.row(t).segment(g * gs + (r + 1) * c.hn, c.hn) = saved.value.row(t * c.ng + g);
    }

  const std::size_t es = dtype_size(dt);
  auto dev = [&](const ref::Mat& m, Shape s) { return to_device(pr.to_tensor(m, std::move(s))); };
  auto d_x = to_device(x), d_ln1 = dev(ln1, {n, c.h}), d_qkv = dev(qkv, {n, qw}),
       d_ctx = dev(saved.linear_proj.input, {n, cw}), d_dh1 = to_device(dh1);
  auto d_lnw = to_device(ln_w), d_wqkv = to_device(wqkv), d_bqkv = to_device(bqkv), d_wproj = to_device(wproj);
  rt::DeviceBuffer d_freqs = rot ? to_device(rope) : rt::DeviceBuffer(sim(), 4);
  rt::DeviceBuffer stats(sim(), sizeof(float) * 2 * std::size_t(c.b) * c.np * c.s), ctx_again(sim(), n * cw * es);
  rt::DeviceBuffer g_x(sim(), n * c.h * es), g_lnw(sim(), c.h * es), g_lnb(sim(), c.h * es),
      g_wqkv(sim(), std::size_t(qw) * c.h * es), g_bqkv(sim(), qw * es), g_wproj(sim(), std::size_t(c.h) * cw * es),
      g_bproj(sim(), c.h * es), s_proj(sim(), n * c.h * es), s_ctx(sim(), n * cw * es), s_qkv(sim(), n * qw * es),
      s_ln1(sim(), n * c.h * es);

  opt::AttentionHalfBackward a;
  a.dt = dt;
  a.s = c.s;
  a.b = c.b;
  a.h = c.h;
  a.np = c.np;
  a.ng = c.ng;
  a.hn = c.hn;
  a.rms = c.rms;
  a.rot_dim = rot;
  a.rope_interleaved = c.rope == Rope::Interleaved;
  a.freqs = rot ? static_cast<const float*>(d_freqs.get()) : nullptr;
  opt::AttnParams& ap = a.attn;
  ap.sq = ap.sk = c.s;
  ap.b = c.b;
  ap.np_local = ap.np_total = c.np;
  ap.hn = c.hn;
  ap.alpha = static_cast<float>(1.0 / std::sqrt(double(c.hn)));
  ap.softmax_fp32 = true;  // attention_softmax_in_fp32 (the config's default)
  ap.mask = c.causal && c.s > 1 ? twin::opt::MaskMode::Causal : twin::opt::MaskMode::None;
  ap.drop = opt::DropoutArgs::make(c.p, c.p > 0, attn_rng.seed, attn_rng.offset);
  a.drop = opt::DropoutArgs::make(c.p, c.p > 0, bda_rng.seed, bda_rng.offset);
  // The forward's softmax statistics on the same q, k, v (its context is not used).
  {
    opt::AttnParams fp = ap;
    fp.softmax_stats = static_cast<float*>(stats.get());
    k::dot_product_attention_forward(dt, d_qkv.get(), a.layout(), ctx_again.get(), fp, nullptr);
  }
  a.x = d_x.get();
  a.ln1 = d_ln1.get();
  a.qkv = d_qkv.get();
  a.ctx = d_ctx.get();
  a.softmax_stats = static_cast<const float*>(stats.get());
  a.ln1_w = d_lnw.get();
  a.qkv_w = d_wqkv.get();
  a.qkv_b = c.bias ? d_bqkv.get() : nullptr;
  a.proj_w = d_wproj.get();
  a.proj_bias = c.bias;
  a.dh1 = d_dh1.get();
  a.dx = g_x.get();
  a.d_ln1_w = g_lnw.get();
  a.d_ln1_b = c.rms ? nullptr : g_lnb.get();
  a.d_qkv_w = g_wqkv.get();
  a.d_qkv_b = c.bias ? g_bqkv.get() : nullptr;
  a.d_proj_w = g_wproj.get();
  a.d_proj_b = c.bias ? g_bproj.get() : nullptr;
  a.d_proj = s_proj.get();
  a.d_ctx = s_ctx.get();
  a.d_qkv = s_qkv.get();
  a.d_ln1 = s_ln1.get();
  const std::size_t ws_bytes = k::attention_half_backward_workspace_bytes(a);
  rt::DeviceBuffer ws(sim(), std::max<std::size_t>(ws_bytes, 1));
  a.workspace = ws.get();
  a.workspace_bytes = ws_bytes;

  struct Out {
    std::string name;
    const rt::DeviceBuffer* buf;
    const ref::Mat* r;
    const ref::Mat* e;
    Shape shape;
  };
  std::vector<Out> outs = {{"dx", &g_x, &rg.dx, &eg.dx, {n, c.h}},
                           {"input_layernorm.weight", &g_lnw, &rg.d_ln1_w, &eg.d_ln1_w, {c.h}},
                           {"linear_qkv.weight", &g_wqkv, &rg.d_qkv_w, &eg.d_qkv_w, {qw, c.h}},
                           {"linear_proj.weight", &g_wproj, &rg.d_proj_w, &eg.d_proj_w, {c.h, cw}}};
  if (!c.rms) outs.push_back({"input_layernorm.bias", &g_lnb, &rg.d_ln1_b, &eg.d_ln1_b, {c.h}});
  if (c.bias) {
    outs.push_back({"linear_qkv.bias", &g_bqkv, &rg.d_qkv_b, &eg.d_qkv_b, {qw}});
    outs.push_back({"linear_proj.bias", &g_bproj, &rg.d_proj_b, &eg.d_proj_b, {c.h}});
  }
  k::attention_half_backward(a, nullptr);
  std::vector<Tensor> first;
  for (const Out& o : outs) first.push_back(from_device(*o.buf, dt, o.shape));
  k::attention_half_backward(a, nullptr);
  double worst_share = 0.0;
  for (std::size_t i = 0; i < outs.size(); ++i) {
    const Out& o = outs[i];
    const Tensor again = from_device(*o.buf, dt, o.shape);
    EXPECT_EQ(0, std::memcmp(first[i].raw(), again.raw(), first[i].nbytes()))
        << c.id() << " " << o.name << " differs between two runs";
    ASSERT_EQ(o.r->size(), first[i].numel()) << c.id() << " " << o.name;
    const Tensor expected = pr.to_tensor(*o.r, o.shape);
    const double ref_err = (*o.r - *o.e).cwiseAbs().maxCoeff();
    const Comparison cmp = compare(c.id() + " " + o.name, first[i], expected,
                                   parity::reference_error_bound(dt, ref_err, max_abs(expected)));
    worst_share = std::max(worst_share, cmp.share_used);
    EXPECT_TRUE(cmp.pass) << cmp.name << ": max abs " << cmp.max_abs << " at " << cmp.worst_index_str() << " actual "
                          << cmp.worst_actual << " expected " << cmp.worst_expected << " (" << cmp.tol.reason << ")";
  }
  std::printf("%s: max share of bound %.3f\n", c.id().c_str(), worst_share);
}

}  // namespace

TEST(OptimizedBackward, AttentionHalfMatchesReference) {
  const AttnCase cases[] = {
      // dtype, rms, bias, causal, rope, rot%, p, s, b, h, np, ng, hn
      {DType::F32, false, true, true, Rope::None, 1.0, 0.0, 6, 2, 32, 4, 4, 8},
      {DType::BF16, true, false, true, Rope::Halves, 1.0, 0.1, 7, 2, 32, 4, 2, 8},
      {DType::F16, false, true, false, Rope::Interleaved, 0.5, 0.0, 5, 3, 24, 4, 1, 8},
      {DType::F32, true, true, true, Rope::Halves, 0.5, 0.1, 9, 2, 32, 4, 2, 8},
      {DType::BF16, false, true, true, Rope::Halves, 1.0, 0.0, 40, 1, 32, 2, 2, 16},
      {DType::F16, true, false, true, Rope::None, 1.0, 0.1, 8, 2, 16, 2, 1, 8},
      {DType::F32, false, false, false, Rope::Interleaved, 1.0, 0.1, 33, 1, 16, 2, 1, 8},
  };
  for (const AttnCase& c : cases)
    if (selected(c.id())) run_case(c);
}

// What the attention half's backward refuses, each with its reason.
TEST(OptimizedBackward, AttentionHalfRefusesWhatItDoesNotCover) {
  EXPECT_EQ("", twin::opt::attention_half_backward_unsupported(false));
  EXPECT_NE(std::string::npos, twin::opt::attention_half_backward_unsupported(true).find("post_layernorm"));
  opt::AttentionHalfBackward a;
  a.post_ln_residual = true;
  try {
    k::attention_half_backward(a, nullptr);
    ADD_FAILURE() << "apply_residual_connection_post_layernorm was not refused";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string::npos, std::string(e.what()).find("post_layernorm")) << e.what();
  }
}
