// The MoE half of every moe_* fixture: the recorded pre_mlp_layernorm output through MoELayer,
// every mlp.* tap and aux loss compared (routing exactly, values within the fp32 bound).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <set>
#include <vector>

#include "parity/compare.h"
#include "parity/fixture_kinds.h"
#include "parity/golden.h"
#include "reference/moe/moe_layer.h"
#include "tests/reference/moe/moe_test_util.h"
#include "tests/parity/wrong_gradient.h"

namespace twin::reference::moe {
namespace {

using testing::fixture_state_dict;
using testing::moe_fixture_paths;

TEST(MoELayerFixture, MlpHalfMatchesEveryMoeFixture) {
  const auto paths = moe_fixture_paths();
  ASSERT_FALSE(paths.empty()) << "no moe_* fixtures under " << golden_dir();
  for (const std::string& path : paths) {
    SCOPED_TRACE(path);
    std::printf("%s\n", path.c_str());
    const Fixture f = load_fixture(path);
    const Precision p = Precision::from_config(f.config);
    MoELayer layer(f.config, p, f.layer_number);
    layer.load_state_dict(fixture_state_dict(f), "mlp.");
    const Tensor& x = f.tensor("tap.pre_mlp_layernorm");  // [s, b, h]
    const Index s = x.size(0), b = x.size(1), h = x.size(2);
    MlpArgs args;
    args.lead = {s, b};
    args.training = f.training;
    if (f.has("input.padding_mask")) args.padding_mask = &f.tensor("input.padding_mask");
    if (f.meta("tie_break_dependent") == "true") args.recorded_routing_map = &f.tensor("tap.mlp.router.1");
    TapRecord rec;
    {
      CountRoundings counting;
      layer.forward(to_mat(x, s * b, h, "pre_mlp_layernorm"), args, Taps(&rec, "mlp."));
    }
    // The MoE half of the golden: its taps, expert inputs, aux losses and router state, through the
    // one comparison.
    parity::Expected expected;
    for (const auto& [key, t] : parity::expected_of(f))
      if (key.rfind("tap.mlp.", 0) == 0 || key.rfind("tap_in.mlp.", 0) == 0 || key.rfind("aux.", 0) == 0 ||
          key.rfind("state.mlp.", 0) == 0)
        expected.emplace_back(key, t);
    int compared = 0;
    for (const Comparison& c : parity::compare_record(rec, expected, "reference")) {
      EXPECT_TRUE(c.pass) << c.name << " max_abs " << c.max_abs << " " << c.message << " at " << c.worst_index_str()
                          << " (" << c.tol.reason << ")";
      std::printf("  %-45s max_abs %.3g share %.3g\n", c.name.c_str(), c.max_abs, c.share_used);
      ++compared;
    }
    EXPECT_GT(compared, 5);
  }
}

// Where a file's drop depends on torch.topk's tie order, the reference's own rule (earliest token
// wins) must give an outcome Megatron could have given, asserted per expert: the recorded number of
// tokens, only (token, expert) pairs its top-k routing chose before the drop, and the kept tokens'
// drop keys (the probabilities, or under the "position" policy the routing map) equal to the
// recorded kept tokens' keys as multisets, so the two selections can differ only among tied keys.
// The goldens must hold at least one such file, or this checks nothing.
TEST(MoELayerFixture, OwnTieRuleDiffersFromTheRecordedMapOnlyAmongTies) {
  int tie_dependent = 0;
  for (const std::string& path : moe_fixture_paths()) {
    const Fixture f = load_fixture(path);
    // Tie-dependent without a capacity: the top-k itself chose among tied scores (the pin's bf16
    // router scores), which the golden-routing rule covers (parity/routing_ties.h), not this one.
    if (f.meta("tie_break_dependent") != "true" || !f.config.moe_expert_capacity_factor) continue;
    ++tie_dependent;
    SCOPED_TRACE(path);
    const Tensor& x = f.tensor("tap.pre_mlp_layernorm");
    const Index s = x.size(0), b = x.size(1), h = x.size(2);
    auto route = [&](const TransformerConfig& config) {  // (probs, routing map), each [T, E]
      MoELayer layer(config, Precision::from_config(config), f.layer_number);
      layer.load_state_dict(fixture_state_dict(f), "mlp.");
      MlpArgs args;
      args.lead = {s, b};
      args.training = f.training;
      if (f.has("input.padding_mask")) args.padding_mask = &f.tensor("input.padding_mask");
      TapRecord rec;
      layer.forward(to_mat(x, s * b, h, "pre_mlp_layernorm"), args, Taps(&rec, "mlp."));
      const Tensor& probs = *rec.find("mlp.router.0");
      return std::make_pair(to_mat(probs, probs.size(0), probs.size(1), "probs"),
                            to_bool_mat(*rec.find("mlp.router.1"), probs.size(0), probs.size(1)));
    };
    const BoolMat mine = route(f.config).second;
    TransformerConfig no_drop = f.config;  // the same router without the capacity: top-k before the drop
    no_drop.moe_expert_capacity_factor.reset();
    no_drop.moe_pad_expert_input_to_capacity = false;
    const auto [probs_before, map_before] = route(no_drop);
    const Tensor& recorded = f.tensor("tap.mlp.router.1");
    const BoolMat theirs = to_bool_mat(recorded, recorded.size(0), recorded.size(1));
    ASSERT_EQ(mine.rows(), theirs.rows());
    ASSERT_EQ(mine.cols(), theirs.cols());
    const bool by_probs = f.config.moe_token_drop_policy == "probs";
    int differing = 0;
    for (Index e = 0; e < mine.cols(); ++e) {
      EXPECT_EQ(mine.col(e).count(), theirs.col(e).count()) << "expert " << e;
      std::vector<double> my_keys, their_keys;
      for (Index t = 0; t < mine.rows(); ++t) {
        const double key = by_probs ? probs_before(t, e) : (map_before(t, e) ? 1.0 : 0.0);
        if (!f.config.moe_pad_expert_input_to_capacity) {
          EXPECT_TRUE(!mine(t, e) || map_before(t, e)) << "kept token " << t << " not routed to expert " << e;
          EXPECT_TRUE(!theirs(t, e) || map_before(t, e)) << "recorded token " << t << " not routed to expert " << e;
        }
        if (mine(t, e)) my_keys.push_back(key);
        if (theirs(t, e)) their_keys.push_back(key);
        differing += mine(t, e) != theirs(t, e);
      }
      std::sort(my_keys.begin(), my_keys.end());
      std::sort(their_keys.begin(), their_keys.end());
      EXPECT_EQ(my_keys, their_keys) << "expert " << e << ": a kept token outranks or is outranked by a dropped one";
    }
    std::printf("%s: %d (token, expert) pairs differ from the recorded map, all among ties\n", f.case_name.c_str(),
                differing);
  }
  EXPECT_GT(tie_dependent, 0) << "no tie_break_dependent moe_* golden under " << golden_dir();
}

// The `moe_layer` handler (what `twin fixture --twin reference` runs) on every moe_* file: every
// comparison passes, and the output, routing map and expert inputs are among them.
TEST(MoELayerFixture, HandlerPassesEveryMoeFixture) {
  const auto paths = moe_fixture_paths();
  ASSERT_FALSE(paths.empty()) << "no moe_* fixtures under " << golden_dir();
  ASSERT_EQ(find_fixture_handler("moe_layer", TwinKind::Reference), &parity::run_reference_moe_layer);
  for (const std::string& path : paths) {
    SCOPED_TRACE(path);
    const Fixture f = load_fixture(path);
    ASSERT_EQ(f.kind, "moe_layer");
    const std::vector<Comparison> cs = compare_fixture(f, TwinKind::Reference);
    std::set<std::string> names;
    double worst = 0.0;
    for (const Comparison& c : cs) {
      EXPECT_TRUE(c.pass) << c.name << ": max_abs " << c.max_abs << " (" << c.tol.reason << ") " << c.message << " at "
                          << c.worst_index_str();
      names.insert(c.name);
      if (c.name != "tap.mlp.router.1") worst = std::max(worst, c.max_abs);
    }
    std::printf("%s: %zu comparisons, max |a - e| %.3g\n", f.case_name.c_str(), cs.size(), worst);
    for (const char* n :
         {"output.hidden_states", "tap.mlp.router.1", "tap.mlp.0", "tap_in.mlp.experts.dispatched_input",
          "tap_in.mlp.experts.tokens_per_expert", "tap.self_attention.0"})
      EXPECT_TRUE(names.count(n)) << n << " not compared";
    for (const std::string& n : f.names_with_prefix("aux.")) EXPECT_TRUE(names.count(n)) << n << " not compared";
    // The backward ran on grad_in.output: every gradient of the golden is among the comparisons.
    for (const auto& [n, t] : parity::grads_of(f)) EXPECT_TRUE(names.count(n)) << n << " not compared";
    EXPECT_FALSE(parity::grads_of(f).empty()) << "the golden has no grad.* tensors";
  }
}

// Each MoE gradient's counted bound is tight enough to catch a 1% error in it alone: one grad.*
// tensor of an fp32 golden scaled by 1.01 fails that row and no other (a few 2^-24 per counted
// rounding point, far below 1e-2).
TEST(MoELayerFixture, AWrongGradientFailsAlone) {
  for (const std::string& path : moe_fixture_paths()) {
    const Fixture f = load_fixture(path);
    if (Precision::from_config(f.config).params_dtype != DType::F32) continue;
    SCOPED_TRACE(path);
    const TwinRun run = find_fixture_handler(f.kind, TwinKind::Reference)(f, RunMode{});
    twin::test::expect_each_wrong_gradient_fails_alone(f, run, "reference");
  }
}

}  // namespace
}  // namespace twin::reference::moe
