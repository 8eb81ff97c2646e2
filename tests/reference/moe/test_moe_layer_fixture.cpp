// The MoE half of every moe_* fixture: the recorded pre_mlp_layernorm output through MoELayer,
// every mlp.* tap and aux loss compared (routing exactly, values within the fp32 bound).
#include <gtest/gtest.h>

#include <cstdio>
#include <set>

#include "parity/compare.h"
#include "parity/fixture_kinds.h"
#include "parity/golden.h"
#include "reference/moe/moe_layer.h"
#include "tests/reference/moe/moe_test_util.h"

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
// wins) must still give a valid outcome: the recorded per-expert token counts, only top-k pairs.
// Whether it picks the very same tokens is printed, not asserted (torch's order is unspecified).
TEST(MoELayerFixture, OwnTieRuleGivesTheRecordedCountsOnTieDependentFiles) {
  for (const std::string& path : moe_fixture_paths()) {
    const Fixture f = load_fixture(path);
    if (f.meta("tie_break_dependent") != "true") continue;
    SCOPED_TRACE(path);
    MoELayer own(f.config, Precision::from_config(f.config), f.layer_number);
    own.load_state_dict(fixture_state_dict(f), "mlp.");
    const Tensor& x = f.tensor("tap.pre_mlp_layernorm");
    const Index s = x.size(0), b = x.size(1), h = x.size(2);
    MlpArgs args;
    args.lead = {s, b};
    args.training = f.training;
    TapRecord rec;
    own.forward(to_mat(x, s * b, h, "pre_mlp_layernorm"), args, Taps(&rec, "mlp."));
    const Tensor& recorded = f.tensor("tap.mlp.router.1");
    const BoolMat mine = to_bool_mat(*rec.find("mlp.router.1"), recorded.size(0), recorded.size(1));
    const BoolMat theirs = to_bool_mat(recorded, recorded.size(0), recorded.size(1));
    for (Index e = 0; e < mine.cols(); ++e) EXPECT_EQ(mine.col(e).count(), theirs.col(e).count()) << "expert " << e;
    std::printf("%s: earliest-token-wins rule %s the recorded routing map\n", f.case_name.c_str(),
                mine == theirs ? "reproduces" : "differs from (tie order) ");
  }
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
  }
}

}  // namespace
}  // namespace twin::reference::moe
