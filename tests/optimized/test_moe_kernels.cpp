// The optimized MoE kernels (optimized/moe/*.cuh) against the reference's step-by-step MoE
// functions (reference/moe/moe_utils.h), on the CUDA simulator, in the style of ggml's
// test_topk_moe: random configurations, each with a canonical case id printed on failure
// (TWIN_OP_CASE=<id> reruns one).
//
// What must be exact: routing maps, aux-loss maps, tokens per expert, the capacity drop (a
// selection: it copies values) and permute / unpermute (copies, and sums in the reference's order
// with the reference's rounding points; each sum is one IEEE addition rounded to fp32 then T,
// which equals rounding the exact sum to T: Figueroa's double-rounding bound, see test_ops.cpp).
// What is within a bound: probabilities and aux scores, where the kernel calls fp32 expf and
// divides in fp32 where the reference computes in double and rounds once (op_bound below).
#include <gtest/gtest.h>

#include <cmath>
#include <fmt/format.h>
#include <limits>
#include <random>

#include "optimized/moe/router.cuh"
#include "optimized/moe/token_dispatcher.cuh"
#include "parity/bounds.h"
#include "reference/moe/moe_utils.h"
#include "tests/optimized/sim_util.h"

using namespace twin;
namespace ref = twin::reference::moe;
namespace k = twin::opt::sim;
using twin::test::sim;

namespace {

struct RouterCase {
  DType dt = DType::F32;
  int E = 4, topk = 2;
  std::string score = "softmax";
  bool pre_softmax = false;
  int num_groups = 0, group_topk = 0;
  double scaling = 0.0;
  bool expert_bias = false;
  bool given_selection = false;  // a golden's top-k choice (random here) instead of the top-k's
  bool current = false;          // Megatron-Core d98e8a64's switches (fp32 scores; sqrtsoftplus), else the pin's
  std::int64_t T = 16;
  std::uint64_t seed = 0;
  std::string id() const {
    return fmt::format(
        "router(dtype={},E={},k={},score={},pre={},groups={},gtopk={},scale={},bias={},sel={},T={},megatron={},seed={}"
        ")",
        twin::test::dt_name(dt), E, topk, score, pre_softmax ? 1 : 0, num_groups, group_topk, scaling,
        expert_bias ? 1 : 0, given_selection ? 1 : 0, T, current ? "d98e8a64" : "93ddc247", seed);
  }
};

RouterCase random_case(std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  RouterCase c;
  c.seed = seed;
  c.dt = pick(0, 1) ? DType::BF16 : DType::F32;
  c.E = pick(2, 12);
  c.topk = pick(1, std::min(c.E, 4));
  c.score = pick(0, 1) ? "sigmoid" : "softmax";
  c.pre_softmax = c.score == "softmax" && pick(0, 1);
  if (pick(0, 2) == 0) {
    std::vector<int> divisors;
    for (int g = 2; g <= c.E; ++g)
      if (c.E % g == 0) divisors.push_back(g);
    if (!divisors.empty()) {
      const int G = divisors[std::size_t(pick(0, int(divisors.size()) - 1))], gk = pick(1, G);
      if (c.topk <= gk * (c.E / G)) {
        c.num_groups = G;
        c.group_topk = gk;
      }
    }
  }
  if (pick(0, 2) == 0) c.scaling = 2.5;
  c.expert_bias = c.score == "sigmoid" && pick(0, 1);
  c.T = pick(1, 40);
  c.given_selection = pick(0, 3) == 0;
  c.current = pick(0, 1);
  if (c.current && c.score == "sigmoid" && pick(0, 1)) c.score = "sqrtsoftplus";
  return c;
}

ref::Mat to_mat(const Tensor& t, std::int64_t rows, std::int64_t cols) {
  ref::Mat m(rows, cols);
  for (std::int64_t i = 0; i < rows * cols; ++i) m.data()[i] = t.at_f64(i);
  return m;
}

}  // namespace

