// Every optimized backward kernel against the reference's backward function of its op, on the CUDA
// simulator, as test_ops.cpp does for the forwards: one case = one canonical id
// ("norm_backward(kind=rms,dtype=bf16,rows=7,width=96,zcg=0)"); a failure prints it and
// TWIN_OP_CASE=<id> reruns just that case.
//
// Bounds: each launcher counts its rounding points (stores and fp32 reduction lengths) as the
// reference's backward counts them; the bound is parity::op_bound over that count (every counted
// store, fp32 ones included, taken as a store of the output dtype: u of fp32 is the smallest), times
// the magnitude the error follows (the terms before they cancel, not the result). Bit for bit
// where every rounding point is one IEEE operation on stored values (Figueroa's double-rounding
// argument, see test_ops.cpp): relu / squared_relu backward (with the GLU products) and dropout's
// backward. Every launcher also runs twice on the same inputs with bitwise equal results (the
// parameter grads' row reductions have a fixed order).
#include <gtest/gtest.h>

#include <cmath>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fmt/format.h>
#include <functional>
#include <random>

#include "core/config.h"
#include "core/rounding.h"
#include "optimized/activations.cuh"
#include "optimized/dot_product_attention.cuh"
#include "optimized/fused_bias_dropout.cuh"
#include "optimized/linear.cuh"
#include "optimized/mla_rotary_pos_embedding.cuh"
#include "optimized/rotary_pos_embedding.cuh"
#include "optimized/torch_norm.cuh"
#include "parity/bounds.h"
#include "reference/activations.h"
#include "reference/dot_product_attention.h"
#include "reference/fused_bias_dropout.h"
#include "reference/linear.h"
#include "reference/multi_latent_attention.h"
#include "reference/rotary_pos_embedding.h"
#include "reference/torch_norm.h"
#include "tests/optimized/op_test_util.h"

using namespace twin;
using namespace twin::test;
namespace k = twin::opt::sim;
namespace ref = twin::reference;
using parity::max_abs;

namespace {

// The rounding points `launch` counts, from zero.
RoundingCount counted(const std::function<void()>& launch) {
  CountRoundings scope;
  rounding_set({});
  launch();
  return rounding_now();
}

// op_bound over a launcher's count: each counted store may land one ulp of the output dtype apart
// (fp32 stores counted as such: an upper bound), each counted fp32 reduction 2 gamma_R apart.
Tolerance counted_bound(DType dt, const RoundingCount& r, double magnitude, int extra_stores = 0) {
  return parity::op_bound(dt, r.bf16 + r.fp16 + r.fp32 + extra_stores, std::max<std::int64_t>(r.reduction, 1),
                          magnitude);
}

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

}  // namespace

// ---- torch_norm.cuh -------------------------------------------------------------------------
namespace {
// One norm backward case: rows x width, zero-centred gamma or not.
void run_norm_case(bool rms, DType dt, int rows, int width, bool zcg) {
  const std::string id = fmt::format("norm_backward(kind={},dtype={},rows={},width={},zcg={})", rms ? "rms" : "ln",
                                     dt_name(dt), rows, width, int(zcg));
  if (!selected(id)) return;
  const Tensor x = random_tensor(dt, {rows, width}, -2, 3, rows * 31 + width);  // mean far from 0 for LN
  const Tensor dy = random_tensor(dt, {rows, width}, -1, 1, rows * 7 + width);
  const Tensor w = random_tensor(dt, {width}, zcg ? -0.5 : 0.5, zcg ? 0.5 : 1.5, 7);
  auto d_x = to_device(x), d_dy = to_device(dy), d_w = to_device(w);
  rt::DeviceBuffer d_dx(sim(), x.nbytes()), d_dw(sim(), w.nbytes()), d_db(sim(), w.nbytes());
  const std::size_t ws_bytes = k::norm_backward_workspace_bytes(rms, rows, width);
  rt::DeviceBuffer ws(sim(), ws_bytes);
  auto run = [&] {
    k::norm_backward(rms, dt, d_dy.get(), d_x.get(), d_dx.get(), d_w.get(), d_dw.get(), rms ? nullptr : d_db.get(),
                     opt::NormRows::dense(rows, width), 1e-5, zcg, ws.get(), ws_bytes, nullptr);
  };
  const RoundingCount count = counted(run);
  const Tensor dx = from_device(d_dx, dt, {rows, width}), dw = from_device(d_dw, dt, {width}),
               db = from_device(d_db, dt, {width});
  run();
  EXPECT_TRUE(same_bits(dx, from_device(d_dx, dt, {rows, width}))) << id << ": dx differs between two runs";
  EXPECT_TRUE(same_bits(dw, from_device(d_dw, dt, {width}))) << id << ": dweight differs between two runs";
  if (!rms) {
    EXPECT_TRUE(same_bits(db, from_device(d_db, dt, {width}))) << id << ": dbias differs between two runs";
  }

  std::unique_ptr<ref::Norm> norm;
  if (rms)
    norm = std::make_unique<ref::RMSNorm>(width, 1e-5, zcg, prec(dt));
  else
    norm = std::make_unique<ref::LayerNorm>(width, 1e-5, zcg, prec(dt));
  ref::StateDict sd({{"weight", w}, {"bias", Tensor::zeros(dt, {width})}});
  norm->load_state_dict(sd, "");
  const ref::Mat xm = ref::to_mat(x, rows, width, "x"), dym = ref::to_mat(dy, rows, width, "dy");
  const ref::NormGrads g = norm->backward(dym, xm);
  // dx's error follows its terms before they cancel, per row (exact statistics suffice for a
  // magnitude): LayerNorm rstd (|dxhat| + mean|dxhat| + |xhat| mean|dxhat xhat|), RMSNorm
  // rstd |dxhat| + |x| rstd^3 mean|dxhat x|; dxhat = dy gamma.
  double mag_dx = 0.0;
  for (int r = 0; r < rows; ++r) {
    const double mean = rms ? 0.0 : xm.row(r).mean();
    const double ms = (xm.row(r).array() - mean).square().mean();
    const double rstd = 1.0 / std::sqrt(ms + 1e-5);
    double m1 = 0.0, m2 = 0.0;
    for (int c = 0; c < width; ++c) {
      const double gamma = w.at_f64(c) + (zcg ? 1.0 : 0.0), dxhat = std::fabs(dym(r, c) * gamma);
      m1 += dxhat / width;
      m2 += dxhat * std::fabs(rms ? xm(r, c) : (xm(r, c) - mean) * rstd) / width;
    }
    for (int c = 0; c < width; ++c) {
      const double gamma = w.at_f64(c) + (zcg ? 1.0 : 0.0), dxhat = std::fabs(dym(r, c) * gamma);
      mag_dx = std::max(mag_dx, rms ? rstd * dxhat + std::fabs(xm(r, c)) * rstd * rstd * rstd * m2
                                    : rstd * (dxhat + m1 + std::fabs(xm(r, c) - mean) * rstd * m2));
    }
  }
  const ref::Precision p = prec(dt);
  expect_pass(compare(id + " dx", dx, p.to_tensor(g.input, {rows, width}), counted_bound(dt, count, mag_dx)), id);
  // dgamma / dbeta: fp32 column sums of n_rows terms, each term's error relative to |term|:
  // the reference's magnitudes sum_rows |dy x_hat| and sum_rows |dy|.
  expect_pass(
      compare(id + " dweight", dw, p.to_tensor(g.weight, {width}), counted_bound(dt, count, g.weight_magnitude)), id);
  if (!rms)
    expect_pass(compare(id + " dbias", db, p.to_tensor(g.bias, {width}), counted_bound(dt, count, g.bias_magnitude)),
                id);
}
}  // namespace

