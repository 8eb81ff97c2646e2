// Every retro_* safetensors fixture through the reference handlers: every output.* and tap.*
// tensor of the file is compared (grad.* is not: the reference is forward-only) and within the
// fp32 bound |a - e| <= 1e-5 + 1e-4 |e| (reference/retro/retro_fixtures.cpp).
#include <gtest/gtest.h>

#include <filesystem>
#include <set>

#include "parity/fixture_kinds.h"
#include "tests/reference/retro/retro_test_util.h"

using namespace twin;

TEST(RetroFixtures, EveryOutputAndTapWithinTolerance) {
  int files = 0;
  for (const std::string& name : golden_files("retro_")) {
    SCOPED_TRACE(name);
    ++files;
    const Fixture f = load_fixture(name);
    const FixtureHandler handler = find_fixture_handler(f.kind, TwinKind::Reference);
    ASSERT_NE(handler, nullptr) << f.kind;
    const std::vector<Comparison> rows = compare_fixture(handler, f, TwinKind::Reference);

    std::set<std::string> expected, compared;
    for (const auto& n : f.names_with_prefix("output.")) expected.insert(n);
    for (const auto& n : f.names_with_prefix("tap.")) expected.insert(n);
    for (const auto& c : rows) {
      compared.insert(c.name);
      EXPECT_TRUE(c.pass) << c.name << ": max abs " << c.max_abs << " " << c.message;
    }
    EXPECT_EQ(compared, expected);
    EXPECT_FALSE(expected.empty());
  }
  EXPECT_GE(files, 3);  // first layer, later layer, block
}
