// The simulated GEMM against an independent double-precision product (Eigen) over random shapes,
// transposes, leading dimensions, batch strides, dtypes and epilogues; argument validation as
// cuBLAS does it; grouped GEMM with empty groups.
#include "tests/optimized/runtime/gemm_check.h"

#include "tests/case_id.h"

#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

using namespace gemm_check;

namespace {

void run_sim(const GemmArgs& g) { twin::rt::gemm(twin::rt::Backend::Sim).run(g, nullptr); }

}  // namespace

namespace {

const Epilogue kEpilogues[] = {Epilogue::Default, Epilogue::Relu,     Epilogue::Gelu,
                               Epilogue::Bias,    Epilogue::ReluBias, Epilogue::GeluBias};
const char* const kEpilogueNames[] = {"default", "relu", "gelu", "bias", "relu_bias", "gelu_bias"};

// One GEMM case: shapes, transposes, dtypes, scalars, epilogue (by name), the padding of each
// leading dimension, batch strides (broadcast A / B, the gap past each matrix), in-place C and
// the seed of the operands. Every field the call reads, so the id reruns the exact call.
struct GemmCase : twin::proptest::PropertyCase {
  static constexpr const char* kKind = "gemm";
  int m = 0, n = 0, k = 0;
  bool ta = false, tb = false;
  DType ab = DType::F32, cd = DType::F32, bias = DType::F32;
  int batch = 1;
  double alpha = 1.0, beta = 0.0;
  std::string epilogue = "default";
  bool in_place = false;
  int pad_a = 0, pad_b = 0, pad_c = 0, pad_d = 0;
  bool bcast_a = false, bcast_b = false;
  int gap_a = 0, gap_b = 0, gap_c = 0, gap_d = 0;
  std::uint64_t seed = 0;
  template <class V>
  void fields(V& v) {
    v("m", m);
    v("n", n);
    v("k", k);
    v("ta", ta);
    v("tb", tb);
    v("ab", ab);
    v("cd", cd);
    v("bias", bias);
    v("batch", batch);
    v("alpha", alpha);
    v("beta", beta);
    v("epilogue", epilogue);
    v("in_place", in_place);
    v("pad_a", pad_a);
    v("pad_b", pad_b);
    v("pad_c", pad_c);
    v("pad_d", pad_d);
    v("bcast_a", bcast_a);
    v("bcast_b", bcast_b);
    v("gap_a", gap_a);
    v("gap_b", gap_b);
    v("gap_c", gap_c);
    v("gap_d", gap_d);
    v("seed", seed);
  }
};

rc::Gen<GemmCase> gen_gemm_case() {
  return twin::proptest::rerunnable<GemmCase>(rc::gen::exec([] {
    GemmCase c;
    c.m = *rc::gen::inRange(0, 20);
    c.n = *rc::gen::inRange(0, 20);
    c.k = *rc::gen::inRange(0, 40);
    c.ta = *rc::gen::arbitrary<bool>();
    c.tb = *rc::gen::arbitrary<bool>();
    c.ab = *rc::gen::element(DType::BF16, DType::F16, DType::F32);
    c.cd = *rc::gen::element(c.ab, DType::F32);
    c.batch = *rc::gen::inRange(1, 4);
    c.alpha = *rc::gen::element(1.0, -0.5, 2.0);
    c.beta = *rc::gen::element(0.0, 1.0, -0.25);
    c.epilogue = kEpilogueNames[*rc::gen::inRange(0, 6)];
    c.bias = *rc::gen::element(c.cd, DType::F32);
    c.in_place = c.beta != 0.0 && *rc::gen::arbitrary<bool>();
    c.pad_a = *rc::gen::inRange(0, 4);
    c.pad_b = *rc::gen::inRange(0, 4);
    c.pad_d = *rc::gen::inRange(0, 4);
    c.pad_c = c.in_place ? 0 : *rc::gen::inRange(0, 4);
    c.bcast_a = *rc::gen::arbitrary<bool>();
    c.gap_a = *rc::gen::inRange(0, 5);
    c.bcast_b = *rc::gen::arbitrary<bool>();
    c.gap_b = *rc::gen::inRange(0, 5);
    c.gap_d = *rc::gen::inRange(0, 5);
    c.gap_c = c.in_place ? 0 : *rc::gen::inRange(0, 5);
    c.seed = *rc::gen::arbitrary<std::uint32_t>();
    return c;
  }));
}

Epilogue epilogue_of(const std::string& name) {
  for (int i = 0; i < 6; ++i)
    if (name == kEpilogueNames[i]) return kEpilogues[i];
  throw std::invalid_argument("gemm case: epilogue '" + name + "'");
}

}  // namespace

