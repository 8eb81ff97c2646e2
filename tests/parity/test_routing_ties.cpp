// Routing decided on a near tie (parity/routing_ties.h): a finding the engine reports and compares
// past on the golden's routing, for both twins; a routing map changed far from any tie still fails.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "core/dtype.h"
#include "core/safetensors.h"
#include "parity/fixture_kinds.h"
#include "parity/routing_ties.h"
#include "tests/core/corrupt_safetensors.h"

using namespace twin;

namespace {

// Real Megatron-Core, bf16, top-3 of 6 experts with pre-softmax scores in an fp32 router: token 12's
// logits for experts 2 and 5 lie 2e-4 apart, and upstream bf16 roundings move the twins' pair across.
const std::string kNearTie = "moe_bf16_top3_near_tie_flip.safetensors";

Fixture golden(const std::string& name) { return load_fixture(twin::golden_dir() + "/" + name); }

// A golden beside the one-rank ones that not every twin runs in full (fixtures/megatron-core-partial/).
const std::string kSinkhornNearTie = "d98e8a64_moe_bf16_sinkhorn_top1_near_tie.safetensors";
Fixture partial_golden(const std::string& name) {
  return load_fixture(std::filesystem::path(twin::golden_dir()).parent_path().string() + "/megatron-core-partial/" +
                      name);
}

struct Compared {
  std::vector<Comparison> rows;
  std::string grads, routing;
};

// The golden `f` with its routing map (tap.mlp.router.1) replaced by `map`, written into `dir`.
Fixture with_routing_map(const Fixture& f, const std::vector<double>& map, const twin::testing::TempDir& dir) {
  const SafetensorsFile src = read_safetensors(f.path);
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (const auto& n : src.names())
    tensors.emplace_back(
        n, n == "tap.mlp.router.1" ? Tensor::from_doubles(DType::BOOL, f.tensor(n).shape(), map) : src.at(n));
  const std::string path = dir.file("changed_map.safetensors");
  write_safetensors(path, tensors, src.metadata());
  return load_fixture(path);
}

Compared compare(const Fixture& f, TwinKind twin) {
  Compared c;
  c.rows = compare_fixture(find_fixture_handler(f.kind, twin), f, twin, RunMode{}, &c.grads, &c.routing);
  return c;
}

}  // namespace

// The golden's own logits say the flip is a near tie, independently of any twin: the two experts'
// logits differ by less than the bf16 rounding of a value of their size (u = 2^-8 x 0.24).
TEST(RoutingTies, TheGoldensFlippedTokenIsANearTieInItsOwnLogits) {
  const Fixture f = golden(kNearTie);
  const Tensor& logits = f.tensor("tap.mlp.router.logits");
  const std::int64_t E = 6, t = 12;
  const double l2 = logits.at_f64(t * E + 2), l5 = logits.at_f64(t * E + 5);
  EXPECT_LT(std::fabs(l2 - l5), std::ldexp(1.0, -8) * std::fabs(l5)) << l2 << " " << l5;
  const Tensor& map = f.tensor("tap.mlp.router.1");
  EXPECT_NE(map.at_f64(t * E + 2) != 0.0, map.at_f64(t * E + 5) != 0.0) << "one of the two is chosen";
}

// Both twins choose the other expert of the pair on token 12; the engine reports it and compares
// the experts, the combine, the output and (reference) the gradients on the golden's routing.
TEST(RoutingTies, NearTieFlipIsReportedAndComparedOnTheGoldensRouting) {
  const Fixture f = golden(kNearTie);
  for (const TwinKind twin : {TwinKind::Reference, TwinKind::Optimized}) {
    SCOPED_TRACE(twin_kind_name(twin));
    const TwinRun own = find_fixture_handler(f.kind, twin)(f, RunMode{});
    const auto flips = parity::routing_flips(f, own.record);
    ASSERT_TRUE(flips.has_value()) << "the twin's own routing equals the golden's: the golden no longer tests this";
    EXPECT_EQ(flips->tokens, 1);
    EXPECT_EQ(flips->near, std::vector<std::int64_t>{12});
    const Compared c = compare(f, twin);
    EXPECT_EQ(c.routing, "differs on 1 near-tie token (12): compared downstream on the golden's routing");
    for (const Comparison& row : c.rows) EXPECT_TRUE(row.pass) << row.name << " " << row.message;
    const auto has = [&](const std::string& name) {
      return std::any_of(c.rows.begin(), c.rows.end(), [&](const Comparison& r) { return r.name == name; });
    };
    EXPECT_TRUE(has("tap.mlp.router.1"));
    EXPECT_TRUE(has("output.hidden_states"));
    if (twin == TwinKind::Reference) {
      EXPECT_EQ(c.grads, "compared");
      EXPECT_TRUE(has("grad.param.mlp.router.weight"));
    }
  }
}

