// Every optimized kernel against the reference module it implements, on the CUDA simulator.
// One case = one canonical id ("norm(kind=rms,dtype=bf16,rows=7,width=96)"); a failure prints it
// and TWIN_OP_CASE=<id> reruns just that case. Bounds come from parity/bounds.h, each with its
// reason.
//
// Bit for bit where every rounding point is one IEEE operation (+, -, *, /) on values of T stored
// in T: the kernel rounds the operation to fp32 and then to T, the reference rounds it to double
// and then to T, and rounding twice gives the correctly rounded result whenever the first format
// has at least 2p + 2 bits for a second of p bits (Figueroa, "When is double rounding
// innocuous?", 1995): fp32's 24 >= 2 * 11 + 2 for fp16 (8 for bf16), double's 53 >= 2 * 24 + 2
// for fp32. So relu and squared_relu (with the bias add and the GLU product) and
// bias-dropout-add must equal the reference's bits. Not bit for bit, checked with op_bound: ops
// that call an fp32 math function (erff, expf, sinf, cosf are not correctly rounded; CUDA's carry
// up to 2 ulp) or evaluate in several fp32 operations what the reference rounds once (gelu's
// x * 0.5 * (1 + erf(x / sqrt 2)), quick_gelu's sigmoid): gelu, silu, quick_gelu, rope; and the
// norms and attention, whose fp32 reductions run in another order.
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <cmath>
#include <fmt/format.h>

#include "tests/case_id.h"
#include "optimized/activations.cuh"
#include "optimized/dot_product_attention.cuh"
#include "optimized/fused_bias_dropout.cuh"
#include "optimized/mla_rotary_pos_embedding.cuh"
#include "optimized/rotary_pos_embedding.cuh"
#include "optimized/torch_norm.cuh"
#include "optimized/runtime/cost_model.h"
#include "parity/bounds.h"
#include "reference/activations.h"
#include "reference/dot_product_attention.h"
#include "reference/fused_bias_dropout.h"
#include "reference/multi_latent_attention.h"
#include "reference/rotary_pos_embedding.h"
#include "reference/torch_norm.h"
#include "tests/optimized/op_test_util.h"

using namespace twin;
using namespace twin::test;
namespace k = twin::opt::sim;
namespace ref = twin::reference;
using parity::max_abs;

// ---- torch_norm.cuh -------------------------------------------------------------------------
TEST(OptimizedOps, NormMatchesReference) {
  const std::pair<int, int> shapes[] = {{5, 8}, {7, 96}, {3, 1500}};  // warp rows and block rows
  for (bool rms : {false, true})
    for (DType dt : kDtypes)
      for (auto [rows, width] : shapes) {
        const std::string id =
            fmt::format("norm(kind={},dtype={},rows={},width={})", rms ? "rms" : "ln", dt_name(dt), rows, width);
        if (!selected(id)) continue;
        const Tensor x = random_tensor(dt, {rows, width}, -2, 3, rows * 31 + width);  // mean far from 0 for LN
        const Tensor w = random_tensor(dt, {width}, 0.5, 1.5, 7), bias = random_tensor(dt, {width}, -0.5, 0.5, 8);
        auto dx = to_device(x), dw = to_device(w), db = to_device(bias);
        rt::DeviceBuffer dy(sim(), x.nbytes());
        k::norm_forward(rms, dt, dx.get(), dy.get(), dw.get(), rms ? nullptr : db.get(),
                        opt::NormRows::dense(rows, width), 1e-5, false, nullptr);
        const Tensor y = from_device(dy, dt, {rows, width});
        ref::StateDict sd({{"weight", w}, {"bias", bias}});
        std::unique_ptr<ref::Norm> norm;
        if (rms)
          norm = std::make_unique<ref::RMSNorm>(width, 1e-5, false, prec(dt));
        else
          norm = std::make_unique<ref::LayerNorm>(width, 1e-5, false, prec(dt));
        norm->load_state_dict(sd, "");
        const Tensor e = prec(dt).to_tensor(norm->forward(ref::to_mat(x, rows, width, "x")), {rows, width});
        // stores: LN 1 (output), RMS 2 (x * rstd, output); statistics are width-long fp32 sums.
        expect_pass(compare(id, y, e, parity::op_bound(dt, rms ? 2 : 1, width, max_abs(e))), id);
      }
}