// The fused router kernel equals topk_routing_with_score_function (and the aux-loss scores equal
// compute_routing_scores_for_aux_loss) over random configurations.
TEST(MoEKernels, FusedRouterEqualsReferenceSteps) {
  int ran = 0;
  for (std::uint64_t seed = 1; seed <= 400; ++seed) {
    const RouterCase c = random_case(seed);
    const std::string id = c.id();
    if (!twin::test::selected(id)) continue;
    SCOPED_TRACE(id);
    ++ran;
    const Tensor logits = twin::test::random_tensor(c.dt, {c.T, c.E}, -3.0, 3.0, c.seed);  // values of dtype dt
    std::vector<double> eb;
    std::mt19937_64 rng(c.seed + 7);
    std::uniform_real_distribution<double> u(-0.2, 0.2);
    for (int e = 0; e < c.E; ++e) eb.push_back(static_cast<float>(u(rng)));
    std::vector<std::uint8_t> pad(std::size_t(c.T), 0);
    for (std::int64_t t = 0; t < c.T; t += 3) pad[std::size_t(t)] = 1;  // every third token is padding

    // A given selection: k distinct random experts per token.
    ref::BoolMat selection = ref::BoolMat::Constant(c.T, c.E, false);
    for (std::int64_t t = 0; t < c.T; ++t)
      for (int chosen = 0; chosen < c.topk;) {
        const int e = std::uniform_int_distribution<int>(0, c.E - 1)(rng);
        if (selection(t, e)) continue;
        selection(t, e) = true;
        ++chosen;
      }
    std::vector<bool> sel_bits(selection.data(), selection.data() + selection.size());
    rt::DeviceBuffer d_sel = twin::test::to_device(Tensor::from_vector<bool>({c.T, c.E}, sel_bits));

    // ---- the kernel
    k::RouterArgs a;
    if (c.given_selection) a.selection = d_sel.as<std::uint8_t>();
    a.tokens = c.T;
    a.experts = c.E;
    a.topk = c.topk;
    a.score = c.score == "sigmoid"        ? twin::opt::ScoreFunction::Sigmoid
              : c.score == "sqrtsoftplus" ? twin::opt::ScoreFunction::SqrtSoftplus
                                          : twin::opt::ScoreFunction::Softmax;
    a.scores_fp32 = a.aux_scores_fp32 = c.current;
    a.pre_softmax = c.pre_softmax;
    a.num_groups = c.num_groups;
    a.group_topk = c.group_topk;
    a.scaling_factor = static_cast<float>(c.scaling);
    a.aux_scores = true;
    a.z_loss = true;
    const std::size_t n = std::size_t(c.T * c.E);
    rt::DeviceBuffer d_logits = twin::test::to_device(logits);
    rt::DeviceBuffer d_bias = twin::test::to_device(Tensor::from_doubles(DType::F32, {c.E}, eb));
    rt::DeviceBuffer d_pad =
        twin::test::to_device(Tensor::from_vector<bool>({c.T}, std::vector<bool>(pad.begin(), pad.end())));
    rt::DeviceBuffer d_probs(sim(), n * dtype_size(c.dt)), d_map(sim(), n), d_aux(sim(), n * 4), d_aux_map(sim(), n),
        d_z(sim(), std::size_t(c.T) * 4);
    k::router_topk_forward(c.dt, d_logits.get(), c.expert_bias ? d_bias.as<float>() : nullptr, d_pad.as<std::uint8_t>(),
                           d_probs.get(), d_map.as<std::uint8_t>(), d_aux.as<float>(), d_aux_map.as<std::uint8_t>(),
                           d_z.as<float>(), a, nullptr);
    const Tensor probs = twin::test::from_device(d_probs, c.dt, {c.T, c.E});
    const Tensor map = twin::test::from_device(d_map, DType::BOOL, {c.T, c.E});
    const Tensor aux = twin::test::from_device(d_aux, DType::F32, {c.T, c.E});
    const Tensor aux_map = twin::test::from_device(d_aux_map, DType::BOOL, {c.T, c.E});

    // ---- the reference, step by step
    const ref::Rounding rnd{false};
    ref::RoutingOptions opt;
    opt.topk = c.topk;
    opt.use_pre_softmax = c.pre_softmax;
    if (c.group_topk) {
      opt.num_groups = c.num_groups;
      opt.group_topk = c.group_topk;
    }
    if (c.scaling != 0.0) opt.scaling_factor = c.scaling;
    opt.score_function = c.score;
    opt.scores_fp32 = c.current;
    if (c.given_selection) opt.selection = &selection;
    const ref::Mat L = to_mat(logits, c.T, c.E);
    const ref::Routing r = ref::topk_routing_with_score_function(L, opt, c.expert_bias ? &eb : nullptr, c.dt, rnd);
    std::vector<bool> padding(pad.begin(), pad.end());
    const ref::AuxScores ax =
        ref::compute_routing_scores_for_aux_loss(L, c.topk, c.score, c.current, &padding, c.dt, rnd);

    // Bound on probabilities: both compute the same formula from the same logits; the kernel's
    // fp32 expf and division may each be an ulp off where the reference rounds the exact value
    // once (3 stores: exp, division, the store in the router dtype), plus the renormalisation's
    // three stores and the scaling's one, and an fp32 sum over the E experts; relative to the
    // probability scale (<= 1, x the scaling factor). Megatron-Core d98e8a64 holds them in fp32 and
    // stores once in the router dtype: one store in dt, the rest in fp32.
    const bool sigmoid_path = c.score != "softmax";
    const int stores =
        3 + (sigmoid_path && c.topk > 1 ? 3 : 0) + (c.scaling != 0.0 ? 1 : 0) + (c.score == "sqrtsoftplus" ? 1 : 0);
    const double scale = c.scaling != 0.0 ? c.scaling : 1.0;
    Tolerance tol = parity::op_bound(c.dt, c.current ? 1 : stores, c.E, scale);
    if (c.current) {
      const Tolerance in_fp32 = parity::op_bound(DType::F32, stores, c.E, scale);
      tol.atol += in_fp32.atol;
      tol.rtol += in_fp32.rtol;
    }
    for (std::int64_t i = 0; i < c.T * c.E; ++i) {
      ASSERT_EQ(map.at_f64(i) != 0.0, r.routing_map.data()[i])
          << "routing_map at token " << i / c.E << " expert " << i % c.E;
      if (c.given_selection) ASSERT_EQ(r.routing_map.data()[i], selection.data()[i]) << "the given selection at " << i;
      ASSERT_LE(std::abs(probs.at_f64(i) - r.probs.data()[i]), tol.atol + tol.rtol * std::abs(r.probs.data()[i]))
          << "probs at " << i << ": " << tol.reason;
      ASSERT_EQ(aux_map.at_f64(i) != 0.0, ax.routing_map.data()[i]) << "aux routing_map at " << i;
      // The aux scores: fp32 softmax (stored in fp32) or the normalised sigmoid path (four stores in
      // dt; in fp32 at d98e8a64, one more for sqrtsoftplus).
      const Tolerance at = !sigmoid_path ? parity::op_bound(DType::F32, 3, c.E, 1.0)
                           : c.current   ? parity::op_bound(DType::F32, c.score == "sqrtsoftplus" ? 5 : 4, c.E, 1.0)
                                         : parity::op_bound(c.dt, 4, c.E, 1.0);
      ASSERT_LE(std::abs(aux.at_f64(i) - ax.scores.data()[i]), at.atol + at.rtol * std::abs(ax.scores.data()[i]))
          << "aux scores at " << i << ": " << at.reason;
    }
  }
  EXPECT_GT(ran, 0) << "TWIN_OP_CASE selected no case";
}

