// The optimized router backward kernels (optimized/moe/router.cuh: router_topk_backward,
// router_aux_scores_grad) against the reference's backward steps (reference/moe/moe_utils.h
// topk_routing_backward, aux_scores_backward, z_loss_backward; reference TopKRouter's forward with
// RouterSaved for the load-balancing losses' gradient), on the CUDA simulator, in the style of
// test_moe_kernels.cpp: random configurations, each with a canonical case id printed on failure
// (TWIN_OP_CASE=<id> reruns one).
//
// What must be exact: the aux scores' gradient (integer counts, the reference's double expression
// for the scale, then a product and a sum each stored in the aux scores' dtype: the same IEEE
// operations on the same stored values), and the rounding points the launchers count (equal to
// the reference TopKRouter::backward's count, less the gating GEMM's). What is within a bound:
// d logits, where the kernel recomputes the fp32 softmax / score function with fp32 expf and does
// the sums in fp32 (fp64 for an fp64 router) where the reference computes in double and rounds once.
// The bound is parity::op_bound over the launcher's counted rounding points, split by dtype as
// FusedRouterEqualsReferenceSteps does (the stores in the router dtype, and the fp32 ones), times
// the magnitude the error follows: per token, the terms before they cancel (softmax's backward:
// 2 max|dy|; the renormalisation's: |dp| / denom + sum |dp s| / denom^2, times the score
// function's derivative; the z-loss's |2 lse dvalue|), summed over the gradients added.
// Every launcher also runs twice on the same inputs with bitwise equal results.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <fmt/format.h>
#include <functional>
#include <optional>
#include <random>

#include "core/config.h"
#include "core/rounding.h"
#include "optimized/moe/router.cuh"
#include "parity/bounds.h"
#include "reference/moe/moe_utils.h"
#include "reference/moe/router.h"
#include "tests/optimized/sim_util.h"
#include "tests/reference/moe/moe_test_util.h"  // small_moe_config

using namespace twin;
namespace ref = twin::reference::moe;
namespace k = twin::opt::sim;
using twin::test::sim;