TEST(OptimizedOps, NormOverStridedRowsEqualsDenseRowsBitwise) {
  // qk-layernorm normalises heads inside the fused qkv rows: [tokens, groups, (2 q + k + v) heads].
  const int tokens = 6, groups = 2, hpg = 2, hn = 16;
  const std::int64_t gs = (hpg + 2) * hn;
  for (DType dt : kDtypes) {
    const std::string id = fmt::format("norm_strided(dtype={})", dt_name(dt));
    if (!selected(id)) continue;
    const Tensor qkv = random_tensor(dt, {tokens, groups, gs}, -2, 2, 3);
    const Tensor w = random_tensor(dt, {hn}, 0.5, 1.5, 4), bias = random_tensor(dt, {hn}, -0.5, 0.5, 5);
    auto d = to_device(qkv), dw = to_device(w), db = to_device(bias);
    const opt::NormRows q_rows{std::int64_t(tokens) * groups * hpg, hn, hpg, gs, hn};
    k::norm_forward(false, dt, d.get(), d.get(), dw.get(), db.get(), q_rows, 1e-5, false, nullptr);  // in place
    const Tensor out = from_device(d, dt, {tokens, groups, gs});
    // The q heads, gathered densely, through the dense path; k and v untouched.
    const std::size_t es = dtype_size(dt);
    Tensor q = Tensor::empty(dt, {std::int64_t(tokens) * groups * hpg, hn});
    for (int t = 0; t < tokens * groups; ++t)
      std::memcpy(q.raw_mut() + t * hpg * hn * es, qkv.raw() + t * gs * es, hpg * hn * es);
    auto dq = to_device(q);
    k::norm_forward(false, dt, dq.get(), dq.get(), dw.get(), db.get(), opt::NormRows::dense(q.size(0), hn), 1e-5, false,
                    nullptr);
    const Tensor qn = from_device(dq, dt, q.shape());
    for (int t = 0; t < tokens * groups; ++t) {
      EXPECT_EQ(0, std::memcmp(out.raw() + t * gs * es, qn.raw() + t * hpg * hn * es, hpg * hn * es))
          << id << " token-group " << t;
      EXPECT_EQ(0, std::memcmp(out.raw() + (t * gs + hpg * hn) * es, qkv.raw() + (t * gs + hpg * hn) * es, 2 * hn * es))
          << id << " k/v of token-group " << t << " changed";
    }
  }
}

TEST(OptimizedOps, NormRejectsBadArguments) {
  auto x = to_device(random_tensor(DType::F32, {2, 4}, 0, 1, 1));
  EXPECT_THROW(k::norm_forward(true, DType::F32, x.get(), x.get(), nullptr, nullptr, opt::NormRows::dense(2, 4), 1e-5,
                               false, nullptr),
               std::invalid_argument);
  try {
    k::norm_forward(true, DType::I64, x.get(), x.get(), x.get(), nullptr, opt::NormRows::dense(2, 4), 1e-5, false,
                    nullptr);
    ADD_FAILURE() << "no error for an I64 norm";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("I64"), std::string::npos) << e.what();
  }
}

