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
#include <cstring>
#include <fmt/format.h>
#include <functional>
#include <random>

#include "core/rounding.h"
#include "optimized/activations.cuh"
#include "optimized/fused_bias_dropout.cuh"
#include "optimized/linear.cuh"
#include "optimized/rotary_pos_embedding.cuh"
#include "optimized/torch_norm.cuh"
#include "parity/bounds.h"
#include "reference/activations.h"
#include "reference/fused_bias_dropout.h"
#include "reference/linear.h"
#include "reference/rotary_pos_embedding.h"
#include "reference/torch_norm.h"
#include "tests/optimized/sim_util.h"

using namespace twin;
using namespace twin::test;
namespace k = twin::opt::sim;
namespace ref = twin::reference;
using parity::max_abs;

namespace {

const DType kDtypes[] = {DType::F32, DType::BF16, DType::F16};

ref::Precision prec(DType dt) { return ref::Precision{ref::ComputeMode::FP32, dt}; }

void expect_pass(const Comparison& c, const std::string& id) {
  EXPECT_TRUE(c.pass) << id << ": " << c.name << " max abs " << c.max_abs << " at " << c.worst_index_str() << " actual "
                      << c.worst_actual << " expected " << c.worst_expected << " share " << c.share_used << " ("
                      << c.tol.reason << ")" << c.message;
}

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
                     k::NormRows::dense(rows, width), 1e-5, zcg, ws.get(), ws_bytes, nullptr);
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
                       k::NormRows{n_q, hn, hpg, gs, hn}, 1e-5, false, ws.get(), ws_bytes, nullptr);
      const Tensor dx_strided = gather(from_device(d_dx, dt, qkv.shape()));
      const Tensor dw_strided = from_device(d_dw, dt, {hn}), db_strided = from_device(d_db, dt, {hn});
      auto q_x = to_device(gather(qkv)), q_dy = to_device(gather(dqkv));
      rt::DeviceBuffer q_dx(sim(), std::size_t(n_q) * hn * es);
      k::norm_backward(rms, dt, q_dy.get(), q_x.get(), q_dx.get(), d_w.get(), d_dw.get(), rms ? nullptr : d_db.get(),
                       k::NormRows::dense(n_q, hn), 1e-5, false, ws.get(), ws_bytes, nullptr);
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
  const auto rows = k::NormRows::dense(2, 4);
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
                                        k::act_from_name(act), glu, nullptr);
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
  EXPECT_THROW(
      k::bias_activation_backward(DType::F32, a.get(), nullptr, b.get(), b.get(), 2, 4, k::Act::Gelu, true, nullptr),
      std::invalid_argument);  // GLU: din aliasing dy
  EXPECT_THROW(
      k::bias_activation_backward(DType::F32, a.get(), nullptr, nullptr, b.get(), 2, 4, k::Act::Gelu, false, nullptr),
      std::invalid_argument);
  EXPECT_NO_THROW(k::bias_activation_backward(DType::F32, a.get(), nullptr, b.get(), a.get(), 2, 4, k::Act::Gelu, true,
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
          const auto drop = k::DropoutArgs::make(p, training, 1234, 7);
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
    const auto drop = k::DropoutArgs::make(0.3, true, 99, 11);
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
                                     k::NormRows::dense(s * b * heads, hn), b * heads, rot, interleaved, nullptr);
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
      expect_pass(
          compare(id + " dweight", dw, p.to_tensor(g.weight, {out, in}), counted_bound(dt, c_dw, g.weight_magnitude)),
          id);
      expect_pass(compare(id + " dbias", db, p.to_tensor(g.bias, {out}), counted_bound(dt, c_db, g.bias_magnitude)),
                  id);
    }
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
                     k::NormRows::dense(n, 2 * f), 1e-5, false, ws.get(), ws_bytes, nullptr);
  k::bias_activation_backward(dt, x.get(), w.get(), dy.get(), dx.get(), n, f, k::Act::Silu, true, nullptr);
  k::bias_dropout_add_backward(dt, dy.get(), dx.get(), nullptr, db.get(), n, h, k::DropoutArgs::make(0.1, true, 1, 2),
                               0, ws.get(), ws_bytes, nullptr);
  k::rotary_pos_emb_backward(dt, dx.get(), static_cast<const float*>(freqs.get()), k::NormRows::dense(n, 8), 1, 8,
                             false, nullptr);
  k::linear_backward_dgrad(dt, dy.get(), w.get(), dx.get(), n, h, f, nullptr);
  k::linear_backward_wgrad(dt, dy.get(), x.get(), dw.get(), n, h, f, nullptr);
  k::linear_backward_bias(dt, dy.get(), db.get(), n, f, ws.get(), ws_bytes, nullptr);
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