TEST(OptimizedBackward, NormMatchesReference) {
  // warp rows, block rows, and more rows than one column-sum chunk (256)
  const std::tuple<int, int, bool> shapes[] = {{5, 8, false}, {7, 96, true}, {3, 1500, false}, {300, 40, false}};
  for (bool rms : {false, true})
    for (DType dt : kDtypes)
      for (auto [rows, width, zcg] : shapes) run_norm_case(rms, dt, rows, width, zcg);
}

TEST(OptimizedBackward, NormMatchesReferenceOnRandomShapes) {
  // Shapes off every power of two: partial warps and blocks of warp rows, widths around the warp /
  // block switch (1024), rows across column-sum chunk boundaries. Fixed seed: the same cases each run.
  std::mt19937_64 rng(20261203);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  for (int i = 0; i < 24; ++i) {
    const bool rms = pick(0, 1), zcg = pick(0, 3) == 0;
    const DType dt = kDtypes[pick(0, 2)];
    const int width = pick(0, 3) == 0 ? pick(1000, 1100) : pick(1, 200);
    const int rows = pick(0, 3) == 0 ? pick(250, 530) : pick(1, 20);
    run_norm_case(rms, dt, rows, width, zcg);
  }
}

TEST(OptimizedBackward, NormOverStridedRowsEqualsDenseRowsBitwise) {
  // qk-layernorm's heads inside the fused qkv rows: [tokens, groups, (hpg + 2) heads]; the q heads
  // as strided rows give the bits of the same heads gathered densely.
  const int tokens = 6, groups = 2, hpg = 2, hn = 16;
  const std::int64_t gs = (hpg + 2) * hn, n_q = std::int64_t(tokens) * groups * hpg;
  for (bool rms : {false, true})
    for (DType dt : kDtypes) {
      const std::string id = fmt::format("norm_backward_strided(kind={},dtype={})", rms ? "rms" : "ln", dt_name(dt));
      if (!selected(id)) continue;
      const Tensor qkv = random_tensor(dt, {tokens, groups, gs}, -2, 2, 3);
      const Tensor dqkv = random_tensor(dt, {tokens, groups, gs}, -1, 1, 4);
      const Tensor w = random_tensor(dt, {hn}, 0.5, 1.5, 5);
      const std::size_t es = dtype_size(dt);
      auto gather = [&](const Tensor& t) {
        Tensor q = Tensor::empty(dt, {n_q, hn});
        for (int i = 0; i < tokens * groups; ++i)
          std::memcpy(q.raw_mut() + i * hpg * hn * es, t.raw() + i * gs * es, hpg * hn * es);
        return q;
      };
      auto d_x = to_device(qkv), d_dy = to_device(dqkv), d_w = to_device(w);
      rt::DeviceBuffer d_dx(sim(), qkv.nbytes()), d_dw(sim(), w.nbytes()), d_db(sim(), w.nbytes());
      const std::size_t ws_bytes = k::norm_backward_workspace_bytes(rms, n_q, hn);
      rt::DeviceBuffer ws(sim(), ws_bytes);
      k::norm_backward(rms, dt, d_dy.get(), d_x.get(), d_dx.get(), d_w.get(), d_dw.get(), rms ? nullptr : d_db.get(),
                       opt::NormRows{n_q, hn, hpg, gs, hn}, 1e-5, false, ws.get(), ws_bytes, nullptr);
      const Tensor dx_strided = gather(from_device(d_dx, dt, qkv.shape()));
      const Tensor dw_strided = from_device(d_dw, dt, {hn}), db_strided = from_device(d_db, dt, {hn});
      auto q_x = to_device(gather(qkv)), q_dy = to_device(gather(dqkv));
      rt::DeviceBuffer q_dx(sim(), std::size_t(n_q) * hn * es);
      k::norm_backward(rms, dt, q_dy.get(), q_x.get(), q_dx.get(), d_w.get(), d_dw.get(), rms ? nullptr : d_db.get(),
                       opt::NormRows::dense(n_q, hn), 1e-5, false, ws.get(), ws_bytes, nullptr);
      EXPECT_TRUE(same_bits(dx_strided, from_device(q_dx, dt, {n_q, hn}))) << id << ": dx";
      EXPECT_TRUE(same_bits(dw_strided, from_device(d_dw, dt, {hn}))) << id << ": dweight";
      if (!rms) {
        EXPECT_TRUE(same_bits(db_strided, from_device(d_db, dt, {hn}))) << id << ": dbias";
      }
    }
}

TEST(OptimizedBackward, NormRejectsBadArguments) {
  const std::size_t ws_bytes = k::norm_backward_workspace_bytes(false, 2, 4);
  rt::DeviceBuffer a(sim(), 64), b(sim(), 64), c(sim(), 64), w(sim(), 16), dw(sim(), 16), ws(sim(), ws_bytes);
  const auto rows = opt::NormRows::dense(2, 4);
  auto call = [&](void* dx, void* dbias, void* workspace, std::size_t bytes, bool rms = false) {
    k::norm_backward(rms, DType::F32, a.get(), b.get(), dx, w.get(), dw.get(), dbias, rows, 1e-5, false, workspace,
                     bytes, nullptr);
  };
  EXPECT_NO_THROW(call(c.get(), nullptr, ws.get(), ws_bytes));
  EXPECT_THROW(call(a.get(), nullptr, ws.get(), ws_bytes), std::invalid_argument);  // dx aliases dy
  EXPECT_THROW(call(c.get(), nullptr, nullptr, 0), std::invalid_argument);          // no workspace
  EXPECT_THROW(call(c.get(), nullptr, ws.get(), ws_bytes - 4), std::invalid_argument);
  EXPECT_THROW(call(c.get(), dw.get(), ws.get(), ws_bytes, true), std::invalid_argument);  // RMSNorm has no bias
}

// ---- activations.cuh ------------------------------------------------------------------------
TEST(OptimizedBackward, BiasActivationMatchesReference) {
  const char* acts[] = {"gelu", "silu", "relu", "squared_relu", "quick_gelu"};
  for (DType dt : kDtypes)
    for (const char* act : acts)
      for (bool glu : {false, true})
        for (bool with_bias : {false, true}) {
          const int n = 6, f = 20, w = glu ? 2 * f : f;
          const std::string id = fmt::format("bias_activation_backward(dtype={},act={},glu={},bias={},n={},f={})",
                                             dt_name(dt), act, int(glu), int(with_bias), n, f);
          if (!selected(id)) continue;
          const Tensor x = random_tensor(dt, {n, w}, -4, 4, 21), bias = random_tensor(dt, {w}, -1, 1, 22);
          const Tensor dy = random_tensor(dt, {n, f}, -2, 2, 23);
          auto d_x = to_device(x), d_b = to_device(bias), d_dy = to_device(dy);
          rt::DeviceBuffer d_dx(sim(), x.nbytes());
          auto run = [&] {
            k::bias_activation_backward(dt, d_x.get(), with_bias ? d_b.get() : nullptr, d_dy.get(), d_dx.get(), n, f,
                                        twin::opt::act_from_name(act), glu, nullptr);
          };
          const RoundingCount count = counted(run);
          const Tensor dx = from_device(d_dx, dt, {n, w});
          run();
          EXPECT_TRUE(same_bits(dx, from_device(d_dx, dt, {n, w}))) << id << ": differs between two runs";
          // mlp.py: intermediate = fc1 + bias (stored), then act / glu; the reference's backward of those.
          ref::Mat m = ref::to_mat(x, n, w, "x");
          if (with_bias) {
            m.rowwise() += ref::to_rowvec(bias, "bias");
            prec(dt).act_inplace(m);
          }
          const auto fn = ref::activation_from_name(act);
          const ref::Mat dym = ref::to_mat(dy, n, f, "dy");
          const ref::Mat r = glu ? ref::glu_backward(fn, m, dym, 0.0, std::nullopt, prec(dt))
                                 : ref::activation_backward(fn, m, dym, prec(dt));
          const Tensor e = prec(dt).to_tensor(r, {n, w});
          const std::string name = act;
          if (name == "relu" || name == "squared_relu")  // IEEE operations only (see the top of the file)
            expect_pass(compare_exact(id, dx, e), id);
          else  // no reduction; the fp32 erff / expf and the multi-op fp32 evaluations land within a store
            expect_pass(compare(id, dx, e, counted_bound(dt, count, max_abs(e))), id);
        }
}

