// cuBLASLt GEMM (GPU only): the same double-precision check as the simulated GEMM over a set of
// shapes, transposes, dtypes, batches and epilogues; and the same validation errors.
#include "tests/optimized/runtime/gemm_check.h"
#include "tests/optimized/runtime/gpu_fixture.h"

using namespace gemm_check;

TEST_F(GpuTest, CublasLtGemmMatchesDoubleProduct) {
  twin::rt::Device& d = dev();
  std::mt19937 rng(11);
  struct Shape {
    std::int64_t m, n, k, batch;
    Op ta, tb;
    DType ab, cd;
    Epilogue e;
    float beta;
  };
  const std::vector<Shape> shapes = {
      {64, 48, 32, 1, Op::N, Op::N, DType::F32, DType::F32, Epilogue::Default, 0.0f},
      {64, 48, 96, 1, Op::T, Op::N, DType::BF16, DType::BF16, Epilogue::Bias, 0.0f},
      {128, 16, 64, 3, Op::N, Op::T, DType::F16, DType::F32, Epilogue::GeluBias, 1.0f},
      {32, 32, 8, 2, Op::T, Op::T, DType::BF16, DType::F32, Epilogue::Relu, 0.5f},
      {16, 24, 0, 1, Op::N, Op::N, DType::BF16, DType::BF16, Epilogue::Default, 1.0f},
  };
  for (const Shape& sh : shapes) {
    GemmArgs g;
    g.m = sh.m, g.n = sh.n, g.k = sh.k, g.batch = sh.batch, g.transa = sh.ta, g.transb = sh.tb;
    g.ab_dtype = sh.ab, g.cd_dtype = sh.cd, g.epilogue = sh.e, g.beta = sh.beta, g.bias_dtype = sh.cd;
    const std::int64_t a_rows = g.transa == Op::N ? g.m : g.k, a_cols = g.transa == Op::N ? g.k : g.m;
    const std::int64_t b_rows = g.transb == Op::N ? g.k : g.n, b_cols = g.transb == Op::N ? g.n : g.k;
    g.lda = std::max<std::int64_t>(1, a_rows) + 8, g.ldb = std::max<std::int64_t>(1, b_rows), g.ldc = g.ldd = g.m;
    g.stride_a = g.lda * a_cols, g.stride_b = g.ldb * b_cols, g.stride_c = g.stride_d = g.ldd * g.n;
    Buf a(g.ab_dtype, g.stride_a * g.batch + 1), b(g.ab_dtype, g.stride_b * g.batch + 1);
    Buf c(g.cd_dtype, g.stride_c * g.batch), out(g.cd_dtype, g.stride_d * g.batch), bias(g.bias_dtype, g.m);
    a.fill_random(rng, -2, 2), b.fill_random(rng, -2, 2), c.fill_random(rng, -2, 2), bias.fill_random(rng, -1, 1);
    auto up = [&](Buf& h) {
      twin::rt::DeviceBuffer buf(d, h.bytes.size());
      buf.upload(h.bytes.data(), h.bytes.size());
      return buf;
    };
    auto da = up(a), db = up(b), dc = up(c), dbias = up(bias);
    twin::rt::DeviceBuffer dd(d, out.bytes.size());
    g.a = da.get(), g.b = db.get(), g.c = dc.get(), g.d = dd.get(),
    g.bias = has_bias(g.epilogue) ? dbias.get() : nullptr;
    twin::rt::gemm(twin::rt::Backend::Cuda).run(g, nullptr);
    dd.download(out.bytes.data(), out.bytes.size());
    EXPECT_EQ(
        check_gemm(g, a, b, &c, &bias, out, 0.0f, "cuBLASLt m=" + std::to_string(g.m) + " k=" + std::to_string(g.k)),
        "");
  }
}

TEST_F(GpuTest, CublasLtGemmRejectsBadLeadingDimension) {
  GemmArgs g;
  g.m = 4, g.n = 3, g.k = 5, g.lda = 3, g.ldb = 5, g.ldd = 4;
  try {
    twin::rt::gemm(twin::rt::Backend::Cuda).run(g, nullptr);
    ADD_FAILURE() << "accepted lda < m";
  } catch (const twin::rt::GemmError& e) {
    EXPECT_NE(std::string(e.what()).find("lda=3"), std::string::npos) << e.what();
  }
}