// ---- fused_bias_dropout.cuh -----------------------------------------------------------------
TEST(OptimizedOps, BiasDropoutAddEqualsReferenceBitwise) {
  for (DType dt : kDtypes)
    for (bool with_bias : {false, true})
      for (double p : {0.0, 0.1, 0.5})
        for (bool training : {false, true}) {
          const int n = 9, h = 24;
          const std::string id = fmt::format("bias_dropout_add(dtype={},bias={},p={},training={},n={},h={})",
                                             dt_name(dt), int(with_bias), p, int(training), n, h);
          if (!selected(id)) continue;
          const Tensor x = random_tensor(dt, {n, h}, -2, 2, 11), bias = random_tensor(dt, {h}, -1, 1, 12);
          const Tensor res = random_tensor(dt, {n, h}, -2, 2, 13);
          auto dx = to_device(x), db = to_device(bias), dr = to_device(res);
          rt::DeviceBuffer dout(sim(), x.nbytes());
          const auto drop = opt::DropoutArgs::make(p, training, 1234, 7);
          k::bias_dropout_add_forward(dt, dx.get(), with_bias ? db.get() : nullptr, dr.get(), dout.get(), n, h, drop, 0,
                                      nullptr);
          const Tensor y = from_device(dout, dt, {n, h});
          std::optional<ref::RowVec> rb;
          if (with_bias) rb = ref::to_rowvec(bias, "bias");
          const Tensor e =
              prec(dt).to_tensor(ref::bias_dropout_add(ref::to_mat(x, n, h, "x"), rb, ref::to_mat(res, n, h, "res"), p,
                                                       training, ref::DropoutRng{1234, 7}, prec(dt)),
                                 {n, h});
          // Same rounding points and the same Philox mask: the bits must agree.
          expect_pass(compare_exact(id, y, e), id);
        }
}

namespace {
// One dropout-mask case: n x h elements, probability p, Megatron's stream (seed, offset) and the
// first element's index in the whole tensor (a rank's slice of a bigger tensor). The mask is what
// is compared, in no stored dtype.
struct MaskCase : twin::proptest::PropertyCase {
  static constexpr const char* kKind = "dropout_mask";
  int n = 1, h = 1;
  double p = 0.1;
  std::uint64_t seed = 0, offset = 0, base = 0;
  template <class V>
  void fields(V& v) {
    v("n", n);
    v("h", h);
    v("p", p);
    v("seed", seed);
    v("offset", offset);
    v("base", base);
  }
};
}  // namespace

RC_GTEST_PROP(OptimizedOps, DropoutMasksOfBothTwinsAreIdentical, ()) {
  // x = 1, residual = 0, no bias: the output is the scaled mask itself.
  const MaskCase mc = *twin::proptest::rerunnable<MaskCase>(rc::gen::exec([] {
    MaskCase c;
    c.n = *rc::gen::inRange(1, 40);
    c.h = *rc::gen::inRange(1, 40);
    c.p = *rc::gen::element(0.1, 0.25, 0.5, 0.9);
    c.seed = *rc::gen::arbitrary<std::uint64_t>();
    c.offset = *rc::gen::inRange<std::uint64_t>(0, 1000);
    c.base = *rc::gen::inRange<std::uint64_t>(0, 1u << 20);
    return c;
  }));
  const int n = mc.n, h = mc.h;
  const double p = mc.p;
  const auto seed = mc.seed, offset = mc.offset, base = mc.base;
  const Tensor ones = Tensor::from_doubles(DType::F32, {n, h}, std::vector<double>(n * h, 1.0));
  const Tensor zeros = Tensor::zeros(DType::F32, {n, h});
  auto dx = to_device(ones), dr = to_device(zeros);
  rt::DeviceBuffer dout(sim(), ones.nbytes());
  k::bias_dropout_add_forward(DType::F32, dx.get(), nullptr, dr.get(), dout.get(), n, h,
                              opt::DropoutArgs::make(p, true, seed, offset), base, nullptr);
  const Tensor y = from_device(dout, DType::F32, {n, h});
  for (std::int64_t e = 0; e < n * h; ++e)
    RC_ASSERT((y.data<float>()[e] != 0.0f) == ref::dropout_keep(seed, offset, base + e, p));
}

