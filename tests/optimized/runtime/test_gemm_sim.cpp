// The simulated GEMM against an independent double-precision product (Eigen) over random shapes,
// transposes, leading dimensions, batch strides, dtypes and epilogues; argument validation as
// cuBLAS does it; grouped GEMM with empty groups.
#include "tests/optimized/runtime/gemm_check.h"

#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

using namespace gemm_check;

namespace {

void run_sim(const GemmArgs& g) { twin::rt::gemm(twin::rt::Backend::Sim).run(g, nullptr); }

}  // namespace

RC_GTEST_PROP(GemmSim, MatchesDoubleProductOverShapesLayoutsAndDtypes, ()) {
  GemmArgs g;
  g.m = *rc::gen::inRange<std::int64_t>(0, 20);
  g.n = *rc::gen::inRange<std::int64_t>(0, 20);
  g.k = *rc::gen::inRange<std::int64_t>(0, 40);
  g.transa = *rc::gen::element(Op::N, Op::T);
  g.transb = *rc::gen::element(Op::N, Op::T);
  g.ab_dtype = *rc::gen::element(DType::BF16, DType::F16, DType::F32);
  g.cd_dtype = *rc::gen::element(g.ab_dtype, DType::F32);
  g.batch = *rc::gen::inRange<std::int64_t>(1, 4);
  g.alpha = *rc::gen::element(1.0f, -0.5f, 2.0f);
  g.beta = *rc::gen::element(0.0f, 1.0f, -0.25f);
  g.epilogue = *rc::gen::element(Epilogue::Default, Epilogue::Relu, Epilogue::Gelu, Epilogue::Bias, Epilogue::ReluBias,
                                 Epilogue::GeluBias);
  g.bias_dtype = *rc::gen::element(g.cd_dtype, DType::F32);
  const bool in_place = g.beta != 0.0f && *rc::gen::arbitrary<bool>();
  const std::int64_t a_rows = g.transa == Op::N ? g.m : g.k, a_cols = g.transa == Op::N ? g.k : g.m;
  const std::int64_t b_rows = g.transb == Op::N ? g.k : g.n, b_cols = g.transb == Op::N ? g.n : g.k;
  g.lda = std::max<std::int64_t>(1, a_rows) + *rc::gen::inRange(0, 4);
  g.ldb = std::max<std::int64_t>(1, b_rows) + *rc::gen::inRange(0, 4);
  g.ldd = std::max<std::int64_t>(1, g.m) + *rc::gen::inRange(0, 4);
  g.ldc = in_place ? g.ldd : std::max<std::int64_t>(1, g.m) + *rc::gen::inRange(0, 4);
  // Batch strides: past the matrix plus a gap, or 0 for A/B (one matrix broadcast to all batches).
  g.stride_a = *rc::gen::element<std::int64_t>(0, 1) * (g.lda * a_cols + *rc::gen::inRange(0, 5));
  g.stride_b = *rc::gen::element<std::int64_t>(0, 1) * (g.ldb * b_cols + *rc::gen::inRange(0, 5));
  g.stride_d = g.ldd * g.n + *rc::gen::inRange(0, 5);
  g.stride_c = in_place ? g.stride_d : g.ldc * g.n + *rc::gen::inRange(0, 5);
  const auto seed = *rc::gen::arbitrary<std::uint32_t>();

  std::mt19937 rng(seed);
  Buf a(g.ab_dtype, g.stride_a * (g.batch - 1) + g.lda * a_cols + 1);
  Buf b(g.ab_dtype, g.stride_b * (g.batch - 1) + g.ldb * b_cols + 1);
  Buf c(g.cd_dtype, g.stride_c * (g.batch - 1) + g.ldc * g.n + 1);
  Buf d(g.cd_dtype, g.stride_d * (g.batch - 1) + g.ldd * g.n + 1);
  Buf bias(g.bias_dtype, g.m + 1);
  a.fill_random(rng, -2, 2);
  b.fill_random(rng, -2, 2);
  c.fill_random(rng, -2, 2);
  bias.fill_random(rng, -1, 1);
  const float sentinel = -768.0f;  // exactly representable in every dtype
  for (std::size_t i = 0; i < d.size(); ++i) d.set(i, sentinel);
  Buf c_before = in_place ? d : c;
  if (in_place) {  // C's values live in D's elements
    for (std::int64_t bt = 0; bt < g.batch; ++bt)
      for (std::int64_t j = 0; j < g.n; ++j)
        for (std::int64_t i = 0; i < g.m; ++i) d.set(bt * g.stride_d + i + j * g.ldd, c.get(i + j * g.ldc));
    c_before = d;
  }
  g.a = a.data();
  g.b = b.data();
  g.c = in_place ? d.data() : c.data();
  g.d = d.data();
  g.bias = has_bias(g.epilogue) ? bias.data() : nullptr;
  run_sim(g);
  const std::string err = check_gemm(g, a, b, &c_before, &bias, d, sentinel, "property case");
  if (!err.empty())
    RC_FAIL(err + " [m=" + std::to_string(g.m) + " n=" + std::to_string(g.n) + " k=" + std::to_string(g.k) +
            " lda=" + std::to_string(g.lda) + " ldb=" + std::to_string(g.ldb) + " ldc=" + std::to_string(g.ldc) +
            " ldd=" + std::to_string(g.ldd) + " batch=" + std::to_string(g.batch) +
            " in_place=" + std::to_string(in_place) + "]");
}