// The capacity drop equals apply_router_token_dropping on the same routing (it selects and copies:
// exact), for both policies, with and without padding to capacity, capacity below and above T.
TEST(MoEKernels, CapacityDropEqualsReference) {
  for (std::uint64_t seed = 1; seed <= 120; ++seed) {
    RouterCase c = random_case(seed);
    c.group_topk = c.num_groups = 0;
    const double factor = 0.25 * double(1 + seed % 8);
    const std::string policy = seed % 2 ? "probs" : "position";
    const bool pad = seed % 3 == 0;
    const std::string id = c.id() + fmt::format("+capacity(factor={},policy={},pad={})", factor, policy, pad);
    if (!twin::test::selected(id)) continue;
    SCOPED_TRACE(id);
    const Tensor logits = twin::test::random_tensor(c.dt, {c.T, c.E}, -3.0, 3.0, c.seed);
    ref::RoutingOptions opt;
    opt.topk = c.topk;
    opt.score_function = c.score;
    opt.use_pre_softmax = c.pre_softmax;
    const ref::Rounding rnd{false};
    const ref::Routing r = ref::topk_routing_with_score_function(to_mat(logits, c.T, c.E), opt, nullptr, c.dt, rnd);
    const ref::Routing want = ref::apply_router_token_dropping(r, c.topk, factor, policy, pad);
    std::vector<double> pv(r.probs.data(), r.probs.data() + r.probs.size());
    std::vector<std::uint8_t> mv(r.routing_map.data(), r.routing_map.data() + r.routing_map.size());
    rt::DeviceBuffer d_probs = twin::test::to_device(Tensor::from_doubles(c.dt, {c.T, c.E}, pv));
    rt::DeviceBuffer d_map =
        twin::test::to_device(Tensor::from_vector<bool>({c.T, c.E}, std::vector<bool>(mv.begin(), mv.end())));
    const std::size_t n = std::size_t(c.T * c.E);
    rt::DeviceBuffer o_probs(sim(), n * dtype_size(c.dt)), o_map(sim(), n);
    k::router_capacity_forward(c.dt, d_probs.get(), d_map.as<std::uint8_t>(), o_probs.get(), o_map.as<std::uint8_t>(),
                               c.T, c.E, k::expert_capacity(c.T * c.topk, c.E, factor), policy, pad, nullptr);
    const Tensor probs = twin::test::from_device(o_probs, c.dt, {c.T, c.E});
    const Tensor map = twin::test::from_device(o_map, DType::BOOL, {c.T, c.E});
    for (std::int64_t i = 0; i < c.T * c.E; ++i) {
      ASSERT_EQ(map.at_f64(i) != 0.0, want.routing_map.data()[i])
          << "map at token " << i / c.E << " expert " << i % c.E;
      ASSERT_EQ(probs.at_f64(i), want.probs.data()[i]) << "probs at " << i;
    }
  }
}