// ---- activations.cuh ------------------------------------------------------------------------
TEST(OptimizedOps, BiasActivationMatchesReference) {
  const char* acts[] = {"gelu", "silu", "relu", "squared_relu", "quick_gelu"};
  for (DType dt : kDtypes)
    for (const char* act : acts)
      for (bool glu : {false, true})
        for (bool with_bias : {false, true}) {
          const int n = 6, f = 20, w = glu ? 2 * f : f;
          const std::string id = fmt::format("bias_activation(dtype={},act={},glu={},bias={},n={},f={})", dt_name(dt),
                                             act, int(glu), int(with_bias), n, f);
          if (!selected(id)) continue;
          const Tensor x = random_tensor(dt, {n, w}, -4, 4, 21), bias = random_tensor(dt, {w}, -1, 1, 22);
          auto dx = to_device(x), db = to_device(bias);
          rt::DeviceBuffer dy(sim(), std::size_t(n) * f * dtype_size(dt));
          k::bias_activation_forward(dt, dx.get(), with_bias ? db.get() : nullptr, dy.get(), n, f,
                                     twin::opt::act_from_name(act), glu, nullptr);
          const Tensor y = from_device(dy, dt, {n, f});
          // mlp.py: intermediate = fc1 + bias (stored), then act / glu.
          ref::Mat m = ref::to_mat(x, n, w, "x");
          if (with_bias) {
            m.rowwise() += ref::to_rowvec(bias, "bias");
            prec(dt).act_inplace(m);
          }
          const auto fn = ref::activation_from_name(act);
          const ref::Mat r =
              glu ? ref::glu(fn, m, 0.0, std::nullopt, prec(dt)) : ref::apply_activation(fn, m, prec(dt));
          const Tensor e = prec(dt).to_tensor(r, {n, f});
          const std::string name = act;
          if (name == "relu" || name == "squared_relu")  // IEEE operations only (see the top of the file)
            expect_pass(compare_exact(id, y, e), id);
          else  // stores: bias add, up to two inside the activation, the GLU product; no reduction.
            expect_pass(compare(id, y, e, parity::op_bound(dt, 4, 1, max_abs(e))), id);
        }
  EXPECT_THROW(twin::opt::act_from_name("tanh"), std::invalid_argument);
}

// ---- rotary_pos_embedding.cuh ---------------------------------------------------------------
TEST(OptimizedOps, RotaryPosEmbMatchesReference) {
  for (DType dt : kDtypes)
    for (bool interleaved : {false, true})
      for (double percent : {1.0, 0.5}) {
        const int s = 5, b = 2, heads = 3, hn = 8;
        const std::string id = fmt::format("rope(dtype={},interleaved={},rot={},s={},b={},heads={},hn={})", dt_name(dt),
                                           int(interleaved), percent, s, b, heads, hn);
        if (!selected(id)) continue;
        const ref::RotaryEmbedding emb(hn, percent, interleaved);
        const Tensor freqs = emb.forward(s);  // [s, 1, 1, rot]
        const int rot = emb.dim();
        const Tensor t = random_tensor(dt, {s, b, heads, hn}, -2, 2, 31);
        auto dt_ = to_device(t), df = to_device(freqs);
        k::rotary_pos_emb_forward(dt, dt_.get(), static_cast<const float*>(df.get()),
                                  opt::NormRows::dense(s * b * heads, hn), b * heads, rot, interleaved, nullptr);
        const Tensor y = from_device(dt_, dt, {s, b, heads, hn});
        const ref::Mat r = ref::apply_rotary_pos_emb(ref::to_mat(t, s * b * heads, hn, "t"),
                                                     ref::rotary_freqs(freqs, s, hn), b * heads, interleaved, prec(dt));
        const Tensor e = prec(dt).to_tensor(r, {s, b, heads, hn});
        // stores: cos/sin, the two products, the sum; cosf / sinf are not correctly rounded on a GPU,
        // so the bits may differ there (the simulator's glibc ones happen to agree).
        expect_pass(compare(id, y, e, parity::op_bound(dt, 4, 1, max_abs(e))), id);
      }
}