// The experts' grouped GEMM on the GPU: the groups split_grouped_gemm sends to the one
// cublasGemmGroupedBatchedEx call (bf16 and fp16, beta 0 and beta 1 in place, ragged rows) and the
// ones it runs alone (k == 0, a bias, an fp32 D) each match the double product as one GEMM does;
// an empty group writes nothing.
TEST_F(GpuTest, CublasGroupedGemmMatchesDoubleProduct) {
  twin::rt::Device& d = dev();
  std::mt19937 rng(12);
  struct Group {
    GemmArgs g;
    Buf a, b, c, out, bias;
    twin::rt::DeviceBuffer da, db, dd, dbias;
  };
  auto make = [&](std::int64_t m, std::int64_t n, std::int64_t k, DType ab, DType cd, float beta, Epilogue e) {
    Group gr{GemmArgs{},
             Buf(ab, std::max<std::int64_t>(1, m * k)),
             Buf(ab, std::max<std::int64_t>(1, k * n)),
             Buf(cd, std::max<std::int64_t>(1, m * n)),
             Buf(cd, std::max<std::int64_t>(1, m * n)),
             Buf(cd, m + 1),
             {},
             {},
             {},
             {}};
    gr.a.fill_random(rng, -2, 2), gr.b.fill_random(rng, -2, 2), gr.c.fill_random(rng, -2, 2);
    gr.bias.fill_random(rng, -1, 1);
    GemmArgs& g = gr.g;
    g.m = m, g.n = n, g.k = k, g.transa = Op::T, g.ab_dtype = ab, g.cd_dtype = cd, g.beta = beta, g.epilogue = e;
    g.bias_dtype = cd, g.lda = std::max<std::int64_t>(1, k), g.ldb = g.lda,
    g.ldc = g.ldd = std::max<std::int64_t>(1, m);
    auto up = [&](Buf& h) {
      twin::rt::DeviceBuffer buf(d, h.bytes.size());
      buf.upload(h.bytes.data(), h.bytes.size());
      return buf;
    };
    gr.da = up(gr.a), gr.db = up(gr.b), gr.dd = up(gr.c), gr.dbias = up(gr.bias);  // D starts as C
    g.a = gr.da.get(), g.b = gr.db.get(), g.c = g.d = gr.dd.get(), g.bias = has_bias(e) ? gr.dbias.get() : nullptr;
    return gr;
  };
  std::vector<Group> groups;
  groups.push_back(make(96, 37, 64, DType::BF16, DType::BF16, 0.0f, Epilogue::Default));
  groups.push_back(make(96, 5, 64, DType::BF16, DType::BF16, 1.0f, Epilogue::Default));  // accumulates in place
  groups.push_back(make(96, 0, 64, DType::BF16, DType::BF16, 0.0f, Epilogue::Default));  // an expert without tokens
  groups.push_back(make(48, 19, 32, DType::F16, DType::F16, 0.0f, Epilogue::Default));
  groups.push_back(make(64, 8, 0, DType::BF16, DType::BF16, 1.0f, Epilogue::Default));  // k == 0: alone
  groups.push_back(make(32, 9, 16, DType::BF16, DType::BF16, 0.0f, Epilogue::Bias));    // bias: alone
  groups.push_back(make(32, 7, 16, DType::BF16, DType::F32, 0.0f, Epilogue::Default));  // fp32 D: alone
  std::vector<GemmArgs> args;
  for (const Group& gr : groups) args.push_back(gr.g);
  const twin::rt::GroupedGemmCalls calls = twin::rt::split_grouped_gemm(args);
  ASSERT_EQ(calls.grouped.size(), 2u);  // bf16 (groups 0, 1) and fp16 (group 3)
  ASSERT_EQ(calls.alone.size(), 3u);
  twin::rt::gemm(twin::rt::Backend::Cuda).run_grouped(args, nullptr);
  d.synchronize();
  for (std::size_t i = 0; i < groups.size(); ++i) {
    Group& gr = groups[i];
    gr.dd.download(gr.out.bytes.data(), gr.out.bytes.size());
    const float sentinel = gr.g.n == 0 ? gr.c.get(0) : 0.0f;  // an empty group leaves C as it was
    if (gr.g.n == 0) {
      EXPECT_EQ(gr.out.get(0), sentinel) << "group " << i << " has no columns but was written";
      continue;
    }
    EXPECT_EQ(check_gemm(gr.g, gr.a, gr.b, &gr.c, &gr.bias, gr.out, sentinel, "group " + std::to_string(i)), "");
  }
}