TEST(GemmSim, RejectsBadLeadingDimensionsLikeCublas) {
  Buf a(DType::F32, 64), b(DType::F32, 64), c(DType::F32, 64), d(DType::F32, 64);
  for (std::size_t i = 0; i < d.size(); ++i) d.set(i, 5.0f);
  auto base = [&] {
    GemmArgs g;
    g.m = 4, g.n = 3, g.k = 5;
    g.a = a.data(), g.b = b.data(), g.c = c.data(), g.d = d.data();
    g.lda = 4, g.ldb = 5, g.ldc = 4, g.ldd = 4;
    return g;
  };
  struct Bad {
    GemmArgs g;
    const char* needle;
  };
  std::vector<Bad> cases;
  {
    auto g = base();
    g.lda = 3;
    cases.push_back({g, "lda=3 is less than the 4 rows of A as stored (4 x 5)"});
  }
  {
    auto g = base();
    g.transa = Op::T;
    cases.push_back({g, "lda=4 is less than the 5 rows of A as stored (5 x 4)"});
  }
  {
    auto g = base();
    g.ldb = 4;
    cases.push_back({g, "ldb=4 is less than the 5 rows of B"});
  }
  {
    auto g = base();
    g.ldd = 2;
    cases.push_back({g, "ldd=2 is less than the 4 rows of D"});
  }
  {
    auto g = base();
    g.beta = 1.0f;
    g.ldc = 1;
    cases.push_back({g, "ldc=1 is less than the 4 rows of C"});
  }
  {
    auto g = base();
    g.ab_dtype = DType::BF16;
    g.cd_dtype = DType::F16;
    cases.push_back({g, "C/D dtype F16 must be"});
  }
  {
    auto g = base();
    g.epilogue = Epilogue::Bias;
    cases.push_back({g, "needs a bias pointer"});
  }
  {
    auto g = base();
    g.batch = 2;
    g.stride_d = 4;
    cases.push_back({g, "batches of D would overlap"});
  }
  for (auto& bc : cases) {
    try {
      run_sim(bc.g);
      ADD_FAILURE() << "accepted: " << bc.needle;
    } catch (const twin::rt::GemmError& e) {
      EXPECT_NE(std::string(e.what()).find(bc.needle), std::string::npos) << e.what();
    }
  }
  for (std::size_t i = 0; i < d.size(); ++i) ASSERT_EQ(d.get(i), 5.0f) << "a rejected call wrote D";
  // transb = T stores B as n x k = 3 x 5, so ldb = 3 is enough there.
  auto g = base();
  g.transb = Op::T;
  g.ldb = 3;
  EXPECT_NO_THROW(run_sim(g));
}

TEST(GemmSim, GroupedGemmWithEmptyGroups) {
  std::mt19937 rng(3);
  struct Group {
    GemmArgs g;
    Buf a, b, c, d, bias;
  };
  auto make = [&](std::int64_t m, std::int64_t n, std::int64_t k, Op ta, float beta, Epilogue e) {
    Group gr{GemmArgs{},
             Buf(DType::BF16, std::max<std::int64_t>(1, m * k)),
             Buf(DType::BF16, std::max<std::int64_t>(1, k * n)),
             Buf(DType::F32, std::max<std::int64_t>(1, m * n)),
             Buf(DType::F32, std::max<std::int64_t>(1, m * n)),
             Buf(DType::F32, std::max<std::int64_t>(1, m))};
    gr.a.fill_random(rng, -1, 1);
    gr.b.fill_random(rng, -1, 1);
    gr.c.fill_random(rng, -1, 1);
    gr.bias.fill_random(rng, -1, 1);
    for (std::size_t i = 0; i < gr.d.size(); ++i) gr.d.set(i, -768.0f);
    GemmArgs& g = gr.g;
    g.m = m, g.n = n, g.k = k, g.transa = ta, g.beta = beta, g.epilogue = e;
    g.ab_dtype = DType::BF16, g.cd_dtype = DType::F32, g.bias_dtype = DType::F32;
    g.lda = std::max<std::int64_t>(1, ta == Op::N ? m : k), g.ldb = std::max<std::int64_t>(1, k);
    g.ldc = g.ldd = std::max<std::int64_t>(1, m);
    return gr;
  };
  std::vector<Group> groups;
  groups.push_back(make(5, 4, 3, Op::N, 0.0f, Epilogue::Default));
  groups.push_back(make(0, 4, 3, Op::N, 0.0f, Epilogue::Default));  // no rows (an expert with no tokens)
  groups.push_back(make(3, 2, 0, Op::N, 1.0f, Epilogue::Bias));     // k == 0: D = C + bias
  groups.push_back(make(6, 7, 9, Op::T, 0.5f, Epilogue::GeluBias));
  std::vector<GemmArgs> args;
  for (auto& gr : groups) {
    gr.g.a = gr.a.data(), gr.g.b = gr.b.data(), gr.g.c = gr.c.data(), gr.g.d = gr.d.data(), gr.g.bias = gr.bias.data();
    args.push_back(gr.g);
  }
  twin::rt::gemm(twin::rt::Backend::Sim).run_grouped(args, nullptr);
  for (std::size_t i = 0; i < groups.size(); ++i)
    EXPECT_EQ(check_gemm(groups[i].g, groups[i].a, groups[i].b, &groups[i].c, &groups[i].bias, groups[i].d, -768.0f,
                         "group " + std::to_string(i)),
              "");

  // A bad group is reported by index before any group runs.
  for (auto& gr : groups)
    for (std::size_t i = 0; i < gr.d.size(); ++i) gr.d.set(i, -768.0f);
  args[2].ldd = 1;
  try {
    twin::rt::gemm(twin::rt::Backend::Sim).run_grouped(args, nullptr);
    ADD_FAILURE() << "bad group accepted";
  } catch (const twin::rt::GemmError& e) {
    EXPECT_NE(std::string(e.what()).find("group 2"), std::string::npos) << e.what();
  }
  EXPECT_EQ(groups[0].d.get(0), -768.0f) << "group 0 ran although group 2 was invalid";
}