// ---- mla_rotary_pos_embedding.cuh -----------------------------------------------------------
// MLA's RoPE on the last pe channels of each head of a [s, b, heads, q_head] tensor (the rows
// addressed in place, the first qk channels untouched) against the reference's mla_rope.
TEST(OptimizedOps, MlaRotaryPosEmbMatchesReference) {
  for (DType dt : kDtypes)
    for (double percent : {1.0, 0.5})
      for (double mscale : {1.0, 1.2}) {
        const int s = 5, b = 2, heads = 3, qk = 4, pe = 8, qh = qk + pe, n = s * b * heads;
        const std::string id = fmt::format("mla_rope(dtype={},rot={},mscale={},s={},b={},heads={},pe={})", dt_name(dt),
                                           percent, mscale, s, b, heads, pe);
        if (!selected(id)) continue;
        const ref::RotaryEmbedding emb(pe, percent);
        const Tensor freqs = emb.forward(s);  // [s, 1, 1, rot]
        const int rot = emb.dim();
        const Tensor t = random_tensor(dt, {s, b, heads, qh}, -2, 2, 33);
        auto d_t = to_device(t), d_f = to_device(freqs);
        k::mla_rotary_pos_emb_forward(dt, static_cast<char*>(d_t.get()) + qk * dtype_size(dt),
                                      static_cast<const float*>(d_f.get()), opt::NormRows{n, pe, 1, qh, 0}, b * heads,
                                      rot, static_cast<float>(mscale), nullptr);
        const ref::Mat got = ref::to_mat(from_device(d_t, dt, {s, b, heads, qh}), n, qh, "got");
        const ref::Mat all = ref::to_mat(t, n, qh, "t");
        EXPECT_TRUE(got.leftCols(qk) == all.leftCols(qk)) << id << ": the no-pe channels changed";
        const ref::Mat r =
            ref::mla_rope(all.rightCols(pe), ref::rope_tables(ref::rotary_freqs(freqs, s, pe), prec(dt), mscale),
                          b * heads, prec(dt));
        const Tensor e = prec(dt).to_tensor(r, {n, pe});
        // stores: (cos/sin * mscale) in fp32 and in T, the two products, the sum
        expect_pass(compare(id, prec(dt).to_tensor(ref::Mat(got.rightCols(pe)), Shape{n, pe}), e,
                            parity::op_bound(dt, 5, 1, max_abs(e))),
                    id);
      }
}