namespace {

const char* dtn(DType dt) {
  switch (dt) {
    case DType::BF16:
      return "bf16";
    case DType::F16:
      return "fp16";
    case DType::F64:
      return "fp64";
    default:
      return "fp32";
  }
}

twin::opt::ScoreFunction score_fn(const std::string& s) {
  return s == "sigmoid"        ? twin::opt::ScoreFunction::Sigmoid
         : s == "sqrtsoftplus" ? twin::opt::ScoreFunction::SqrtSoftplus
                               : twin::opt::ScoreFunction::Softmax;
}

ref::Mat to_mat(const Tensor& t, std::int64_t rows, std::int64_t cols) {
  ref::Mat m(rows, cols);
  for (std::int64_t i = 0; i < rows * cols; ++i) m.data()[i] = t.at_f64(i);
  return m;
}

Tensor from_mat(DType dt, const ref::Mat& m) {
  return Tensor::from_doubles(dt, {m.rows(), m.cols()}, std::vector<double>(m.data(), m.data() + m.size()));
}

rt::DeviceBuffer bool_to_device(const ref::BoolMat& m) {
  return twin::test::to_device(
      Tensor::from_vector<bool>({m.rows(), m.cols()}, std::vector<bool>(m.data(), m.data() + m.size())));
}

rt::DeviceBuffer mask_to_device(const std::vector<bool>& pad) {
  return twin::test::to_device(Tensor::from_vector<bool>({std::int64_t(pad.size())}, pad));
}

// The rounding points `launch` counts, from zero.
RoundingCount counted(const std::function<void()>& launch) {
  CountRoundings scope;
  rounding_set({});
  launch();
  return rounding_now();
}

// op_bound over a launcher's count, split by dtype as FusedRouterEqualsReferenceSteps splits its
// stores: those in the router dtype dt (none for fp64: it loses nothing), plus the fp32 ones (the
// softmax and the score function, fp32 scores) as fp32 stores; the counted reductions' 2 gamma_R.
Tolerance counted_bound(DType dt, const RoundingCount& r, double magnitude) {
  const std::int64_t len = std::max<std::int64_t>(r.reduction, 1);
  const int in_dt = dt == DType::BF16 ? r.bf16 : dt == DType::F16 ? r.fp16 : dt == DType::F32 ? r.fp32 : 0;
  Tolerance t = parity::op_bound(dt, in_dt, len, magnitude);
  if (dt != DType::F32 && r.fp32 > 0) {
    const Tolerance f = parity::op_bound(DType::F32, r.fp32, len, magnitude);
    t.atol += f.atol;
    t.rtol += f.rtol;
    t.reason += " + " + f.reason;
  }
  return t;
}

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

double sigmoid(double v) { return 1.0 / (1.0 + std::exp(-v)); }

// d score / d logit of the sigmoid path's score function (sigmoid: y (1 - y); sqrtsoftplus:
// sigmoid(x) / (2 sqrt(softplus(x))), 1 / (2 y) above softplus' threshold).
double score_derivative(double x, const std::string& score) {
  if (score == "sqrtsoftplus") {
    const double y = std::sqrt(x > 20.0 ? x : std::log1p(std::exp(x)));
    return (x > 20.0 ? 1.0 : sigmoid(x)) / (2.0 * y);
  }
  const double y = sigmoid(x);
  return y * (1.0 - y);
}

// The magnitude a renormalised sigmoid path's gradient error follows on row t: d / denom and
// d denom's terms before they cancel, times the score function's derivative (cols: the experts
// the normalisation runs over).
double renorm_magnitude(const ref::Mat& L, const ref::Mat& dy, const ref::BoolMat& cols, std::int64_t t,
                        const std::string& score, bool normalised) {
  const std::int64_t E = L.cols();
  double m = 0.0;
  if (!normalised) {
    for (std::int64_t e = 0; e < E; ++e)
      if (cols(t, e)) m = std::max(m, std::abs(dy(t, e)) * score_derivative(L(t, e), score));
    return m;
  }
  auto s = [&](std::int64_t e) {
    const double x = L(t, e);
    return score == "sqrtsoftplus" ? std::sqrt(x > 20.0 ? x : std::log1p(std::exp(x))) : sigmoid(x);
  };
  double denom = 0.0, dot = 0.0;
  for (std::int64_t e = 0; e < E; ++e)
    if (cols(t, e)) {
      denom += s(e);
      dot += std::abs(dy(t, e) * s(e));
    }
  for (std::int64_t e = 0; e < E; ++e)
    if (cols(t, e))
      m = std::max(m, (std::abs(dy(t, e)) / denom + dot / (denom * denom)) * score_derivative(L(t, e), score));
  return m;
}

double row_abs_max(const ref::Mat& m, std::int64_t t) { return m.row(t).cwiseAbs().maxCoeff(); }

// One router_topk_backward run (and a second on the same inputs, bitwise equal) against the
// reference's composition; returns the launcher's count.
struct BackwardInputs {
  DType dt = DType::F32;  // the router dtype
  int topk = 1;
  std::string score = "softmax";
  bool pre_softmax = false;
  double scaling = 0.0;
  bool scores_fp32 = false, aux_fp32 = false;
  ref::Mat logits, dprobs;  // [T, E], values of dt
  ref::BoolMat routing_map, selected;
  std::optional<ref::Mat> aux_grad;  // [T, E], values of the aux scores' dtype
  std::optional<std::vector<bool>> padding;
  std::optional<double> z_coeff;
};

// Over the cases run: elements compared, elements not bitwise equal, the largest error / bound.
struct {
  long compared = 0, differing = 0;
  double worst = 0.0;
} g_stats;

RoundingCount check_topk_backward(const BackwardInputs& in, const std::string& id) {
  const std::int64_t T = in.logits.rows();
  const int E = static_cast<int>(in.logits.cols());
  const DType dt = in.dt;
  const std::size_t n = std::size_t(T * E);
  rt::DeviceBuffer d_logits = twin::test::to_device(from_mat(dt, in.logits));
  rt::DeviceBuffer d_dprobs = twin::test::to_device(from_mat(dt, in.dprobs));
  rt::DeviceBuffer d_map = bool_to_device(in.routing_map), d_sel = bool_to_device(in.selected);
  rt::DeviceBuffer d_aux =
      in.aux_grad ? twin::test::to_device(from_mat(DType::F32, *in.aux_grad)) : rt::DeviceBuffer(sim(), 1);
  rt::DeviceBuffer d_pad = in.padding ? mask_to_device(*in.padding) : rt::DeviceBuffer(sim(), 1);
  rt::DeviceBuffer d_out(sim(), n * dtype_size(dt));
  k::RouterBackwardArgs a;
  a.tokens = T;
  a.experts = E;
  a.topk = in.topk;
  a.score = score_fn(in.score);
  a.pre_softmax = in.pre_softmax;
  a.scaling_factor = static_cast<float>(in.scaling);
  a.scores_fp32 = in.scores_fp32;
  a.aux_scores_fp32 = in.aux_fp32;
  a.z_loss = in.z_coeff.has_value();
  a.z_coeff = in.z_coeff.value_or(0.0);
  auto run = [&] {
    k::router_topk_backward(dt, d_logits.get(), d_dprobs.get(), d_map.as<std::uint8_t>(), d_sel.as<std::uint8_t>(),
                            in.aux_grad ? d_aux.as<float>() : nullptr, in.padding ? d_pad.as<std::uint8_t>() : nullptr,
                            d_out.get(), a, nullptr);
  };
  const RoundingCount count = counted(run);
  const Tensor got = twin::test::from_device(d_out, dt, {T, E});
  run();
  EXPECT_TRUE(same_bits(got, twin::test::from_device(d_out, dt, {T, E}))) << id << ": d logits differ between two runs";

  // ---- the reference, step by step (TopKRouter::backward before the gating GEMM)
  const ref::Rounding rnd{false};
  ref::RoutingOptions opt;
  opt.topk = in.topk;
  opt.use_pre_softmax = in.pre_softmax;
  if (in.scaling != 0.0) opt.scaling_factor = in.scaling;
  opt.score_function = in.score;
  opt.scores_fp32 = in.scores_fp32;
  const ref::Mat dkept = in.dprobs.array() * in.routing_map.cast<double>().array();
  ref::Mat want = ref::topk_routing_backward(in.logits, dkept, in.selected, opt, dt, rnd);
  if (in.aux_grad)
    want = rnd(dt, ref::Mat(want + ref::aux_scores_backward(in.logits, *in.aux_grad, in.score, in.aux_fp32, dt, rnd)));
  if (in.z_coeff)
    want = rnd(dt, ref::Mat(want + ref::z_loss_backward(in.logits, *in.z_coeff, in.padding ? &*in.padding : nullptr, dt,
                                                        rnd)));

  // ---- the magnitude each row's error follows
  const ref::Mat dy = (dkept.array() * in.selected.cast<double>().array() * (in.scaling != 0.0 ? in.scaling : 1.0))
                          .matrix();  // the score function's input gradient
  const bool sigmoid_path = in.score != "softmax";
  double dvalue = 0.0;
  if (in.z_coeff) {
    double valid = double(T);
    if (in.padding) valid = std::max(1.0, double(std::count(in.padding->begin(), in.padding->end(), false)));
    dvalue = *in.z_coeff / valid;
  }
  const ref::BoolMat all = ref::BoolMat::Constant(T, E, true);
  for (std::int64_t t = 0; t < T; ++t) {
    double mag = sigmoid_path ? renorm_magnitude(in.logits, dy, in.selected, t, in.score, in.topk > 1)
                              : 2.0 * row_abs_max(dy, t);
    if (in.aux_grad) {
      if (!sigmoid_path)
        mag += 2.0 * row_abs_max(*in.aux_grad, t);
      else  // the pin's aux scores are sigmoid's for either score function
        mag += renorm_magnitude(in.logits, *in.aux_grad, all, t, in.aux_fp32 ? in.score : "sigmoid", true);
    }
    if (in.z_coeff && !(in.padding && (*in.padding)[t])) {
      const double m = in.logits.row(t).maxCoeff();
      const double lse = m + std::log((in.logits.row(t).array() - m).exp().sum());
      mag += std::abs(2.0 * lse * dvalue);
    }
    const Tolerance tol = counted_bound(dt, count, mag);
    for (int e = 0; e < E; ++e) {
      const double g = got.at_f64(t * E + e), w = want(t, e);
      if (g != w) {
        ++g_stats.differing;
        g_stats.worst = std::max(g_stats.worst, std::abs(g - w) / (tol.atol + tol.rtol * std::abs(w)));
      }
      ++g_stats.compared;
      EXPECT_LE(std::abs(g - w), tol.atol + tol.rtol * std::abs(w))
          << id << ": d logits at token " << t << " expert " << e << ": got " << g << ", want " << w << " ("
          << count.describe() << "; " << tol.reason << ")";
      if (std::abs(g - w) > tol.atol + tol.rtol * std::abs(w)) return count;  // one report per case
    }
  }
  return count;
}

struct BackwardCase {
  DType dt = DType::F32;
  int E = 4, topk = 2;
  std::string score = "softmax";
  bool pre_softmax = false;
  double scaling = 0.0;
  bool scores_fp32 = false, aux_fp32 = false;
  bool padding = false, aux = false, z = false;
  int drop = 0;  // 0: routing_map = selected; 1: a capacity drop (a subset); 2: padded to capacity (any pairs)
  std::int64_t T = 16;
  std::uint64_t seed = 0;
  std::string id() const {
    return fmt::format(
        "router_backward(dtype={},E={},k={},score={},pre={},scale={},scores_fp32={},aux_fp32={},pad={},aux={},z={},"
        "drop={},T={},seed={})",
        dtn(dt), E, topk, score, int(pre_softmax), scaling, int(scores_fp32), int(aux_fp32), int(padding), int(aux),
        int(z), drop, T, seed);
  }
};

BackwardCase random_backward_case(std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  BackwardCase c;
  c.seed = seed;
  const DType dts[] = {DType::BF16, DType::F16, DType::F32, DType::F64};
  c.dt = dts[pick(0, 3)];
  c.E = pick(2, 16);
  c.topk = pick(1, std::min(c.E, 6));
  const char* scores[] = {"softmax", "sigmoid", "sqrtsoftplus"};
  c.score = scores[pick(0, 2)];
  c.pre_softmax = c.score == "softmax" && pick(0, 1);
  const double scalings[] = {0.0, 2.5, 0.75, 1.3};
  c.scaling = scalings[pick(0, 3)];
  c.scores_fp32 = pick(0, 1);
  c.aux_fp32 = pick(0, 1);
  c.padding = pick(0, 1);
  c.aux = pick(0, 2) > 0;
  c.z = pick(0, 1);
  c.drop = pick(0, 2);
  c.T = pick(1, 40);
  if (seed % 25 == 0) {  // several blocks: each counts the z-loss's non-padding tokens itself
    c.T = pick(257, 700);
    c.z = c.padding = true;
  }
  return c;
}

// k distinct random experts per token.
ref::BoolMat random_selection(std::mt19937_64& rng, std::int64_t T, int E, int topk) {
  ref::BoolMat s = ref::BoolMat::Constant(T, E, false);
  for (std::int64_t t = 0; t < T; ++t)
    for (int chosen = 0; chosen < topk;) {
      const int e = std::uniform_int_distribution<int>(0, E - 1)(rng);
      if (s(t, e)) continue;
      s(t, e) = true;
      ++chosen;
    }
  return s;
}

}  // namespace

