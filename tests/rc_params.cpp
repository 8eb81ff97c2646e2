// Reproducible RapidCheck runs, linked into every test binary.
//
// RapidCheck draws a random seed per process unless RC_PARAMS names one, so two CI runs would test
// different cases. Before main, this adds the project's fixed seed (kDefaultRcSeed) to RC_PARAMS
// when it names none; RapidCheck reads RC_PARAMS once, at the first property. Each property's
// stream is derived from that seed and the property's name, so one test run alone (ctest -R, or
// --gtest_filter) draws the same cases as in the full run.
//   RC_PARAMS="seed=123"                   other cases, the same ones on every run with seed 123
//   RC_PARAMS="seed=123 max_success=1000"  ten times the cases (ci/soak scales this for all)
// Every test binary prints the parameters in effect when its tests start.
#include <gtest/gtest.h>

#include <cstdlib>
#include <iostream>
#include <sstream>
#include <string>

#include "tests/case_id.h"

namespace {

bool names_a_seed(const std::string& params) {
  std::istringstream in(params);
  std::string word;
  while (in >> word)
    if (word.rfind("seed=", 0) == 0) return true;
  return false;
}

class PrintRcParams : public ::testing::Environment {
 public:
  void SetUp() override {
    const std::uint64_t seed = twin::proptest::rc_seed();  // RapidCheck reads RC_PARAMS here
    const char* p = std::getenv("RC_PARAMS");
    std::cout << "[rapidcheck] RC_PARAMS=\"" << (p ? p : "") << "\" (seed " << seed
              << "; the same RC_PARAMS draws the same cases; a failing case prints its id, rerun it with "
                 "TWIN_CASE='<id>', see tests/case_id.h)"
              << std::endl;
  }
};

const bool kFixedSeed = [] {
  const char* p = std::getenv("RC_PARAMS");
  std::string params = p ? p : "";
  if (!names_a_seed(params)) {
    params = "seed=" + std::to_string(twin::proptest::kDefaultRcSeed) + (params.empty() ? "" : " " + params);
    setenv("RC_PARAMS", params.c_str(), 1);
  }
  ::testing::AddGlobalTestEnvironment(new PrintRcParams);
  return true;
}();

}  // namespace