// ---- dot_product_attention.cuh --------------------------------------------------------------
namespace {
struct AttnCase {
  DType dt;
  int s, b, np, ng, hn;
  std::string mask;  // none | causal | padding | arbitrary
  double dropout;
  std::string id() const {
    return fmt::format("attention(dtype={},s={},b={},np={},ng={},hn={},mask={},drop={})", dt_name(dt), s, b, np, ng, hn,
                       mask, dropout);
  }
};

void run_attention_case(const AttnCase& c) {
  const int hpg = c.np / c.ng, gs = (hpg + 2) * c.hn, ld = c.ng * gs;
  const Tensor qkv = random_tensor(c.dt, {c.s, c.b, ld}, -1.5, 1.5, c.s * 1000 + c.np * 10 + c.ng);
  // q [s, b, np, hn], k / v [s, b, ng, hn] out of the grouped rows, for the reference
  ref::Mat q(std::int64_t(c.s) * c.b * c.np, c.hn), kk(std::int64_t(c.s) * c.b * c.ng, c.hn),
      v(std::int64_t(c.s) * c.b * c.ng, c.hn);
  const ref::Mat all = ref::to_mat(qkv, std::int64_t(c.s) * c.b, ld, "qkv");
  for (int t = 0; t < c.s * c.b; ++t)
    for (int g = 0; g < c.ng; ++g) {
      for (int j = 0; j < hpg; ++j) q.row((t * c.ng + g) * hpg + j) = all.row(t).segment(g * gs + j * c.hn, c.hn);
      kk.row(t * c.ng + g) = all.row(t).segment(g * gs + hpg * c.hn, c.hn);
      v.row(t * c.ng + g) = all.row(t).segment(g * gs + (hpg + 1) * c.hn, c.hn);
    }
  Tensor mask;
  if (c.mask == "padding" || c.mask == "arbitrary") {
    std::mt19937_64 rng(c.s + 17);
    std::vector<bool> mv(std::size_t(c.b) * c.s * c.s);
    for (int bi = 0; bi < c.b; ++bi) {
      const int len = 1 + int(rng() % c.s);
      for (int i = 0; i < c.s; ++i)
        for (int j = 0; j < c.s; ++j)
          mv[(std::size_t(bi) * c.s + i) * c.s + j] =
              c.mask == "padding" ? j >= len : (i == 0 || rng() % 10 < 3);  // row 0 fully masked
    }
    mask = Tensor::from_vector<bool>({c.b, 1, c.s, c.s}, mv);
  }
  TransformerConfig cfg;
  cfg.hidden_size = c.np * c.hn;
  cfg.num_attention_heads = c.np;
  cfg.num_query_groups = c.ng;
  cfg.kv_channels = c.hn;
  cfg.bf16 = c.dt == DType::BF16;
  cfg.fp16 = c.dt == DType::F16;
  cfg.attention_dropout = c.dropout;
  const ref::AttnMaskType mt = c.mask == "causal" ? ref::AttnMaskType::causal
                               : c.mask == "none" ? ref::AttnMaskType::no_mask
                                                  : ref::AttnMaskType::padding;
  ref::DotProductAttention dpa(cfg, 1, mt, prec(c.dt));
  const bool training = c.dropout > 0;
  const ref::Mat r =
      dpa.forward(q, kk, v, c.s, c.s, c.b, mask.defined() ? &mask : nullptr, training, ref::DropoutRng{99, 3});
  const Tensor e = prec(c.dt).to_tensor(r, {c.s, c.b, std::int64_t(c.np) * c.hn});

  auto dqkv = to_device(qkv);
  rt::DeviceBuffer dmask = mask.defined() ? to_device(mask) : rt::DeviceBuffer();
  rt::DeviceBuffer dctx(sim(), e.nbytes());
  opt::AttnParams p;
  p.sq = p.sk = c.s;
  p.b = c.b;
  p.np_local = p.np_total = c.np;
  p.hn = c.hn;
  p.alpha = static_cast<float>(dpa.softmax_scale);
  p.mask = mask.defined() ? twin::opt::MaskMode::Explicit
                          : (c.mask == "causal" && c.s > 1 ? twin::opt::MaskMode::Causal : twin::opt::MaskMode::None);
  p.mask_ptr = static_cast<const std::uint8_t*>(dmask.get());
  p.mask_b = c.b;
  p.drop = opt::DropoutArgs::make(c.dropout, training, 99, 3);
  k::dot_product_attention_forward(c.dt, dqkv.get(), opt::QkvLayout{ld, gs, hpg}, dctx.get(), p, nullptr);
  const Tensor y = from_device(dctx, c.dt, e.shape());
  // context = sum_j p_j v_j: each p_j is stored in T after an fp32 softmax (one store, possibly an
  // ulp apart: 2u), a score stored in T one ulp apart moves exp(s - m) by a factor 1 + 2u|s|, the
  // fp32 sums are s long; all scale with max|v| (times 1/(1-p) under dropout).
  double max_score = 0;
  for (Eigen::Index i = 0; i < q.rows(); ++i)
    for (Eigen::Index j = 0; j < kk.rows(); ++j)
      max_score = std::max(max_score, std::fabs(q.row(i).dot(kk.row(j))) * dpa.softmax_scale);
  const double vmax = max_abs(qkv) / (1.0 - c.dropout);
  Tolerance tol = parity::op_bound(c.dt, 2, std::max(c.s, c.hn), vmax);
  tol.atol += 2.0 * unit_roundoff(c.dt) * max_score * vmax;
  tol.reason += fmt::format(" + score flips 2u x max|score| {:.3g} x max|v|", max_score);
  expect_pass(compare(c.id(), y, e, tol), c.id());
}
}  // namespace

TEST(OptimizedOps, AttentionMatchesReference) {
  for (DType dt : kDtypes)
    for (const char* mask : {"none", "causal", "padding", "arbitrary"})
      for (auto [s, np, ng, hn] :
           {std::tuple{1, 2, 2, 8}, std::tuple{5, 4, 2, 8}, std::tuple{37, 4, 1, 40}, std::tuple{20, 2, 2, 16}}) {
        const AttnCase c{dt, s, 2, np, ng, hn, mask, 0.0};
        if (selected(c.id())) run_attention_case(c);
      }
}