// router_topk_backward equals topk_routing_backward(dprobs * routing_map) [+ aux_scores_backward]
// [+ z_loss_backward] (each sum stored in the router dtype) over random configurations: every
// router dtype, score function, pre / post softmax, scaling factor, both MegatronSwitches
// settings, padding, a capacity drop (the map a subset of the choice) or padding to capacity (the
// map any pairs: the choice's mask still applies).
TEST(MoERouterBackward, TopkBackwardEqualsReferenceSteps) {
  const auto start = std::chrono::steady_clock::now();
  int ran = 0;
  for (std::uint64_t seed = 1; seed <= 300; ++seed) {
    const BackwardCase c = random_backward_case(seed);
    const std::string id = c.id();
    if (!twin::test::selected(id)) continue;
    SCOPED_TRACE(id);
    ++ran;
    std::mt19937_64 rng(seed * 7919 + 3);
    BackwardInputs in;
    in.dt = c.dt;
    in.topk = c.topk;
    in.score = c.score;
    in.pre_softmax = c.pre_softmax;
    in.scaling = c.scaling;
    in.scores_fp32 = c.scores_fp32;
    in.aux_fp32 = c.aux_fp32;
    in.logits = to_mat(twin::test::random_tensor(c.dt, {c.T, c.E}, -3.0, 3.0, seed), c.T, c.E);
    in.dprobs = to_mat(twin::test::random_tensor(c.dt, {c.T, c.E}, -1.0, 1.0, seed + 1000), c.T, c.E);
    in.selected = random_selection(rng, c.T, c.E, c.topk);
    in.routing_map = in.selected;
    for (std::int64_t t = 0; t < c.T; ++t)
      for (int e = 0; e < c.E; ++e) {
        if (c.drop == 1 && in.selected(t, e) && rng() % 3 == 0) in.routing_map(t, e) = false;
        if (c.drop == 2) in.routing_map(t, e) = rng() % 2 == 0;
      }
    if (c.padding) {
      std::vector<bool> pad(std::size_t(c.T), false);
      for (std::int64_t t = 0; t < c.T; ++t) pad[std::size_t(t)] = rng() % 3 == 0;
      in.padding = pad;
    }
    if (c.aux) {
      // values of the aux scores' dtype (fp64 ones held in fp32, as the kernel's buffer), padding rows 0
      const DType adt =
          k::router_aux_scores_dtype(c.dt == DType::F64 ? DType::F32 : c.dt, score_fn(c.score), c.aux_fp32);
      ref::Mat g = to_mat(twin::test::random_tensor(adt, {c.T, c.E}, -1.0, 1.0, seed + 2000), c.T, c.E);
      if (in.padding)
        for (std::int64_t t = 0; t < c.T; ++t)
          if ((*in.padding)[std::size_t(t)]) g.row(t).setZero();
      in.aux_grad = g;
    }
    if (c.z) in.z_coeff = seed % 2 ? 0.5 : 1e-3;
    check_topk_backward(in, id);
    if (HasFailure()) return;
  }
  EXPECT_GT(ran, 0) << "TWIN_OP_CASE selected no case";
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf(
      "[ info ] %d router backward cases in %.2f s: %ld of %ld d logits not bitwise equal, worst error %.3g of "
      "the bound\n",
      ran, seconds, g_stats.differing, g_stats.compared, g_stats.worst);
}

