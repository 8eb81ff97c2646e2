// The optimized dense layer on a real GPU (label gpu; ci/gpu-check runs these): the same properties
// as on the simulator, the optimized twin compiled by nvcc for sm_90 against the CPU reference.
// Without a usable CUDA device every test reports SKIPPED with the reason.
#include <gtest/gtest.h>
#include <rapidcheck.h>

#include <cstring>

#include "parity/bounds.h"
#include "parity/dense_run.h"
#include "parity/fixture_kinds.h"
#include "tests/parity/dense_case_gen.h"

using namespace twin;
using namespace twin::parity;

namespace {
bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}
#define REQUIRE_GPU()                                                 \
  do {                                                                \
    std::string why;                                                  \
    if (!rt::available(rt::Backend::Cuda, &why)) GTEST_SKIP() << why; \
  } while (0)

CaseLimits gpu_limits() {
  CaseLimits lim;
  lim.force_tp = true;  // one device: tp = 1 (TP/SP are covered on simulated ranks)
  lim.tp = 1;
  lim.max_groups_per_rank = 4;
  lim.max_s_per_rank = 24;
  lim.allow_dropout = true;
  return lim;
}
RunOptions on_gpu(bool graph = false) {
  RunOptions o;
  o.backend = rt::Backend::Cuda;
  o.use_graph = graph;
  return o;
}
}  // namespace

TEST(OptimizedLayerGpu, OptimizedEqualsReferenceWithinBound) {
  REQUIRE_GPU();
  EXPECT_TRUE(rc::check("optimized (GPU) == reference within bound", [] {
    const DenseCase c = *gen_dense_case(gpu_limits());
    const CaseResult r = run_case(c, on_gpu());
    RC_LOG() << r.report();
    RC_ASSERT(r.pass());
  }));
}

TEST(OptimizedLayerGpu, TwoRunsAndGraphReplayAreBitwiseEqual) {
  REQUIRE_GPU();
  EXPECT_TRUE(rc::check("GPU runs are reproducible and graph replay equals eager", [] {
    const DenseCase c = *gen_dense_case(gpu_limits());
    const DenseInputs in = make_inputs(c);
    const Tensor a = optimized_forward(c, in, on_gpu()), b = optimized_forward(c, in, on_gpu());
    RC_ASSERT(bitwise_equal(a, b));
    RC_ASSERT(bitwise_equal(a, optimized_forward(c, in, on_gpu(true))));
  }));
}

TEST(OptimizedLayerGpu, DropoutMasksAgreeWithTheReference) {
  REQUIRE_GPU();
  EXPECT_TRUE(rc::check("GPU dropout masks equal the reference's", [] {
    DenseCase c = *gen_dense_case(gpu_limits());
    c.dropout = *rc::gen::element(0.1, 0.5);
    const CaseResult r = run_case(c, on_gpu());
    RC_LOG() << r.report();
    RC_ASSERT(r.pass());
  }));
}

TEST(OptimizedLayerGpu, GoldenDenseFixturesPass) {
  REQUIRE_GPU();
  setenv("TWIN_BACKEND", "cuda", 1);
  int files = 0;
  for (const char* name : {"dense_ln_gqa_gelu_bias_qkln", "dense_ln_mha_explicit_mask", "dense_ln_mha_gelu_bias",
                           "dense_ln_mha_gelu_nobias", "dense_ln_mha_gelu_rope_bias", "dense_rms_gqa_swiglu_rope",
                           "dense_rms_mha_swiglu_qkln"}) {
    const Fixture f = load_fixture(golden_dir() + "/" + name + ".safetensors");
    for (const auto& c : compare_fixture(f, TwinKind::Optimized))
      EXPECT_TRUE(c.pass) << name << " " << c.name << ": max abs " << c.max_abs << " (" << c.tol.reason << ") "
                          << c.message;
    ++files;
  }
  unsetenv("TWIN_BACKEND");
  EXPECT_EQ(files, 7);
}