// The tensor-core kernel (bf16 / fp16): the head dims of Megatron's models, one zero-padded to a
// multiple of 16 (24; AttentionMatchesReference's 8 and 40 are too), GQA, several query and key
// tiles (s = 70 > 64 rows and keys per tile), every mask.
TEST(OptimizedOps, AttentionOnTensorCoresMatchesReference) {
  for (DType dt : {DType::BF16, DType::F16})
    for (const char* mask : {"none", "causal", "padding", "arbitrary"})
      for (auto [s, np, ng, hn] :
           {std::tuple{70, 4, 2, 64}, std::tuple{33, 2, 1, 128}, std::tuple{20, 2, 2, 256}, std::tuple{9, 3, 3, 24}}) {
        const AttnCase c{dt, s, 2, np, ng, hn, mask, 0.0};
        if (selected(c.id())) run_attention_case(c);
      }
  for (DType dt : {DType::BF16, DType::F16}) {
    const AttnCase c{dt, 67, 2, 4, 2, 32, "causal", 0.3};
    if (selected(c.id())) run_attention_case(c);
  }
}

// One supports function chooses: WMMA for 16-bit inputs and head dims up to 256, the CUDA-core
// kernel for fp32; the kernel launched is the one it names.
TEST(OptimizedOps, AttentionChoosesTensorCoresWhereWmmaCoversThem) {
  EXPECT_TRUE(k::attention_wmma_supports(DType::BF16, 64));
  EXPECT_TRUE(k::attention_wmma_supports(DType::F16, 256));
  EXPECT_TRUE(k::attention_wmma_supports(DType::BF16, 16));
  EXPECT_FALSE(k::attention_wmma_supports(DType::F32, 64));
  EXPECT_TRUE(k::attention_wmma_supports(DType::BF16, 40));  // zero-padded to 48
  EXPECT_FALSE(k::attention_wmma_supports(DType::F32, 40));
  EXPECT_FALSE(k::attention_wmma_supports(DType::F16, 272));
  for (auto [dt, hn] :
       {std::pair{DType::BF16, 64}, std::pair{DType::F32, 64}, std::pair{DType::F16, 40}, std::pair{DType::F32, 8}}) {
    const int s = 3, b = 1, np = 2, ld = np * 3 * hn;
    rt::DeviceBuffer qkv(sim(), std::size_t(s) * b * ld * dtype_size(dt)), ctx(sim(), std::size_t(s) * b * np * hn * 4);
    qkv.zero();
    opt::AttnParams p;
    p.sq = p.sk = s;
    p.b = b;
    p.np_local = p.np_total = np;
    p.hn = hn;
    rt::CostScope scope;
    k::dot_product_attention_forward(dt, qkv.get(), opt::QkvLayout{ld, 3 * hn, 1}, ctx.get(), p, nullptr);
    ASSERT_EQ(scope.kernel_launches().size(), 1u);
    const bool wmma = scope.kernel_launches()[0].first.find("wmma") != std::string::npos;
    EXPECT_EQ(wmma, k::attention_wmma_supports(dt, hn)) << scope.kernel_launches()[0].first;
  }
}

TEST(OptimizedOps, AttentionDropoutMatchesReference) {
  for (DType dt : kDtypes)
    for (const char* mask : {"causal", "arbitrary"}) {
      const AttnCase c{dt, 19, 2, 4, 2, 8, mask, 0.3};
      if (selected(c.id())) run_attention_case(c);
    }
}

TEST(OptimizedOps, AttentionRejectsBadArguments) {
  opt::AttnParams p;
  p.sq = p.sk = 4;
  p.b = 1;
  p.np_local = p.np_total = 2;
  p.hn = 300;
  rt::DeviceBuffer d(sim(), 4096);
  try {
    k::dot_product_attention_forward(DType::F32, d.get(), opt::QkvLayout{1, 1, 1}, d.get(), p, nullptr);
    ADD_FAILURE() << "no error for head dim 300";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("head dim 300"), std::string::npos) << e.what();
  }
  p.hn = 8;
  p.mask = twin::opt::MaskMode::Causal;
  p.sk = 5;
  EXPECT_THROW(k::dot_product_attention_forward(DType::F32, d.get(), opt::QkvLayout{32, 32, 2}, d.get(), p, nullptr),
               std::invalid_argument);
}