// router_aux_scores_grad equals the reference's saved.aux_scores_grad (TopKRouter::forward with
// RouterSaved; global_aux_loss after a second forward, its tokens per expert averaged over both)
// bit for bit, for aux_loss, seq_aux_loss and global_aux_loss, with and without padding, every
// score function and both MegatronSwitches settings; then, on the same saved forward,
// router_topk_backward against the reference's composition, and the two launchers' counts plus the
// gating GEMM's equal to the rounding points TopKRouter::backward counts.
TEST(MoERouterBackward, AuxScoresGradEqualsReferenceRouter) {
  int ran = 0;
  for (std::uint64_t seed = 1; seed <= 120; ++seed) {
    std::mt19937_64 rng(seed);
    auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
    const char* kinds[] = {"aux_loss", "seq_aux_loss", "global_aux_loss"};
    const std::string kind = kinds[seed % 3];
    const int E = pick(2, 16), topk = pick(1, std::min(E, 4));
    const char* scores[] = {"softmax", "sigmoid", "sqrtsoftplus"};
    const std::string score = scores[pick(0, 2)];
    const DType pdts[] = {DType::F32, DType::BF16, DType::F16};
    const DType pdt = pdts[pick(0, 2)];
    const char* rdts[] = {"", "fp32", "fp64"};
    const std::string rdt_opt = rdts[pick(0, 2)];
    const bool switches = pick(0, 1), padded = pick(0, 1), z = pick(0, 1), scale = pick(0, 1);
    const std::int64_t s = pick(1, 8), b = pick(1, 4), T = s * b;
    const std::string id = fmt::format(
        "router_aux_grad(loss={},E={},k={},score={},params={},router_dtype={},megatron={},pad={},z={},scale={},"
        "s={},b={},seed={})",
        kind, E, topk, score, dtn(pdt), rdt_opt.empty() ? "None" : rdt_opt, switches ? "d98e8a64" : "93ddc247",
        int(padded), int(z), int(scale), s, b, seed);
    if (!twin::test::selected(id)) continue;
    SCOPED_TRACE(id);
    ++ran;

    TransformerConfig cfg = reference::moe::testing::small_moe_config(E, topk);
    cfg.moe_router_load_balancing_type = kind;
    cfg.moe_router_score_function = score;
    cfg.moe_router_pre_softmax = score == "softmax" && pick(0, 1);
    cfg.megatron.router_scores_fp32 = cfg.megatron.aux_loss_scores_fp32 = switches;
    cfg.megatron.sqrtsoftplus = score == "sqrtsoftplus";
    if (!rdt_opt.empty()) cfg.moe_router_dtype = rdt_opt;
    if (z) cfg.moe_z_loss_coeff = 0.1;
    if (scale) cfg.moe_router_topk_scaling_factor = 2.5;
    if (pick(0, 1)) cfg.moe_expert_capacity_factor = 1.0;
    const reference::Precision prec{reference::ComputeMode::FP32, pdt};
    ref::TopKRouter router(cfg, prec);
    const DType rdt = router.router_dtype();
    reference::StateDict sd;
    std::normal_distribution<double> normal(0.0, 1.0);
    std::vector<double> w(std::size_t(E) * cfg.hidden_size);
    for (double& v : w) v = normal(rng);
    sd.set("weight", Tensor::from_doubles(DType::F64, {E, cfg.hidden_size}, w));
    router.load_state_dict(sd, "");
    auto input = [&] {
      ref::Mat x(T, cfg.hidden_size);
      for (std::int64_t i = 0; i < x.size(); ++i) x.data()[i] = normal(rng);
      return to_mat(from_mat(pdt, x), T, cfg.hidden_size);  // values of the params dtype
    };
    std::vector<bool> pad(std::size_t(T), false);
    for (std::int64_t t = 0; t < T; ++t) pad[std::size_t(t)] = padded && rng() % 3 == 0;
    if (kind == "global_aux_loss") router.forward(input(), s, b, padded ? &pad : nullptr, reference::Taps(), nullptr);
    ref::RouterSaved saved;
    router.forward(input(), s, b, padded ? &pad : nullptr, reference::Taps(), nullptr, nullptr, &saved);
    ASSERT_TRUE(saved.aux_scores_grad.has_value());

    // ---- router_aux_scores_grad on the saved forward's aux map (the reference's own function)
    const ref::Rounding rnd{false};
    const ref::AuxScores ax = ref::compute_routing_scores_for_aux_loss(saved.logits, topk, score, switches,
                                                                       padded ? &pad : nullptr, rdt, rnd);
    rt::DeviceBuffer d_aux_map = bool_to_device(ax.routing_map), d_pad = mask_to_device(pad);
    rt::DeviceBuffer d_global =
        twin::test::to_device(Tensor::from_doubles(DType::F64, {E}, router.global_tokens_per_expert));
    rt::DeviceBuffer d_grad(sim(), std::size_t(T * E) * 4), d_scratch(sim(), std::size_t(2 * b * E) * 8);
    k::LossArgs la;
    la.kind = kind == "aux_loss"       ? twin::opt::AuxLossKind::AuxLoss
              : kind == "seq_aux_loss" ? twin::opt::AuxLossKind::SeqAuxLoss
                                       : twin::opt::AuxLossKind::GlobalAuxLoss;
    la.tokens = T;
    la.experts = E;
    la.bsz = static_cast<int>(b);
    la.topk = topk;
    la.with_padding_mask = padded;
    la.coeff = cfg.moe_aux_loss_coeff;
    la.global_tokens = d_global.as<double>();
    la.ga_steps = router.ga_steps;
    auto run_aux = [&] {
      k::router_aux_scores_grad(rdt, d_aux_map.as<std::uint8_t>(), padded ? d_pad.as<std::uint8_t>() : nullptr, &la, 1,
                                score_fn(score), switches, d_grad.as<float>(), d_scratch.as<double>(), nullptr);
    };
    const RoundingCount aux_count = counted(run_aux);
    EXPECT_TRUE(aux_count.none()) << "router_aux_scores_grad counts " << aux_count.describe()
                                  << ": the reference counts its stores with the losses, not the backward";
    const Tensor grad = twin::test::from_device(d_grad, DType::F32, {T, E});
    run_aux();
    EXPECT_TRUE(same_bits(grad, twin::test::from_device(d_grad, DType::F32, {T, E})))
        << "aux scores grad differs between two runs";
    for (std::int64_t i = 0; i < T * E; ++i) {
      // exact; an fp64 aux scores dtype's values held in the fp32 buffer
      const double want = static_cast<float>(saved.aux_scores_grad->data()[i]);
      ASSERT_EQ(grad.at_f64(i), want) << "aux scores grad at token " << i / E << " expert " << i % E;
    }

    // ---- router_topk_backward on the saved forward, and the counts against TopKRouter::backward
    const ref::Mat dprobs = to_mat(twin::test::random_tensor(rdt, {T, E}, -1.0, 1.0, seed + 5), T, E);
    BackwardInputs in;
    in.dt = rdt;
    in.topk = topk;
    in.score = score;
    in.pre_softmax = cfg.moe_router_pre_softmax;
    in.scaling = cfg.moe_router_topk_scaling_factor.value_or(0.0);
    in.scores_fp32 = in.aux_fp32 = switches;
    in.logits = saved.logits;
    in.dprobs = dprobs;
    in.routing_map = saved.routing_map;
    in.selected = saved.selected;
    in.aux_grad = to_mat(grad, T, E);
    if (padded) in.padding = pad;
    if (saved.z_loss) in.z_coeff = *cfg.moe_z_loss_coeff;
    RoundingCount opt_count = check_topk_backward(in, id);
    const RoundingCount ref_count = counted([&] { router.backward(dprobs, saved); });
    {
      CountRoundings scope;  // plus the gating GEMM's, as the reference counts it
      rounding_set(opt_count);
      rounding_reduce(std::max<std::int64_t>(E, T));
      rounding_store(rdt);
      rounding_store(pdt);
      opt_count = rounding_now();
    }
    EXPECT_EQ(opt_count, ref_count) << "counted " << opt_count.describe() << ", the reference " << ref_count.describe();
    if (HasFailure()) return;
  }
  EXPECT_GT(ran, 0) << "TWIN_OP_CASE selected no case";
}

