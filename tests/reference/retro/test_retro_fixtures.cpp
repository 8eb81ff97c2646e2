// Every retro_* safetensors fixture through the reference handlers: every output.*, tap.* and
// grad.* tensor of the file is compared (the gradients by the reference's backward on the golden's
// grad_in.output) and within its counted bound (parity/golden.h).
#include <gtest/gtest.h>

#include <filesystem>
#include <set>

#include "parity/fixture_kinds.h"
#include "parity/golden.h"
#include "tests/reference/retro/retro_test_util.h"
#include "tests/parity/wrong_gradient.h"

using namespace twin;

TEST(RetroFixtures, EveryOutputAndTapWithinTolerance) {
  int files = 0;
  for (const std::string& name : golden_files("retro_")) {
    SCOPED_TRACE(name);
    ++files;
    const Fixture f = load_fixture(name);
    const FixtureHandler handler = find_fixture_handler(f.kind, TwinKind::Reference);
    ASSERT_NE(handler, nullptr) << f.kind;
    std::string grads;
    const std::vector<Comparison> rows = compare_fixture(handler, f, TwinKind::Reference, RunMode{}, &grads);
    EXPECT_EQ(grads, "compared");

    std::set<std::string> expected, compared;
    for (const auto& n : f.names_with_prefix("output.")) expected.insert(n);
    for (const auto& n : f.names_with_prefix("tap.")) expected.insert(n);
    for (const auto& n : f.names_with_prefix("grad.")) expected.insert(n);
    EXPECT_FALSE(f.names_with_prefix("grad.input.context").empty());  // the neighbours' / encoder output's
    for (const auto& c : rows) {
      compared.insert(c.name);
      EXPECT_TRUE(c.pass) << c.name << ": max abs " << c.max_abs << " " << c.message;
    }
    EXPECT_EQ(compared, expected);
    EXPECT_FALSE(expected.empty());
  }
  EXPECT_GE(files, 3);  // first layer, later layer, block
}

// Each Retro gradient's counted bound is tight enough to catch a 1% error in it alone: one grad.*
// tensor of the golden scaled by 1.01 fails that row and no other (fp32 goldens: a few 2^-24 per
// rounding point, far below 1e-2). The first layer holds every Retro piece: the decoder's
// cross-attention and bda, the encoder's layers, their cross-attention, bda and layer norm.
TEST(RetroFixtures, AWrongGradientFailsAlone) {
  const Fixture f = load_fixture(test::fixture_dir() + "retro_first_layer_divisible.safetensors");
  const TwinRun run = find_fixture_handler(f.kind, TwinKind::Reference)(f, RunMode{});
  twin::test::expect_each_wrong_gradient_fails_alone(f, run, "reference");
}

// An isolated run compares the forward only and says so (the golden has no intermediate
// gradients to restart a module's backward from).
TEST(RetroFixtures, AnIsolatedRunReportsItsGradientsNotCompared) {
  const Fixture f = load_fixture(test::fixture_dir() + "retro_later_layer_divisible.safetensors");
  std::string grads;
  compare_fixture(find_fixture_handler(f.kind, TwinKind::Reference, RunMode{true}), f, TwinKind::Reference,
                  RunMode{true}, &grads);
  EXPECT_EQ(grads.rfind("not compared: an isolated run", 0), 0u) << grads;
}