TEST(OptimizedBackward, BiasActivationRejectsBadArguments) {
  rt::DeviceBuffer a(sim(), 256), b(sim(), 256);
  EXPECT_THROW(k::bias_activation_backward(DType::F32, a.get(), nullptr, b.get(), b.get(), 2, 4, twin::opt::Act::Gelu,
                                           true, nullptr),
               std::invalid_argument);  // GLU: din aliasing dy
  EXPECT_THROW(k::bias_activation_backward(DType::F32, a.get(), nullptr, nullptr, b.get(), 2, 4, twin::opt::Act::Gelu,
                                           false, nullptr),
               std::invalid_argument);
  EXPECT_NO_THROW(k::bias_activation_backward(DType::F32, a.get(), nullptr, b.get(), a.get(), 2, 4,
                                              twin::opt::Act::Gelu, true,
                                              nullptr));  // in place on fc1's output
}

// ---- fused_bias_dropout.cuh -----------------------------------------------------------------
TEST(OptimizedBackward, BiasDropoutAddMatchesReference) {
  for (DType dt : kDtypes)
    for (double p : {0.0, 0.1, 0.5})
      for (bool training : {false, true})
        for (int n : {9, 300}) {
          const int h = 24;
          const std::string id = fmt::format("bias_dropout_add_backward(dtype={},p={},training={},n={},h={})",
                                             dt_name(dt), p, int(training), n, h);
          if (!selected(id)) continue;
          const Tensor dout = random_tensor(dt, {n, h}, -2, 2, 41);
          auto d_dout = to_device(dout);
          rt::DeviceBuffer d_dx(sim(), dout.nbytes()), d_dres(sim(), dout.nbytes()), d_db(sim(), h * dtype_size(dt));
          const std::size_t ws_bytes = k::bias_dropout_add_backward_workspace_bytes(n, h);
          rt::DeviceBuffer ws(sim(), ws_bytes);
          const auto drop = opt::DropoutArgs::make(p, training, 1234, 7);
          auto run = [&](bool with_bias) {
            k::bias_dropout_add_backward(dt, d_dout.get(), d_dx.get(), d_dres.get(), with_bias ? d_db.get() : nullptr,
                                         n, h, drop, 0, ws.get(), ws_bytes, nullptr);
          };
          const RoundingCount dx_count = counted([&] { run(false); });
          const RoundingCount db_count = counted([&] { run(true); });
          const Tensor dx = from_device(d_dx, dt, {n, h}), dres = from_device(d_dres, dt, {n, h}),
                       db = from_device(d_db, dt, {h});
          run(true);
          EXPECT_TRUE(same_bits(dx, from_device(d_dx, dt, {n, h}))) << id << ": dx differs between two runs";
          EXPECT_TRUE(same_bits(db, from_device(d_db, dt, {h}))) << id << ": dbias differs between two runs";
          const ref::BiasDropoutAddGrads g = ref::bias_dropout_add_backward(
              ref::to_mat(dout, n, h, "dout"), p, training, ref::DropoutRng{1234, 7}, prec(dt));
          // Same rounding points and the same Philox mask: the bits must agree.
          expect_pass(compare_exact(id + " dx", dx, prec(dt).to_tensor(g.x, {n, h})), id);
          expect_pass(compare_exact(id + " dresidual", dres, prec(dt).to_tensor(g.residual, {n, h})), id);
          EXPECT_EQ(dx_count.reduction, 0) << id;
          // d bias: the reference's linear (the bias's owner) sums d x over the rows.
          ref::Linear owner(1, h, true, true, prec(dt));
          const ref::LinearGrads lg = owner.backward(g.x, ref::LinearSaved{ref::Mat::Zero(n, 1)});
          expect_pass(compare(id + " dbias", db, prec(dt).to_tensor(lg.bias, {h}),
                              counted_bound(dt, db_count, lg.bias_magnitude)),
                      id);
        }
}

TEST(OptimizedBackward, DropoutMaskOfBackwardIsTheForwardsAtAnyElementBase) {
  // A rank's slice (element_base > 0): dout = 1 through the backward keeps exactly the elements
  // the forward kept (x = 1, residual = 0 makes the forward's output the scaled mask).
  const int n = 13, h = 17;
  for (std::uint64_t base : {std::uint64_t(0), std::uint64_t(5), std::uint64_t(1) << 33}) {
    const Tensor ones = Tensor::from_doubles(DType::F32, {n, h}, std::vector<double>(n * h, 1.0));
    auto d_ones = to_device(ones), d_zero = to_device(Tensor::zeros(DType::F32, {n, h}));
    rt::DeviceBuffer fwd(sim(), ones.nbytes()), bwd(sim(), ones.nbytes());
    const auto drop = opt::DropoutArgs::make(0.3, true, 99, 11);
    k::bias_dropout_add_forward(DType::F32, d_ones.get(), nullptr, d_zero.get(), fwd.get(), n, h, drop, base, nullptr);
    k::bias_dropout_add_backward(DType::F32, d_ones.get(), bwd.get(), nullptr, nullptr, n, h, drop, base, nullptr, 0,
                                 nullptr);
    const Tensor a = from_device(fwd, DType::F32, {n, h}), b = from_device(bwd, DType::F32, {n, h});
    EXPECT_TRUE(same_bits(a, b)) << "element_base " << base;
    int kept = 0;
    for (int e = 0; e < n * h; ++e) kept += a.data<float>()[e] != 0.0f;
    EXPECT_GT(kept, 0);
    EXPECT_LT(kept, n * h);
  }
}

// ---- rotary_pos_embedding.cuh ---------------------------------------------------------------
TEST(OptimizedBackward, RotaryPosEmbMatchesReference) {
  for (DType dt : kDtypes)
    for (bool interleaved : {false, true})
      for (double percent : {1.0, 0.5}) {
        const int s = 5, b = 2, heads = 3, hn = 8;
        const std::string id = fmt::format("rope_backward(dtype={},interleaved={},rot={},s={},b={},heads={},hn={})",
                                           dt_name(dt), int(interleaved), percent, s, b, heads, hn);
        if (!selected(id)) continue;
        const ref::RotaryEmbedding emb(hn, percent, interleaved);
        const Tensor freqs = emb.forward(s);  // [s, 1, 1, rot]
        const int rot = emb.dim();
        const Tensor dout = random_tensor(dt, {s, b, heads, hn}, -2, 2, 51);
        auto d_t = to_device(dout), d_f = to_device(freqs);
        auto run = [&] {
          k::rotary_pos_emb_backward(dt, d_t.get(), static_cast<const float*>(d_f.get()),
                                     opt::NormRows::dense(s * b * heads, hn), b * heads, rot, interleaved, nullptr);
        };
        const RoundingCount count = counted(run);
        const Tensor dt_ = from_device(d_t, dt, {s, b, heads, hn});
        d_t.upload(dout.raw(), dout.nbytes());
        run();
        EXPECT_TRUE(same_bits(dt_, from_device(d_t, dt, {s, b, heads, hn}))) << id << ": differs between two runs";
        const ref::Mat r =
            ref::apply_rotary_pos_emb_backward(ref::to_mat(dout, s * b * heads, hn, "dout"),
                                               ref::rotary_freqs(freqs, s, hn), b * heads, interleaved, prec(dt));
        const Tensor e = prec(dt).to_tensor(r, {s, b, heads, hn});
        // Beside the counted stores, the cos/sin tables (fp32 cosf / sinf stored in T, the same
        // table the forward uses) may land one ulp apart: one more store. dt = dout cos + dout' sin
        // cancels: its terms are at most |dout| each (|cos|, |sin| <= 1), so the magnitude is 2 max|dout|.
        expect_pass(compare(id, dt_, e, counted_bound(dt, count, 2.0 * max_abs(dout), 1)), id);
      }
}