// The golden's map moved on token 0 from its best-scored expert to its worst-scored one: no
// rounding explains that, so the comparison fails at the routing map and names the token.
TEST(RoutingTies, AMapChangedFarFromATieStillFails) {
  const Fixture f = golden(kNearTie);
  const std::int64_t E = 6;
  const Tensor& logits = f.tensor("tap.mlp.router.logits");
  std::vector<double> map = f.tensor("tap.mlp.router.1").to_f64();
  int best = -1, worst = -1;
  for (int e = 0; e < E; ++e) {
    const double l = logits.at_f64(e);
    if (map[std::size_t(e)] != 0.0 && (best < 0 || l > logits.at_f64(best))) best = e;
    if (map[std::size_t(e)] == 0.0 && (worst < 0 || l < logits.at_f64(worst))) worst = e;
  }
  ASSERT_GE(best, 0);
  ASSERT_GE(worst, 0);
  map[std::size_t(best)] = 0.0;
  map[std::size_t(worst)] = 1.0;
  twin::testing::TempDir dir;
  const Fixture far = with_routing_map(f, map, dir);
  for (const TwinKind twin : {TwinKind::Reference, TwinKind::Optimized}) {
    SCOPED_TRACE(twin_kind_name(twin));
    const Compared c = compare(far, twin);
    EXPECT_NE(c.routing.find("differs on 2 tokens; token 0 is far from a tie: the twin chose expert " +
                             std::to_string(best) + " "),
              std::string::npos)
        << c.routing;
    // The first row out of bound is the router's (its probabilities come before its map), and the
    // map's row fails.
    const auto first = std::find_if(c.rows.begin(), c.rows.end(), [](const Comparison& r) { return !r.pass; });
    ASSERT_NE(first, c.rows.end());
    EXPECT_EQ(first->name.rfind("tap.mlp.router.", 0), 0u) << first->name;
    const auto map_row =
        std::find_if(c.rows.begin(), c.rows.end(), [](const Comparison& r) { return r.name == "tap.mlp.router.1"; });
    ASSERT_NE(map_row, c.rows.end());
    EXPECT_FALSE(map_row->pass);
  }
}

// A golden whose routing the twin reproduces has nothing to report.
TEST(RoutingTies, EqualRoutingReportsNothing) {
  for (const std::string name : {"moe_top2_aux_allgather.safetensors", "moe_top2_shared_expert_swiglu.safetensors"}) {
    SCOPED_TRACE(name);
    const Compared c = compare(golden(name), TwinKind::Reference);
    EXPECT_EQ(c.routing, "");
    for (const Comparison& row : c.rows) EXPECT_TRUE(row.pass) << row.name;
  }
}

// Real Megatron-Core at ep 4 (alltoall, gathered), bf16, sigmoid top-3 of 8 with capacity factor
// 0.75: token 14's bf16 scores of experts 0 and 4 are equal at its top-k cut, torch.topk chose 4,
// and the capacity rule then kept what it kept. Each twin routes with the choice the golden's
// post-drop map shows (its own rule takes the lower index), drops, and matches every tensor.
TEST(RoutingTies, ATieAtTheTopkCutUnderCapacityIsRoutedWithTheGoldensChoice) {
  // A gathered multi-rank capture: beside the one-rank goldens, in fixtures/megatron-core-parallel/.
  const Fixture f =
      load_fixture(std::filesystem::path(twin::golden_dir()).parent_path().string() +
                   "/megatron-core-parallel/ep4_alltoall_bf16_sigmoid_top3_capacity_topk_tie.safetensors");
  const std::int64_t E = 8, t = 14;
  const Tensor& logits = f.tensor("tap.mlp.router.logits");
  // The scores as the router holds them: sigmoid in fp32, stored in bf16.
  auto score = [&](int e) {
    const float x = float(logits.at_f64(t * E + e));
    return bf16_bits_to_float(float_to_bf16_bits(1.0f / (1.0f + std::exp(-x))));
  };
  std::vector<float> s;
  for (int e = 0; e < E; ++e) s.push_back(score(e));
  std::vector<float> sorted = s;
  std::sort(sorted.rbegin(), sorted.rend());
  ASSERT_EQ(s[0], s[4]) << "experts 0 and 4 no longer tie: the golden no longer tests this";
  EXPECT_EQ(s[4], sorted[2]);  // the third largest: at the top-3 cut
  EXPECT_GT(sorted[2], sorted[4]) << "only the two tie there";
  const Tensor& map = f.tensor("tap.mlp.router.1");
  EXPECT_EQ(map.at_f64(t * E + 4), 1.0);
  EXPECT_EQ(map.at_f64(t * E + 0), 0.0);
  for (const TwinKind twin : {TwinKind::Reference, TwinKind::Optimized}) {
    SCOPED_TRACE(twin_kind_name(twin));
    const Compared c = compare(f, twin);
    ASSERT_FALSE(c.rows.empty());
    for (const Comparison& row : c.rows) EXPECT_TRUE(row.pass) << row.name << " " << row.message;
  }
}

