// The property-case convention (tests/case_id.h) and the fixed RapidCheck seed (tests/rc_params.cpp):
// ids round-trip and parse strictly, a failing property prints its case as the id, TWIN_CASE reruns
// exactly one case, and the same RC_PARAMS seed draws the same cases.
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "tests/case_id.h"

using namespace twin;
using namespace twin::proptest;

namespace {

struct ToyCase : PropertyCase {
  static constexpr const char* kKind = "toy";
  int n = 1;
  double x = 0.0;
  bool flag = false;
  std::string name = "a";
  DType dtype = DType::F32;
  std::uint64_t seed = 0;
  template <class V>
  void fields(V& v) {
    v("n", n);
    v("x", x);
    v("flag", flag);
    v("name", name);
    v("dtype", dtype);
    v("seed", seed);
  }
};

rc::Gen<ToyCase> gen_toy() {
  return rerunnable<ToyCase>(rc::gen::exec([] {
    ToyCase c;
    c.n = *rc::gen::inRange(1, 1000);
    c.x = *rc::gen::inRange(-1000, 1000) / 7.0;
    c.flag = *rc::gen::arbitrary<bool>();
    c.name = *rc::gen::element<std::string>("ln", "rms");
    c.dtype = *gen_case_dtype();
    c.seed = *rc::gen::arbitrary<std::uint64_t>();
    return c;
  }));
}

// The ids a property sees in one RapidCheck run with the given RC_PARAMS text.
std::vector<std::string> drawn_ids(const std::string& rc_params) {
  const rc::detail::TestParams params = rc::detail::configFromString(rc_params).testParams;
  rc::detail::TestMetadata meta;
  meta.id = "CaseId/drawn_ids";
  std::vector<std::string> ids;
  const auto result = rc::detail::checkTestable([&] { ids.push_back(case_id(*gen_toy())); }, meta, params);
  EXPECT_TRUE(result.template is<rc::detail::SuccessResult>());
  return ids;
}

// Listens to nothing: a property failed on purpose here must not reach RapidCheck's default
// listener, which would print a `reproduce` line for it at exit.
struct Quiet : rc::detail::TestListener {
  void onTestCaseFinished(const rc::detail::CaseDescription&) override {}
  void onShrinkTried(const rc::detail::CaseDescription&, bool) override {}
  void onTestFinished(const rc::detail::TestMetadata&, const rc::detail::TestResult&) override {}
};

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

template <class F>
std::string parse_error(F&& f) {
  try {
    f();
  } catch (const CaseIdParseError& e) {
    return e.what();
  }
  return "(no CaseIdParseError)";
}

}  // namespace

TEST(CaseId, PrintsEveryFieldInOrderAndParsesBack) {
  ToyCase c;
  c.n = 7;
  c.x = 0.1;  // the shortest text that reads back as the same double
  c.flag = true;
  c.name = "rms";
  c.dtype = DType::BF16;
  c.seed = 18446744073709551615ull;
  const std::string id = "toy(n=7,x=0.1,flag=1,name=rms,dtype=bf16,seed=18446744073709551615)";
  EXPECT_EQ(case_id(c), id);
  const ToyCase back = parse_case<ToyCase>(id);
  EXPECT_EQ(back.x, 0.1);
  EXPECT_EQ(back.seed, c.seed);
  EXPECT_EQ(back.dtype, DType::BF16);
  EXPECT_EQ(case_id(back), id);
}

TEST(CaseId, ParsingIsStrictAndNamesTheKey) {
  const std::string ok = "toy(n=7,x=0.1,flag=1,name=rms,dtype=bf16,seed=3)";
  EXPECT_TRUE(contains(parse_error([&] { parse_case<ToyCase>("norm(n=7)"); }), "expected 'toy'"));
  EXPECT_TRUE(contains(parse_error([&] { parse_case<ToyCase>("toy(x=0.1,n=7,flag=1,name=rms,dtype=bf16,seed=3)"); }),
                       "expected key 'n'"));
  EXPECT_TRUE(contains(parse_error([&] { parse_case<ToyCase>(ok.substr(0, ok.size() - 1) + ",extra=1)"); }),
                       "unknown key 'extra'"));
  EXPECT_TRUE(contains(parse_error([&] { parse_case<ToyCase>("toy(n=7,x=0.1,flag=2,name=rms,dtype=bf16,seed=3)"); }),
                       "'flag'"));
  EXPECT_TRUE(
      contains(parse_error([&] { parse_case<ToyCase>("toy(n=7x,x=0.1,flag=1,name=rms,dtype=bf16,seed=3)"); }), "'n'"));
  EXPECT_TRUE(contains(parse_error([&] { parse_case<ToyCase>("toy(n=7,x=0.1,flag=1,name=rms,dtype=f8,seed=3)"); }),
                       "fp32, bf16 or fp16"));
  EXPECT_TRUE(contains(parse_error([&] { parse_case<ToyCase>("toy(n=7"); }), "kind(key=value"));
}

// RapidCheck shows a drawn case through showValue: the counterexample is the id, not <???>.
TEST(CaseId, AFailingPropertyPrintsItsCaseId) {
  rc::detail::TestMetadata meta;
  meta.id = "CaseId/failing";
  rc::detail::TestParams params;
  params.seed = 5;
  params.disableShrinking = true;
  std::string drawn;
  Quiet quiet;
  const auto result = rc::detail::checkProperty(rc::detail::toProperty([&] {
                                                  const ToyCase c = *gen_toy();
                                                  drawn = case_id(c);
                                                  RC_ASSERT(c.n < 0);
                                                }),
                                                meta, params, quiet);
  ASSERT_TRUE(result.template is<rc::detail::FailureResult>());
  const auto& example = result.template get<rc::detail::FailureResult>().counterExample;
  ASSERT_EQ(example.size(), 1u);
  EXPECT_EQ(example[0].second, drawn);
  EXPECT_TRUE(contains(example[0].second, "toy(n="));
}

TEST(CaseId, TwinCaseRerunsExactlyThatCase) {
  const std::string id = "toy(n=3,x=-2.5,flag=0,name=ln,dtype=fp16,seed=99)";
  setenv("TWIN_CASE", id.c_str(), 1);
  const std::vector<std::string> ids = drawn_ids("seed=1 max_success=5");
  unsetenv("TWIN_CASE");
  ASSERT_EQ(ids.size(), 5u);
  for (const auto& got : ids) EXPECT_EQ(got, id);
  // A case of another kind leaves this generator alone.
  setenv("TWIN_CASE", "norm(h=1)", 1);
  const std::vector<std::string> others = drawn_ids("seed=1 max_success=5");
  unsetenv("TWIN_CASE");
  EXPECT_NE(others[0], id);
}

// Two runs with the same RC_PARAMS seed draw the same cases; another seed draws others.
TEST(RcParams, SameSeedDrawsTheSameCases) {
  const auto a = drawn_ids("seed=77 max_success=20"), b = drawn_ids("seed=77 max_success=20");
  ASSERT_EQ(a.size(), 20u);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, drawn_ids("seed=78 max_success=20"));
}

// The process's RapidCheck seed is the one RC_PARAMS names: the fixed default, added before main
// when the caller named none, so CI draws the same cases on every run.
TEST(RcParams, TheSeedInEffectIsTheOneRcParamsNames) {
  const char* p = std::getenv("RC_PARAMS");
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(rc::detail::configFromString(p).testParams.seed, rc_seed());
  if (!contains(p, "seed=")) ADD_FAILURE() << "RC_PARAMS names no seed: " << p;
}
