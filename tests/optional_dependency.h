// optional_dependency.h: the project rule for a test that needs an optional dependency (LibTorch,
// CUDA's headers, torch for /usr/bin/python3, Megatron-Core in ../shared). On a user's machine a
// missing one skips the test with the reason; under CI=true (set by CI services and exported by
// .ci/run) it fails, so a CI machine that lacks the dependency cannot pass by dropping the check.
// Tests that need a GPU, or the ASan build, skip with GTEST_SKIP as before: CI has neither.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

namespace twin::testing {

// CI mode: the environment variable CI is exactly "true".
inline bool under_ci() {
  const char* ci = std::getenv("CI");
  return ci != nullptr && std::string(ci) == "true";
}

}  // namespace twin::testing

// In a test body (or SetUp): skip with `reason`, or fail with it under CI=true. Returns from the
// function either way, like GTEST_SKIP and FAIL.
#define TWIN_SKIP_OPTIONAL(reason)                                                               \
  do {                                                                                           \
    if (::twin::testing::under_ci())                                                             \
      FAIL() << (reason) << " [CI=true: a test that needs a missing optional dependency fails]"; \
    GTEST_SKIP() << (reason);                                                                    \
  } while (0)