// Permute and unpermute around the row-id map equal the reference's permute / unpermute bit for
// bit (copies, and the combine's sums in the reference's order and rounding points).
TEST(MoEKernels, PermuteUnpermuteEqualReference) {
  for (std::uint64_t seed = 1; seed <= 100; ++seed) {
    RouterCase c = random_case(seed);
    const std::int64_t H = 1 + std::int64_t(seed % 37);
    const std::string id = fmt::format("permute(dtype={},E={},k={},T={},H={},seed={})", twin::test::dt_name(c.dt), c.E,
                                       c.topk, c.T, H, seed);
    if (!twin::test::selected(id)) continue;
    SCOPED_TRACE(id);
    const Tensor logits = twin::test::random_tensor(DType::F32, {c.T, c.E}, -3.0, 3.0, seed);
    const ref::TopK top = ref::topk_rows(to_mat(logits, c.T, c.E), c.topk);
    ref::BoolMat rmap = ref::BoolMat::Constant(c.T, c.E, false);
    for (std::int64_t t = 0; t < c.T; ++t)
      for (int j = 0; j < c.topk; ++j) rmap(t, top.indices(t, j)) = true;
    if (seed % 4 == 0) rmap.row(0).setConstant(false);  // a dropped token: routed nowhere
    const Tensor tokens = twin::test::random_tensor(c.dt, {c.T, H}, -2.0, 2.0, seed + 1);
    const Tensor probs = twin::test::random_tensor(DType::F32, {c.T, c.E}, 0.0, 1.0, seed + 2);

    std::vector<std::uint8_t> mv(rmap.data(), rmap.data() + rmap.size());
    rt::DeviceBuffer d_map =
        twin::test::to_device(Tensor::from_vector<bool>({c.T, c.E}, std::vector<bool>(mv.begin(), mv.end())));
    rt::DeviceBuffer d_tpe(sim(), c.E * 8), d_off(sim(), (c.E + 1) * 8), d_rows(sim(), c.T * c.E * 8);
    k::build_row_id_map(d_map.as<std::uint8_t>(), c.T, c.E, d_tpe.as<std::int64_t>(), d_off.as<std::int64_t>(),
                        d_rows.as<std::int64_t>(), nullptr);
    std::vector<std::int64_t> tpe(std::size_t(c.E));
    d_tpe.download(tpe.data(), tpe.size() * 8);
    std::int64_t N = 0;
    for (int e = 0; e < c.E; ++e) {
      ASSERT_EQ(tpe[std::size_t(e)], rmap.col(e).count()) << "tokens_per_expert[" << e << "]";
      N += tpe[std::size_t(e)];
    }
    rt::DeviceBuffer d_tok = twin::test::to_device(tokens), d_probs = twin::test::to_device(probs);
    rt::DeviceBuffer d_perm(sim(), std::size_t(std::max<std::int64_t>(N, 1) * H) * dtype_size(c.dt)),
        d_pp(sim(), std::size_t(std::max<std::int64_t>(N, 1)) * 4),
        d_out(sim(), std::size_t(c.T * H) * dtype_size(c.dt));
    k::permute_forward(c.dt, DType::F32, d_tok.get(), d_rows.as<std::int64_t>(), d_probs.get(), d_perm.get(),
                       d_pp.get(), c.T, c.E, H, N, nullptr);
    const Tensor perm = twin::test::from_device(d_perm, c.dt, {N, H});
    const Tensor pp = twin::test::from_device(d_pp, DType::F32, {N});

    const ref::Mat pm = to_mat(probs, c.T, c.E);
    const ref::Permuted want = ref::permute(to_mat(tokens, c.T, H), rmap, &pm, std::nullopt, false);
    ASSERT_EQ(want.tokens.rows(), N);
    for (std::int64_t i = 0; i < N * H; ++i) ASSERT_EQ(perm.at_f64(i), want.tokens.data()[i]) << "permuted at " << i;
    for (std::int64_t i = 0; i < N; ++i) ASSERT_EQ(pp.at_f64(i), want.probs[std::size_t(i)]) << "permuted prob " << i;

    // unpermute of the permuted rows (scaled, so the sums round): the reference's scatter-add
    const Tensor expert_out = twin::test::random_tensor(c.dt, {N, H}, -2.0, 2.0, seed + 3);
    rt::DeviceBuffer d_eo = twin::test::to_device(expert_out);
    k::unpermute_forward(c.dt, d_eo.get(), d_rows.as<std::int64_t>(), d_out.get(), c.T, c.E, H, N, nullptr);
    const Tensor out = twin::test::from_device(d_out, c.dt, {c.T, H});
    const ref::Mat back =
        ref::unpermute(to_mat(expert_out, N, H), want.sorted_indices, c.T, c.dt, ref::Rounding{false});
    for (std::int64_t i = 0; i < c.T * H; ++i) ASSERT_EQ(out.at_f64(i), back.data()[i]) << "unpermuted at " << i;
  }
}