// Real Megatron-Core (d98e8a64), bf16, training-mode sinkhorn top-1 of 3 experts: token 2's
// sinkhorn scores of experts 1 and 2 lie 2.4e-4 apart (relative), and the twin's own bf16 logits,
// within their bound of the golden's, move the reference's choice across. The near tie is judged
// in the sinkhorn's space (each side's choice the top-k of the sinkhorn of its own logits), and
// the reference routes with the golden's choice and matches every tensor.
TEST(RoutingTies, ASinkhornNearTieIsRoutedWithTheGoldensChoice) {
  const Fixture f = partial_golden(kSinkhornNearTie);
  ASSERT_EQ(f.config.moe_router_load_balancing_type, "sinkhorn");
  ASSERT_TRUE(f.training);
  const TwinRun own = find_fixture_handler(f.kind, TwinKind::Reference)(f, RunMode{});
  const auto flips = parity::routing_flips(f, own.record);
  ASSERT_TRUE(flips.has_value()) << "the twin's own routing equals the golden's: the golden no longer tests this";
  EXPECT_EQ(flips->near, std::vector<std::int64_t>{2});
  EXPECT_TRUE(flips->takes_golden_routing) << flips->why_not;
  const Compared c = compare(f, TwinKind::Reference);
  EXPECT_EQ(c.routing, "differs on 1 near-tie token (2): compared downstream on the golden's routing");
  EXPECT_EQ(c.grads, "compared");
  ASSERT_FALSE(c.rows.empty());
  for (const Comparison& row : c.rows) EXPECT_TRUE(row.pass) << row.name << " " << row.message;
}

// The same golden with token 0 moved to the expert its sinkhorn score ranks last: no tie explains
// it, so the comparison names the token and fails at the routing map.
TEST(RoutingTies, ASinkhornMapChangedFarFromATieStillFails) {
  const Fixture f = partial_golden(kSinkhornNearTie);
  std::vector<double> map = f.tensor("tap.mlp.router.1").to_f64();
  ASSERT_EQ(map[2], 1.0) << "token 0 routed to expert 2 in the golden";
  map[2] = 0.0;
  map[1] = 1.0;  // the sinkhorn of the golden's logits ranks expert 1 last for token 0 (0.0057 vs 0.0106)
  twin::testing::TempDir dir;
  const Compared c = compare(with_routing_map(f, map, dir), TwinKind::Reference);
  EXPECT_NE(c.routing.find("token 0 is far from a tie: the golden chose expert 1 over expert 2"), std::string::npos)
      << c.routing;
  const auto map_row =
      std::find_if(c.rows.begin(), c.rows.end(), [](const Comparison& r) { return r.name == "tap.mlp.router.1"; });
  ASSERT_NE(map_row, c.rows.end());
  EXPECT_FALSE(map_row->pass);
}

// Real Megatron-Core, bf16, group-limited routing (4 experts in 2 groups, group top-k 1, top-k 2,
// sigmoid with expert bias) in a layer with multi-latent attention: token 0's two group scores
// lie 1e-4 apart while the experts the twin and the golden chose lie 0.14 apart. The flip is a
// near tie of the groups' scores, and the reference routes with the golden's choice.
TEST(RoutingTies, AGroupScoresNearTieIsRoutedWithTheGoldensChoice) {
  const Fixture f = partial_golden("mla_moe_bf16_group_limited_near_tie.safetensors");
  ASSERT_EQ(f.config.moe_router_num_groups, 2);
  const TwinRun own = find_fixture_handler(f.kind, TwinKind::Reference)(f, RunMode{});
  const auto flips = parity::routing_flips(f, own.record);
  ASSERT_TRUE(flips.has_value()) << "the twin's own routing equals the golden's: the golden no longer tests this";
  EXPECT_EQ(flips->near, std::vector<std::int64_t>{0}) << flips->far;
  const Compared c = compare(f, TwinKind::Reference);
  EXPECT_EQ(c.routing, "differs on 1 near-tie token (0): compared downstream on the golden's routing");
  EXPECT_EQ(c.grads, "compared");
  ASSERT_FALSE(c.rows.empty());
  for (const Comparison& row : c.rows) EXPECT_TRUE(row.pass) << row.name << " " << row.message;
}