// ---- mla_rotary_pos_embedding.cuh -----------------------------------------------------------
TEST(OptimizedBackward, MlaRotaryPosEmbMatchesReference) {
  for (DType dt : kDtypes)
    for (double percent : {1.0, 0.5})
      for (double mscale : {1.0, 1.2}) {
        const int s = 5, b = 2, heads = 3, pe = 8, n = s * b * heads;
        const std::string id = fmt::format("mla_rope_backward(dtype={},rot={},mscale={},s={},b={},heads={},pe={})",
                                           dt_name(dt), percent, mscale, s, b, heads, pe);
        if (!selected(id)) continue;
        const ref::RotaryEmbedding emb(pe, percent);
        const Tensor freqs = emb.forward(s);  // [s, 1, 1, rot]
        const int rot = emb.dim();
        const Tensor dout = random_tensor(dt, {s, b, heads, pe}, -2, 2, 53);
        auto d_t = to_device(dout), d_f = to_device(freqs);
        auto run = [&] {
          k::mla_rotary_pos_emb_backward(dt, d_t.get(), static_cast<const float*>(d_f.get()),
                                         opt::NormRows::dense(n, pe), b * heads, rot, static_cast<float>(mscale),
                                         nullptr);
        };
        const RoundingCount count = counted(run);
        const Tensor got = from_device(d_t, dt, {s, b, heads, pe});
        const ref::Mat r = ref::mla_rope_backward(ref::to_mat(dout, n, pe, "dout"), ref::rotary_freqs(freqs, s, pe),
                                                  mscale, b * heads, prec(dt));
        const Tensor e = prec(dt).to_tensor(r, {s, b, heads, pe});
        // Beside the counted stores, the cos/sin tables (fp32 cosf / sinf times mscale, stored in T)
        // may land one ulp apart: one more store; the terms are at most mscale |dout| each.
        expect_pass(compare(id, got, e, counted_bound(dt, count, 2.0 * mscale * max_abs(dout), 1)), id);
      }
}

// ---- linear.cuh -----------------------------------------------------------------------------
TEST(OptimizedBackward, LinearGradsMatchReference) {
  const std::tuple<int, int, int> shapes[] = {{37, 24, 40}, {300, 16, 8}, {0, 8, 12}};  // rows, in, out
  for (DType dt : kDtypes)
    for (auto [rows, in, out] : shapes) {
      const std::string id = fmt::format("linear_backward(dtype={},rows={},in={},out={})", dt_name(dt), rows, in, out);
      if (!selected(id)) continue;
      const Tensor x = random_tensor(dt, {rows, in}, -1, 1, 61), w = random_tensor(dt, {out, in}, -0.5, 0.5, 62);
      const Tensor bias = random_tensor(dt, {out}, -0.5, 0.5, 63), dy = random_tensor(dt, {rows, out}, -1, 1, 64);
      auto d_x = to_device(x), d_w = to_device(w), d_dy = to_device(dy);
      rt::DeviceBuffer d_dx(sim(), std::max<std::size_t>(x.nbytes(), 1)), d_dw(sim(), w.nbytes()),
          d_db(sim(), bias.nbytes());
      const std::size_t ws_bytes = k::linear_backward_bias_workspace_bytes(rows, out);
      rt::DeviceBuffer ws(sim(), ws_bytes);
      auto dgrad = [&] { k::linear_backward_dgrad(dt, d_dy.get(), d_w.get(), d_dx.get(), rows, in, out, nullptr); };
      auto wgrad = [&] { k::linear_backward_wgrad(dt, d_dy.get(), d_x.get(), d_dw.get(), rows, in, out, nullptr); };
      auto bgrad = [&] { k::linear_backward_bias(dt, d_dy.get(), d_db.get(), rows, out, ws.get(), ws_bytes, nullptr); };
      const RoundingCount c_dx = counted(dgrad), c_dw = counted(wgrad), c_db = counted(bgrad);
      const Tensor dx = from_device(d_dx, dt, {rows, in}), dw = from_device(d_dw, dt, {out, in}),
                   db = from_device(d_db, dt, {out});
      dgrad();
      wgrad();
      bgrad();
      EXPECT_TRUE(same_bits(dx, from_device(d_dx, dt, {rows, in}))) << id << ": dx differs between two runs";
      EXPECT_TRUE(same_bits(dw, from_device(d_dw, dt, {out, in}))) << id << ": dweight differs between two runs";
      EXPECT_TRUE(same_bits(db, from_device(d_db, dt, {out}))) << id << ": dbias differs between two runs";

      ref::Linear lin(in, out, true, false, prec(dt));
      lin.load_state_dict(ref::StateDict({{"weight", w}, {"bias", bias}}), "");
      ref::LinearSaved saved;
      lin.forward(ref::to_mat(x, rows, in, "x"), &saved);
      const ref::Mat dym = ref::to_mat(dy, rows, out, "dy");
      const ref::LinearGrads g = lin.backward(dym, saved);
      // dgrad's error follows sum_o |dy_ro| |w_oi|; wgrad's and the bias's the reference's magnitudes.
      const double mag_dx = rows ? (dym.cwiseAbs() * ref::to_mat(w, out, in, "w").cwiseAbs()).maxCoeff() : 0.0;
      const ref::Precision p = prec(dt);
      expect_pass(compare(id + " dx", dx, p.to_tensor(g.input, {rows, in}), counted_bound(dt, c_dx, mag_dx)), id);
      expect_pass(compare(id + " dweight", dw, g.weight, counted_bound(dt, c_dw, g.weight_magnitude)), id);
      expect_pass(compare(id + " dbias", db, p.to_tensor(g.bias, {out}), counted_bound(dt, c_db, g.bias_magnitude)),
                  id);
    }
}