// The permutation's index arithmetic is 64-bit: at sizes past 2^31 elements (not allocated) every
// index equals the exact value, where 32-bit arithmetic would wrap.
TEST(MoEKernels, PermuteIndexArithmeticPast2Pow31) {
  using PI = k::PermuteIndex;
  const std::int64_t two31 = std::int64_t(1) << 31;
  // A production-sized step: 2^28 tokens x top-8 = 2^31 permuted rows, hidden 7168.
  const std::int64_t T = std::int64_t(1) << 28, E = 256, H = 7168, N = T * 8;
  ASSERT_GE(N, two31);
  const __int128 exact_slot = (__int128)(E - 1) * T + (T - 1);
  EXPECT_EQ((__int128)PI::map_slot(E - 1, T - 1, T), exact_slot);
  EXPECT_GT(exact_slot, (__int128)std::numeric_limits<std::int32_t>::max());
  const __int128 exact_elem = (__int128)(N - 1) * H + (H - 1);
  EXPECT_EQ((__int128)PI::element(N - 1, H, H - 1), exact_elem);
  EXPECT_GT(exact_elem, (__int128)std::numeric_limits<std::uint32_t>::max());
  // The last expert's rows start past 2^31 and its j-th row is offset + j.
  const std::int64_t offsets[3] = {0, two31 + 5, N};
  EXPECT_EQ(PI::row(offsets, 1, 12345), two31 + 5 + 12345);
  EXPECT_EQ((__int128)PI::element(PI::row(offsets, 1, 12345), H, 3), ((__int128)two31 + 5 + 12345) * H + 3);
  // A 32-bit computation of the same element would have wrapped: the test can tell them apart.
  const std::int32_t wrapped =
      static_cast<std::int32_t>(static_cast<std::uint32_t>(N - 1) * static_cast<std::uint32_t>(H));
  EXPECT_NE((__int128)wrapped, (__int128)(N - 1) * H);
}