// The launchers' preconditions name the op and what is wrong.
TEST(MoERouterBackward, LaunchersRejectBadArguments) {
  k::RouterBackwardArgs a;
  a.tokens = 1;
  a.experts = 0;
  rt::DeviceBuffer buf(sim(), 64);
  EXPECT_THROW(k::router_topk_backward(DType::F32, buf.get(), buf.get(), buf.as<std::uint8_t>(), buf.as<std::uint8_t>(),
                                       nullptr, nullptr, buf.get(), a, nullptr),
               std::invalid_argument);
  a.experts = 4;
  a.topk = 5;
  EXPECT_THROW(k::router_topk_backward(DType::F32, buf.get(), buf.get(), buf.as<std::uint8_t>(), buf.as<std::uint8_t>(),
                                       nullptr, nullptr, buf.get(), a, nullptr),
               std::invalid_argument);
  k::LossArgs la;
  la.kind = twin::opt::AuxLossKind::SeqAuxLoss;
  la.tokens = 3;
  la.experts = 4;
  la.bsz = 2;
  la.coeff = 0.01;
  EXPECT_THROW(
      k::router_aux_scores_grad(DType::F32, buf.as<std::uint8_t>(), nullptr, &la, 1, twin::opt::ScoreFunction::Softmax,
                                false, buf.as<float>(), buf.as<double>(), nullptr),
      std::invalid_argument);
}