// ---- dot_product_attention.cuh ----------------------------------------------------------------
namespace {
// One core-attention backward case: q [sq, b, np, hn], k / v [sk, b, ng, hn], d context
// [sq, b, np * hn]. Self attention (sq == sk) reads q / k / v from a fused linear_qkv buffer and
// writes the grads into a d_qkv buffer of that layout (AttnOperands / AttnGradOperands::from_qkv);
// sq != sk uses separate dense buffers.
struct AttnBwdCase {
  DType dt;
  int sq, sk, b, np, ng, hn;
  std::string mask;  // none | causal | padding | arbitrary (row 0 fully masked)
  double dropout;
  bool coeff;        // apply_query_key_layer_scaling (layer 3: coeff 3)
  bool sm32 = true;  // attention_softmax_in_fp32
  std::string id() const {
    return fmt::format(
        "attention_backward(dtype={},sq={},sk={},b={},np={},ng={},hn={},mask={},drop={},coeff={},sm32={})", dt_name(dt),
        sq, sk, b, np, ng, hn, mask, dropout, int(coeff), int(sm32));
  }
};

// The largest share of its bound any compared grad used, over the cases run (printed by the tests).
struct AttnBwdShare {
  int cases = 0;
  double max_share = 0.0;
  std::string worst;
  void note(const Comparison& c) {
    if (c.share_used > max_share) max_share = c.share_used, worst = c.name;
  }
  void print(const char* what, double seconds) const {
    std::printf("[ attention backward ] %s: %d cases in %.1f s, max share of bound used %.3g (%s)\n", what, cases,
                seconds, max_share, worst.c_str());
  }
};

// A tensor's (poisoned) device buffer: 0xFF bytes are NaN in fp32, bf16 and fp16, so an element
// a kernel leaves unwritten fails the comparison.
rt::DeviceBuffer poisoned(std::size_t bytes) {
  rt::DeviceBuffer b(sim(), std::max<std::size_t>(bytes, 1));
  const std::vector<unsigned char> ff(std::max<std::size_t>(bytes, 1), 0xFF);
  b.upload(ff.data(), ff.size());
  return b;
}

void run_attention_backward_case(const AttnBwdCase& c, AttnBwdShare& share) {
  const std::string id = c.id();
  if (!selected(id)) return;
  ++share.cases;
  const int hpg = c.np / c.ng;
  const std::size_t es = dtype_size(c.dt);
  const std::uint64_t seed = std::uint64_t(c.sq) * 7919 + c.sk * 131 + c.np * 17 + c.ng * 5 + c.hn;
  const Tensor q = random_tensor(c.dt, {c.sq, c.b, c.np, c.hn}, -1.5, 1.5, seed);
  const Tensor kt = random_tensor(c.dt, {c.sk, c.b, c.ng, c.hn}, -1.5, 1.5, seed + 1);
  const Tensor vt = random_tensor(c.dt, {c.sk, c.b, c.ng, c.hn}, -1.5, 1.5, seed + 2);
  const Tensor dctx = random_tensor(c.dt, {c.sq, c.b, std::int64_t(c.np) * c.hn}, -1, 1, seed + 3);
  const bool causal = c.mask == "causal" && c.sq > 1;  // Megatron: no causal mask for one query
  std::vector<bool> mv;
  Tensor mask;
  if (c.mask == "padding" || c.mask == "arbitrary") {
    std::mt19937_64 rng(seed + 4);
    mv.resize(std::size_t(c.b) * c.sq * c.sk);
    for (int bi = 0; bi < c.b; ++bi) {
      const int len = 1 + int(rng() % c.sk);
      for (int i = 0; i < c.sq; ++i)
        for (int j = 0; j < c.sk; ++j)
          mv[(std::size_t(bi) * c.sq + i) * c.sk + j] = c.mask == "padding" ? j >= len : (i == 0 || rng() % 10 < 3);
    }
    mask = Tensor::from_vector<bool>({c.b, 1, c.sq, c.sk}, mv);
  }
  auto masked = [&](int bi, int i, int j) {
    if (causal) return j > i;
    return !mv.empty() && mv[(std::size_t(bi) * c.sq + i) * c.sk + j];
  };

  // ---- the reference
  TransformerConfig cfg;
  cfg.hidden_size = c.np * c.hn;
  cfg.num_attention_heads = c.np;
  cfg.num_query_groups = c.ng;
  cfg.kv_channels = c.hn;
  cfg.bf16 = c.dt == DType::BF16;
  cfg.fp16 = c.dt == DType::F16;
  cfg.attention_dropout = c.dropout;
  cfg.attention_softmax_in_fp32 = c.sm32;
  cfg.apply_query_key_layer_scaling = c.coeff;
  const ref::AttnMaskType mt = c.mask == "causal" ? ref::AttnMaskType::causal
                               : c.mask == "none" ? ref::AttnMaskType::no_mask
                                                  : ref::AttnMaskType::padding;
  ref::DotProductAttention dpa(cfg, 3, mt, prec(c.dt));
  const bool training = c.dropout > 0;
  const ref::Mat qm = ref::to_mat(q, std::int64_t(c.sq) * c.b * c.np, c.hn, "q");
  const ref::Mat km = ref::to_mat(kt, std::int64_t(c.sk) * c.b * c.ng, c.hn, "k");
  const ref::Mat vm = ref::to_mat(vt, std::int64_t(c.sk) * c.b * c.ng, c.hn, "v");
  const ref::Mat dm = ref::to_mat(dctx, std::int64_t(c.sq) * c.b, std::int64_t(c.np) * c.hn, "dcontext");
  ref::CoreAttentionGrads g;
  const RoundingCount ref_count = counted([&] {
    g = dpa.backward(dm, qm, km, vm, c.sq, c.sk, c.b, mask.defined() ? &mask : nullptr, training,
                     ref::DropoutRng{99, 3});
  });

  // ---- the twin
  opt::AttnParams p;
  p.sq = c.sq;
  p.sk = c.sk;
  p.b = c.b;
  p.np_local = p.np_total = c.np;
  p.hn = c.hn;
  p.alpha = static_cast<float>(dpa.softmax_scale);
  p.coeff = dpa.coeff ? static_cast<float>(*dpa.coeff) : 0.0f;
  p.softmax_fp32 = c.sm32 || c.coeff;  // TransformerConfig: layer scaling turns the fp32 softmax on
  rt::DeviceBuffer dmask = mask.defined() ? to_device(mask) : rt::DeviceBuffer();
  p.mask = mask.defined() ? twin::opt::MaskMode::Explicit
           : causal       ? twin::opt::MaskMode::Causal
                          : twin::opt::MaskMode::None;
  p.mask_ptr = static_cast<const std::uint8_t*>(dmask.get());
  p.mask_b = c.b;
  p.drop = opt::DropoutArgs::make(c.dropout, training, 99, 3);

  const bool fused = c.sq == c.sk;
  const int gs = (hpg + 2) * c.hn, ld = c.ng * gs;
  const std::int64_t tokens_q = std::int64_t(c.sq) * c.b;
  rt::DeviceBuffer d_q, d_k, d_v, g_q, g_k, g_v, d_qkv, g_qkv;
  opt::AttnOperands ops;
  opt::AttnGradOperands grads;
  const opt::QkvLayout lay{ld, gs, hpg};
  if (fused) {  // q / k / v of token t, group gg at t * ld + gg * gs + (head, hpg, hpg + 1) * hn
    Tensor qkv = Tensor::empty(c.dt, {c.sq, c.b, ld});
    for (std::int64_t t = 0; t < tokens_q; ++t)
      for (int gg = 0; gg < c.ng; ++gg) {
        std::byte* row = qkv.raw_mut() + (t * ld + std::int64_t(gg) * gs) * es;
        for (int jh = 0; jh < hpg; ++jh)
          std::memcpy(row + std::size_t(jh) * c.hn * es, q.raw() + ((t * c.np + gg * hpg + jh) * c.hn) * es, c.hn * es);
        std::memcpy(row + std::size_t(hpg) * c.hn * es, kt.raw() + ((t * c.ng + gg) * c.hn) * es, c.hn * es);
        std::memcpy(row + std::size_t(hpg + 1) * c.hn * es, vt.raw() + ((t * c.ng + gg) * c.hn) * es, c.hn * es);
      }
    d_qkv = to_device(qkv);
    g_qkv = poisoned(qkv.nbytes());
    ops = opt::AttnOperands::from_qkv(d_qkv.get(), lay, c.b, c.hn, es);
    grads = opt::AttnGradOperands::from_qkv(g_qkv.get(), lay, c.hn, es);
  } else {
    d_q = to_device(q);
    d_k = to_device(kt);
    d_v = to_device(vt);
    g_q = poisoned(q.nbytes());
    g_k = poisoned(kt.nbytes());
    g_v = poisoned(vt.nbytes());
    ops.q = d_q.get();
    ops.k = d_k.get();
    ops.v = d_v.get();
    ops.q_tok = std::int64_t(c.b) * c.np * c.hn;
    ops.q_batch = std::int64_t(c.np) * c.hn;
    ops.q_group = std::int64_t(hpg) * c.hn;
    ops.q_head = c.hn;
    ops.hpg = hpg;
    ops.kv_tok = std::int64_t(c.b) * c.ng * c.hn;
    ops.kv_batch = std::int64_t(c.ng) * c.hn;
    ops.kv_group = c.hn;
    grads.dq = g_q.get();
    grads.dk = g_k.get();
    grads.dv = g_v.get();
  }
  // The grads back as [sq, b, np, hn] and [sk, b, ng, hn].
  auto download = [&](Tensor& dq, Tensor& dk, Tensor& dv) {
    dq = Tensor::empty(c.dt, {c.sq, c.b, c.np, c.hn});
    dk = Tensor::empty(c.dt, {c.sk, c.b, c.ng, c.hn});
    dv = Tensor::empty(c.dt, {c.sk, c.b, c.ng, c.hn});
    if (!fused) {
      dq = from_device(g_q, c.dt, dq.shape());
      dk = from_device(g_k, c.dt, dk.shape());
      dv = from_device(g_v, c.dt, dv.shape());
      return;
    }
    const Tensor all = from_device(g_qkv, c.dt, {c.sq, c.b, ld});
    for (std::int64_t t = 0; t < tokens_q; ++t)
      for (int gg = 0; gg < c.ng; ++gg) {
        const std::byte* row = all.raw() + (t * ld + std::int64_t(gg) * gs) * es;
        for (int jh = 0; jh < hpg; ++jh)
          std::memcpy(dq.raw_mut() + ((t * c.np + gg * hpg + jh) * c.hn) * es, row + std::size_t(jh) * c.hn * es,
                      c.hn * es);
        std::memcpy(dk.raw_mut() + ((t * c.ng + gg) * c.hn) * es, row + std::size_t(hpg) * c.hn * es, c.hn * es);
        std::memcpy(dv.raw_mut() + ((t * c.ng + gg) * c.hn) * es, row + std::size_t(hpg + 1) * c.hn * es, c.hn * es);
      }
  };
  auto d_dctx = to_device(dctx);
  rt::DeviceBuffer d_ctx(sim(), dctx.nbytes()), d_stats(sim(), sizeof(float) * 2 * tokens_q * c.np);
  p.softmax_stats = static_cast<float*>(d_stats.get());
  const std::size_t ws_bytes = k::dot_product_attention_backward_workspace_bytes(p);
  rt::DeviceBuffer ws(sim(), ws_bytes);
  const RoundingCount fwd_count =
      counted([&] { k::dot_product_attention_forward(c.dt, ops, d_ctx.get(), p, nullptr); });
  // The kernels the supports functions choose (tensor cores for 16-bit inputs: dq, and dk / dv up
  // to head dim 128), and where those are on tensor cores, the CUDA-core ones too: each counts the reference's rounding
  // points, gives the same bits twice, and lands within the bound below.
  const bool wmma = k::attention_wmma_supports(c.dt, c.hn);
  struct Grads {
    std::string kernel;
    Tensor dq, dk, dv;
  };
  std::vector<Grads> runs;
  std::vector<bool> kernels = {wmma};
  if (wmma) kernels.push_back(false);
  for (const bool tensor_cores : kernels) {
    auto backward = [&] {
      k::dot_product_attention_backward_on(tensor_cores, c.dt, ops, d_dctx.get(), grads,
                                           static_cast<const float*>(d_stats.get()), p, ws.get(), ws_bytes, nullptr);
    };
    const std::string kernel = !tensor_cores                                ? ""
                               : k::attention_wmma_dkv_supports(c.dt, c.hn) ? " (tensor cores)"
                                                                            : " (dq on tensor cores)";
    const RoundingCount bwd_count = counted(backward);
    EXPECT_TRUE(bwd_count == ref_count) << id << kernel << ": the launcher counts " << bwd_count.describe()
                                        << ", the reference's backward " << ref_count.describe();
    Grads g1{kernel, {}, {}, {}}, g2;
    download(g1.dq, g1.dk, g1.dv);
    backward();
    download(g2.dq, g2.dk, g2.dv);
    EXPECT_TRUE(same_bits(g1.dq, g2.dq)) << id << kernel << ": dq differs between two runs";
    EXPECT_TRUE(same_bits(g1.dk, g2.dk)) << id << kernel << ": dk differs between two runs";
    EXPECT_TRUE(same_bits(g1.dv, g2.dv)) << id << kernel << ": dv differs between two runs";
    runs.push_back(std::move(g1));
  }
  const RoundingCount bwd_count = ref_count;  // each run's, checked above

  // ---- the bound. The grads pass through the forward's rounding points (the probabilities are
  // recomputed as the forward rounded them) and the backward's: both launchers' counts. Magnitudes
  // (the terms before they cancel, in double): with y the softmax, A_ij = sum_c |dctx_ic| |v_jc| / (1
  // - p) what d probs_ij sums and S_i = sum_j y_ij A_ij what D_i does, a d score's error follows
  // T_ij = y_ij (A_ij + 2 S_i) (0 where masked: exactly 0 in both); dq follows scale sum_j T_ij |k_j|,
  // dk scale sum_{h, i} T_ij |q_i| over the group's heads, dv sum_{h, i} y_ij / (1 - p) |dctx_i|
  // (scale: the scores' whole scale, alpha coeff). A score apart by ds moves y_ij by ds directly and
  // by up to ds more through the row's sum: a score stored in T one ulp apart (2u |s|), after an fp32
  // dot q . k in another order (2 gamma_hn(fp32) scale sum_c |q_c k_c|), so 2 (2u max|s| + 2
  // gamma_hn max scale sum|q k|) of each magnitude more.
  const double scale = dpa.softmax_scale * (dpa.coeff ? *dpa.coeff : 1.0);
  const double drop_scale = training ? 1.0 / (1.0 - c.dropout) : 1.0;
  ref::Mat mq = ref::Mat::Zero(qm.rows(), c.hn), mk = ref::Mat::Zero(km.rows(), c.hn), mvv = mk;
  double max_score = 0.0, max_score_terms = 0.0;
  std::vector<double> s(c.sk), y(c.sk), a(c.sk);
  for (int bi = 0; bi < c.b; ++bi)
    for (int h = 0; h < c.np; ++h) {
      const int gq = h / hpg;
      for (int i = 0; i < c.sq; ++i) {
        const Eigen::Index qi = (std::int64_t(i) * c.b + bi) * c.np + h;
        const auto dci = dm.row(std::int64_t(i) * c.b + bi).segment(std::int64_t(h) * c.hn, c.hn);
        double mx = -1e300;
        for (int j = 0; j < c.sk; ++j) {
          const Eigen::Index kj = (std::int64_t(j) * c.b + bi) * c.ng + gq;
          s[j] = masked(bi, i, j) ? -10000.0 : scale * qm.row(qi).dot(km.row(kj));
          if (!masked(bi, i, j)) {
            max_score = std::max(max_score, std::fabs(s[j]));
            max_score_terms = std::max(max_score_terms, scale * qm.row(qi).cwiseAbs().dot(km.row(kj).cwiseAbs()));
          }
          mx = std::max(mx, s[j]);
          a[j] = drop_scale * (dci.cwiseAbs().dot(vm.row(kj).cwiseAbs()));
        }
        double sum = 0.0, srow = 0.0;
        for (int j = 0; j < c.sk; ++j) sum += (y[j] = std::exp(s[j] - mx));
        for (int j = 0; j < c.sk; ++j) srow += (y[j] /= sum) * a[j];
        for (int j = 0; j < c.sk; ++j) {
          const Eigen::Index kj = (std::int64_t(j) * c.b + bi) * c.ng + gq;
          const double t = masked(bi, i, j) ? 0.0 : y[j] * (a[j] + 2.0 * srow);
          mq.row(qi) += scale * t * km.row(kj).cwiseAbs();
          mk.row(kj) += scale * t * qm.row(qi).cwiseAbs();
          mvv.row(kj) += y[j] * drop_scale * dci.cwiseAbs();
        }
      }
    }
  RoundingCount count = fwd_count;
  count.bf16 += bwd_count.bf16;
  count.fp16 += bwd_count.fp16;
  count.fp32 += bwd_count.fp32;
  count.reduction += bwd_count.reduction;
  auto bound = [&](double magnitude) {
    Tolerance t = counted_bound(c.dt, count, magnitude);
    const double score_apart = 2.0 * unit_roundoff(c.dt) * max_score +
                               2.0 * parity::gamma_n(c.hn, unit_roundoff(DType::F32)) * max_score_terms;
    t.atol += 2.0 * score_apart * magnitude;
    t.reason += fmt::format(" + scores apart 2 x (2u x max|score| {:.3g} + 2 gamma_hn x {:.3g}) x magnitude", max_score,
                            max_score_terms);
    return t;
  };
  const ref::Precision pr = prec(c.dt);
  for (const Grads& r : runs) {
    const std::string rid = id + r.kernel;
    const Comparison cq = compare(rid + " dq", r.dq, pr.to_tensor(g.query, r.dq.shape()), bound(mq.maxCoeff()));
    const Comparison ck = compare(rid + " dk", r.dk, pr.to_tensor(g.key, r.dk.shape()), bound(mk.maxCoeff()));
    const Comparison cv = compare(rid + " dv", r.dv, pr.to_tensor(g.value, r.dv.shape()), bound(mvv.maxCoeff()));
    for (const Comparison* cmp : {&cq, &ck, &cv}) {
      expect_pass(*cmp, rid);
      share.note(*cmp);
    }
  }
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

TEST(OptimizedBackward, AttentionMatchesReference) {
  // sq, sk, b, ng, hn: tiny; hn 64 with sq not a multiple of the query tile (16) and several key
  // tiles; a head dim off the warp width (40); sq != sk (no causal mask there).
  const std::tuple<int, int, int, int, int> shapes[] = {
      {5, 5, 2, 2, 8}, {37, 37, 1, 1, 64}, {20, 20, 2, 1, 40}, {7, 45, 2, 1, 24}};
  AttnBwdShare share;
  const auto t0 = std::chrono::steady_clock::now();
  for (DType dt : kDtypes)
    for (const char* mask : {"none", "causal", "padding"})
      for (int hpg : {1, 2})
        for (double drop : {0.0, 0.1})
          for (bool coeff : {false, true})
            for (auto [sq, sk, b, ng, hn] : shapes) {
              if (std::string(mask) == "causal" && sq != sk) continue;
              run_attention_backward_case({dt, sq, sk, b, ng * hpg, ng, hn, mask, drop, coeff}, share);
            }
  share.print("masks x GQA x dropout x coeff x shapes", seconds_since(t0));
}

// The softmax in the activation dtype (attention_softmax_in_fp32 off, 16-bit only: y and the
// probabilities are one T value, d scores stored in T), fully masked rows (an arbitrary mask masks
// row 0: uniform probabilities that reach dv, zero d scores), head dims up to 256 and 1, three heads
// per group.
TEST(OptimizedBackward, AttentionSoftmaxInActivationDtypeAndEdgesMatchReference) {
  AttnBwdShare share;
  const auto t0 = std::chrono::steady_clock::now();
  for (DType dt : {DType::BF16, DType::F16})
    for (const char* mask : {"none", "causal", "arbitrary"})
      for (double drop : {0.0, 0.1}) {
        AttnBwdCase c{dt, 20, 20, 2, 4, 2, 40, mask, drop, false};
        c.sm32 = false;
        run_attention_backward_case(c, share);
      }
  for (DType dt : kDtypes)
    for (int hn : {1, 33, 128, 256})
      run_attention_backward_case({dt, 18, 18, 1, 2, 1, hn, "arbitrary", 0.1, true}, share);
  for (DType dt : kDtypes) run_attention_backward_case({dt, 19, 19, 2, 6, 2, 16, "causal", 0.1, false}, share);
  share.print("softmax in T, head dims, fully masked rows", seconds_since(t0));
}

TEST(OptimizedBackward, AttentionMatchesReferenceOnRandomShapes) {
  // Fixed seed: the same cases each run. Partial query / key tiles, head dims across the 32-column
  // chunks (1..256), every mask, GQA up to 3 heads per group, sq != sk without a causal mask.
  std::mt19937_64 rng(20261204);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  const char* masks[] = {"none", "causal", "padding", "arbitrary"};
  AttnBwdShare share;
  const auto t0 = std::chrono::steady_clock::now();
  for (int n = 0; n < 100; ++n) {
    const DType dt = kDtypes[pick(0, 2)];
    const std::string mask = masks[pick(0, 3)];
    const int ng = pick(1, 2), hpg = pick(1, 3), b = pick(1, 2);
    const int hn = pick(0, 3) == 0 ? pick(100, 256) : pick(1, 72);
    const int sq = pick(1, 40), sk = mask == "causal" || pick(0, 1) ? sq : pick(1, 40);
    const double drop = pick(0, 1) ? 0.1 : 0.0;
    const bool coeff = pick(0, 3) == 0;
    AttnBwdCase c{dt, sq, sk, b, ng * hpg, ng, hn, mask, drop, coeff};
    c.sm32 = coeff || pick(0, 2) != 0;
    run_attention_backward_case(c, share);
  }
  share.print("random shapes", seconds_since(t0));
}

// The forward's softmax statistics are an extra output only: the context has the same bits with
// and without them, on the CUDA-core kernel (fp32) and the tensor-core one (bf16 / fp16); every row
// gets its m and l (l >= 1: the row's largest score adds exp(0)).
TEST(OptimizedBackward, AttentionSoftmaxStatsLeaveForwardBitsUnchanged) {
  for (DType dt : kDtypes)
    for (const char* mask : {"none", "causal", "arbitrary"}) {
      const int s = 37, b = 2, np = 4, ng = 2, hn = 40, hpg = np / ng, gs = (hpg + 2) * hn, ld = ng * gs;
      const std::string id = fmt::format("attention_softmax_stats(dtype={},mask={})", dt_name(dt), mask);
      if (!selected(id)) continue;
      const Tensor qkv = random_tensor(dt, {s, b, ld}, -1.5, 1.5, 77);
      std::vector<bool> mv(std::size_t(b) * s * s);
      std::mt19937_64 rng(5);
      for (std::size_t e = 0; e < mv.size(); ++e) mv[e] = e % s == 0 ? false : (e / s) % s == 0 || rng() % 10 < 3;
      const Tensor mask_t = Tensor::from_vector<bool>({b, 1, s, s}, mv);
      auto d_qkv = to_device(qkv), d_mask = to_device(mask_t);
      rt::DeviceBuffer ctx_a(sim(), std::size_t(s) * b * np * hn * dtype_size(dt)),
          ctx_b(sim(), std::size_t(s) * b * np * hn * dtype_size(dt));
      rt::DeviceBuffer stats = poisoned(sizeof(float) * 2 * std::size_t(b) * np * s);
      opt::AttnParams p;
      p.sq = p.sk = s;
      p.b = b;
      p.np_local = p.np_total = np;
      p.hn = hn;
      p.alpha = 0.15f;
      p.mask = std::string(mask) == "none"     ? twin::opt::MaskMode::None
               : std::string(mask) == "causal" ? twin::opt::MaskMode::Causal
                                               : twin::opt::MaskMode::Explicit;
      p.mask_ptr = static_cast<const std::uint8_t*>(d_mask.get());
      p.mask_b = b;
      p.drop = opt::DropoutArgs::make(0.1, true, 5, 6);
      k::dot_product_attention_forward(dt, d_qkv.get(), opt::QkvLayout{ld, gs, hpg}, ctx_a.get(), p, nullptr);
      p.softmax_stats = static_cast<float*>(stats.get());
      k::dot_product_attention_forward(dt, d_qkv.get(), opt::QkvLayout{ld, gs, hpg}, ctx_b.get(), p, nullptr);
      const Shape shape{s, b, std::int64_t(np) * hn};
      EXPECT_TRUE(same_bits(from_device(ctx_a, dt, shape), from_device(ctx_b, dt, shape))) << id;
      const Tensor st = from_device(stats, DType::F32, {b, np, s, 2});
      for (std::int64_t r = 0; r < std::int64_t(b) * np * s; ++r) {
        const float m = st.data<float>()[2 * r], l = st.data<float>()[2 * r + 1];
        EXPECT_TRUE(std::isfinite(m) && std::isfinite(l) && l >= 1.0f)
            << id << ": row " << r << " m " << m << " l " << l;
      }
    }
}

TEST(OptimizedBackward, AttentionRejectsBadArguments) {
  opt::AttnParams p;
  p.sq = p.sk = 4;
  p.b = 1;
  p.np_local = p.np_total = 2;
  p.hn = 8;
  const opt::QkvLayout lay{2 * 3 * 8, 3 * 8, 1};
  rt::DeviceBuffer qkv(sim(), 4096), dctx(sim(), 4096), dqkv(sim(), 4096), stats(sim(), 4096);
  const std::size_t ws_bytes = k::dot_product_attention_backward_workspace_bytes(p);
  rt::DeviceBuffer ws(sim(), ws_bytes);
  const float* st = static_cast<const float*>(stats.get());
  // The message of a rejected call (empty when it is accepted).
  auto message = [&](const opt::AttnParams& pp, const void* q, void* dq, const float* sts, std::size_t bytes,
                     DType dt = DType::F32) -> std::string {
    try {
      k::dot_product_attention_backward(dt, q, lay, dctx.get(), dq, sts, pp, ws.get(), bytes, nullptr);
    } catch (const std::invalid_argument& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_EQ(message(p, qkv.get(), dqkv.get(), st, ws_bytes), "");
  EXPECT_NE(message(p, qkv.get(), dqkv.get(), nullptr, ws_bytes).find("softmax_stats"), std::string::npos);
  EXPECT_NE(message(p, qkv.get(), qkv.get(), st, ws_bytes).find("alias"), std::string::npos);
  EXPECT_NE(message(p, qkv.get(), dqkv.get(), st, ws_bytes - 4).find("workspace"), std::string::npos);
  opt::AttnParams bad = p;
  bad.hn = 300;
  EXPECT_NE(message(bad, qkv.get(), dqkv.get(), st, ws_bytes).find("head dim 300"), std::string::npos);
  bad = p;
  bad.mask = twin::opt::MaskMode::Causal;
  bad.sk = 5;
  EXPECT_NE(message(bad, qkv.get(), dqkv.get(), st, ws_bytes).find("causal"), std::string::npos);
  bad = p;
  bad.coeff = 2.0f;
  bad.softmax_fp32 = false;
  EXPECT_NE(message(bad, qkv.get(), dqkv.get(), st, ws_bytes, DType::BF16).find("fp32"), std::string::npos);
  bad = p;
  bad.mask = twin::opt::MaskMode::Explicit;
  EXPECT_NE(message(bad, qkv.get(), dqkv.get(), st, ws_bytes).find("mask"), std::string::npos);
  EXPECT_NE(message(p, qkv.get(), dqkv.get(), st, ws_bytes, DType::I64).find("dtype"), std::string::npos);
}

// ---- cost declarations ----------------------------------------------------------------------
// Every simulated kernel launch of the backward launchers is matched by one cost declaration
// (GEMMs declare through the GEMM interface and are no kernel launch): a launcher without one
// would leave its kernel out of the roofline table.
TEST(OptimizedBackward, EveryKernelLaunchIsDeclared) {
  const DType dt = DType::BF16;
  const int n = 300, h = 40, f = 24;
  auto x = to_device(random_tensor(dt, {n, 2 * f}, -1, 1, 1)), dy = to_device(random_tensor(dt, {n, 2 * f}, -1, 1, 2));
  auto w = to_device(random_tensor(dt, {2 * f * h}, -1, 1, 3));
  rt::DeviceBuffer dx(sim(), std::size_t(n) * 2 * f * 2), dw(sim(), std::size_t(2) * f * h * 2), db(sim(), 2 * f * 2);
  const std::size_t ws_bytes = k::norm_backward_workspace_bytes(false, n, 2 * f);
  rt::DeviceBuffer ws(sim(), ws_bytes);
  const auto freqs = to_device(ref::RotaryEmbedding(8, 1.0).forward(n));
  rt::CostScope scope;
  for (bool rms : {false, true})
    k::norm_backward(rms, dt, dy.get(), x.get(), dx.get(), w.get(), dw.get(), rms ? nullptr : db.get(),
                     opt::NormRows::dense(n, 2 * f), 1e-5, false, ws.get(), ws_bytes, nullptr);
  k::bias_activation_backward(dt, x.get(), w.get(), dy.get(), dx.get(), n, f, twin::opt::Act::Silu, true, nullptr);
  k::bias_dropout_add_backward(dt, dy.get(), dx.get(), nullptr, db.get(), n, h, opt::DropoutArgs::make(0.1, true, 1, 2),
                               0, ws.get(), ws_bytes, nullptr);
  k::rotary_pos_emb_backward(dt, dx.get(), static_cast<const float*>(freqs.get()), opt::NormRows::dense(n, 8), 1, 8,
                             false, nullptr);
  k::linear_backward_dgrad(dt, dy.get(), w.get(), dx.get(), n, h, f, nullptr);
  k::linear_backward_wgrad(dt, dy.get(), x.get(), dw.get(), n, h, f, nullptr);
  k::linear_backward_bias(dt, dy.get(), db.get(), n, f, ws.get(), ws_bytes, nullptr);
  {  // attention: the forward (saving its statistics) and both backward kernels
    opt::AttnParams p;
    p.sq = p.sk = 20;
    p.b = 2;
    p.np_local = p.np_total = 2;
    p.hn = 8;
    p.mask = twin::opt::MaskMode::Causal;
    const opt::QkvLayout lay{p.np_local * 3 * p.hn, 3 * p.hn, 1};
    rt::DeviceBuffer stats(sim(), sizeof(float) * 2 * p.b * p.np_local * p.sq),
        aws(sim(), k::dot_product_attention_backward_workspace_bytes(p));
    p.softmax_stats = static_cast<float*>(stats.get());
    k::dot_product_attention_forward(dt, x.get(), lay, dy.get(), p, nullptr);
    k::dot_product_attention_backward(dt, x.get(), lay, dy.get(), dx.get(), p.softmax_stats, p, aws.get(),
                                      k::dot_product_attention_backward_workspace_bytes(p), nullptr);
  }
  int launched = 0, declared = 0;
  std::string names;
  for (const auto& [name, count] : scope.kernel_launches()) {
    launched += count;
    names += " " + name;
  }
  for (const auto& c : scope.kernels())
    if (c.kernel.rfind("gemm", 0) != 0 && c.kernel.rfind("grouped_gemm", 0) != 0) declared += c.launches;
  EXPECT_GT(launched, 0);
  EXPECT_EQ(declared, launched) << "kernels launched:" << names << "\n" << rt::cost_table(scope.kernels());
}