RC_GTEST_PROP(GemmSim, MatchesDoubleProductOverShapesLayoutsAndDtypes, ()) {
  const GemmCase gc = *gen_gemm_case();
  GemmArgs g;
  g.m = gc.m;
  g.n = gc.n;
  g.k = gc.k;
  g.transa = gc.ta ? Op::T : Op::N;
  g.transb = gc.tb ? Op::T : Op::N;
  g.ab_dtype = gc.ab;
  g.cd_dtype = gc.cd;
  g.batch = gc.batch;
  g.alpha = static_cast<float>(gc.alpha);
  g.beta = static_cast<float>(gc.beta);
  g.epilogue = epilogue_of(gc.epilogue);
  g.bias_dtype = gc.bias;
  const bool in_place = gc.in_place;
  const std::int64_t a_rows = g.transa == Op::N ? g.m : g.k, a_cols = g.transa == Op::N ? g.k : g.m;
  const std::int64_t b_rows = g.transb == Op::N ? g.k : g.n, b_cols = g.transb == Op::N ? g.n : g.k;
  g.lda = std::max<std::int64_t>(1, a_rows) + gc.pad_a;
  g.ldb = std::max<std::int64_t>(1, b_rows) + gc.pad_b;
  g.ldd = std::max<std::int64_t>(1, g.m) + gc.pad_d;
  g.ldc = in_place ? g.ldd : std::max<std::int64_t>(1, g.m) + gc.pad_c;
  // Batch strides: past the matrix plus a gap, or 0 for A/B (one matrix broadcast to all batches).
  g.stride_a = gc.bcast_a ? 0 : g.lda * a_cols + gc.gap_a;
  g.stride_b = gc.bcast_b ? 0 : g.ldb * b_cols + gc.gap_b;
  g.stride_d = g.ldd * g.n + gc.gap_d;
  g.stride_c = in_place ? g.stride_d : g.ldc * g.n + gc.gap_c;
  const auto seed = static_cast<std::uint32_t>(gc.seed);

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
  if (!err.empty()) RC_FAIL(err);  // the case id comes with the counterexample
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

// Which groups the GPU backend gives its one cublasGemmGroupedBatchedEx call (the rest run one
// matmul each): the rule is host code, checked here without a GPU.
TEST(GemmGrouped, SplitSendsTheGroupedCallOnlyWhatItComputes) {
  int buffer[4];
  auto plain = [&](DType dt) {
    GemmArgs g;
    g.m = 8, g.n = 4, g.k = 16, g.lda = g.ldb = 16, g.ldc = g.ldd = 8;
    g.transa = Op::T, g.ab_dtype = g.cd_dtype = dt;
    g.a = g.b = buffer, g.c = g.d = buffer;
    return g;
  };
  std::vector<GemmArgs> groups(11, plain(DType::BF16));
  groups[1].ab_dtype = groups[1].cd_dtype = DType::F16;  // another dtype: a second call
  groups[2].m = 0;                                       // nothing to write: neither
  groups[3].k = 0;                                       // D = beta C: the matmul path's form
  groups[4].epilogue = Epilogue::Bias, groups[4].bias = buffer;
  groups[5].cd_dtype = DType::F32;                  // mixed types: not in cuBLAS's grouped table
  groups[6].beta = 1.0f, groups[6].c = buffer + 1;  // the call writes C: C apart from D cannot go
  groups[7].beta = 1.0f;                            // C is D: accumulates in place, goes
  groups[8].batch = 2;
  groups[9].m = std::int64_t(1) << 31, groups[9].ldc = groups[9].ldd = groups[9].m;  // past int
  groups[10].n = 0;
  const twin::rt::GroupedGemmCalls calls = twin::rt::split_grouped_gemm(groups);
  using V = std::vector<std::size_t>;
  ASSERT_EQ(calls.grouped.size(), 2u);
  EXPECT_EQ(calls.grouped[0], (V{0, 7}));
  EXPECT_EQ(calls.grouped[1], (V{1}));
  EXPECT_EQ(calls.alone, (V{3, 4, 5, 6, 8, 9}));
  for (std::size_t i : calls.alone) EXPECT_NE(twin::rt::grouped_call_refusal(groups[i]), "") << "group " << i;
  EXPECT_EQ(twin::rt::grouped_call_refusal(groups[6]), "C and D apart with beta != 0");
}
