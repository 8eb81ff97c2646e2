// gemm.cpp: argument validation and epilogue math shared by both GEMM backends.
#include "optimized/runtime/gemm.h"

#include "optimized/runtime/cost_model.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

namespace twin::rt {

const char* epilogue_name(Epilogue e) {
  switch (e) {
    case Epilogue::Default:
      return "DEFAULT";
    case Epilogue::Relu:
      return "RELU";
    case Epilogue::Gelu:
      return "GELU";
    case Epilogue::Bias:
      return "BIAS";
    case Epilogue::ReluBias:
      return "RELU_BIAS";
    case Epilogue::GeluBias:
      return "GELU_BIAS";
  }
  return "?";
}

float apply_epilogue_activation(Epilogue e, float x) {
  switch (e) {
    case Epilogue::Relu:
    case Epilogue::ReluBias:
      return x > 0.0f ? x : 0.0f;
    case Epilogue::Gelu:
    case Epilogue::GeluBias: {
      const float k = 0.7978845608028654f;  // sqrt(2 / pi)
      return 0.5f * x * (1.0f + std::tanh(k * (x + 0.044715f * x * x * x)));
    }
    default:
      return x;
  }
}

namespace {
const char* op_name(Op o) { return o == Op::N ? "N" : "T"; }
std::string s(std::int64_t v) { return std::to_string(v); }
}  // namespace

void declare_gemm_cost(const GemmArgs& g, const char* kernel) {
  const double ab = dtype_size(g.ab_dtype), cd = dtype_size(g.cd_dtype), batch = double(g.batch);
  const double a_copies = g.stride_a == 0 ? 1.0 : batch, b_copies = g.stride_b == 0 ? 1.0 : batch;
  const double bytes = ab * (a_copies * g.m * g.k + b_copies * g.k * g.n) +
                       cd * batch * g.m * g.n * (g.beta != 0.0f ? 2.0 : 1.0) +
                       (g.bias ? dtype_size(g.bias_dtype) * double(g.m) : 0.0);
  // One row per GEMM shape: "gemm m=..,n=..,k=..[,batch=..]".
  std::string name = std::string(kernel) + " m=" + std::to_string(g.m) + ",n=" + std::to_string(g.n) +
                     ",k=" + std::to_string(g.k) + (g.batch > 1 ? ",batch=" + std::to_string(g.batch) : "");
  declare_cost(name.c_str(), bytes, 2.0 * batch * g.m * g.n * g.k);
}

std::string grouped_call_refusal(const GemmArgs& g) {
  const std::int64_t int_max = std::numeric_limits<int>::max();
  if (g.k == 0) return "k = 0";  // the matmul path's zero-product form handles it
  if (g.batch != 1) return "a strided batch";
  if (g.epilogue != Epilogue::Default || g.bias) return std::string("epilogue ") + epilogue_name(g.epilogue);
  // cuBLAS's table for CUBLAS_COMPUTE_32F: A, B and C of one type (bf16, fp16 or fp32).
  if (g.cd_dtype != g.ab_dtype) return std::string("C/D dtype ") + dtype_name(g.cd_dtype) + " != A/B dtype";
  // The call writes C: D must be C unless beta is 0 (then C is not read and D is passed as C).
  if (g.beta != 0.0f && (g.c != g.d || g.ldc != g.ldd)) return "C and D apart with beta != 0";
  for (std::int64_t v : {g.m, g.n, g.k, g.lda, g.ldb, g.ldd})
    if (v > int_max) return "a size or leading dimension past 32 bits";
  return "";
}

GroupedGemmCalls split_grouped_gemm(const std::vector<GemmArgs>& groups) {
  GroupedGemmCalls calls;
  std::vector<DType> call_dtype;  // the A/B (= C/D) dtype of each grouped call
  for (std::size_t i = 0; i < groups.size(); ++i) {
    const GemmArgs& g = groups[i];
    if (g.m == 0 || g.n == 0) continue;
    if (!grouped_call_refusal(g).empty()) {
      calls.alone.push_back(i);
      continue;
    }
    const auto at = std::find(call_dtype.begin(), call_dtype.end(), g.ab_dtype);
    if (at == call_dtype.end()) {
      call_dtype.push_back(g.ab_dtype);
      calls.grouped.push_back({i});
    } else {
      calls.grouped[std::size_t(at - call_dtype.begin())].push_back(i);
    }
  }
  return calls;
}

void validate_gemm(const GemmArgs& g, const char* who) {
  auto fail = [&](const std::string& what) {
    throw GemmError(std::string(who) + ": " + what + " (m=" + s(g.m) + ", n=" + s(g.n) + ", k=" + s(g.k) +
                    ", transa=" + op_name(g.transa) + ", transb=" + op_name(g.transb) + ")");
  };
  if (g.m < 0 || g.n < 0 || g.k < 0) fail("negative size");
  if (g.batch < 1) fail("batch=" + s(g.batch) + " must be >= 1");
  const DType ab = g.ab_dtype, cd = g.cd_dtype;
  if (ab != DType::BF16 && ab != DType::F16 && ab != DType::F32)
    fail(std::string("A/B dtype ") + dtype_name(ab) + " is not one of BF16, F16, F32");
  if (cd != ab && cd != DType::F32)
    fail(std::string("C/D dtype ") + dtype_name(cd) + " must be the A/B dtype " + dtype_name(ab) + " or F32");
  const bool has_bias =
      g.epilogue == Epilogue::Bias || g.epilogue == Epilogue::ReluBias || g.epilogue == Epilogue::GeluBias;
  if (has_bias && g.bias_dtype != cd && g.bias_dtype != DType::F32)
    fail(std::string("bias dtype ") + dtype_name(g.bias_dtype) + " must be the D dtype " + dtype_name(cd) + " or F32");

  // Leading dimensions: at least the number of rows of the stored matrix (cuBLAS rule).
  const std::int64_t a_rows = g.transa == Op::N ? g.m : g.k, a_cols = g.transa == Op::N ? g.k : g.m;
  const std::int64_t b_rows = g.transb == Op::N ? g.k : g.n, b_cols = g.transb == Op::N ? g.n : g.k;
  auto max1 = [](std::int64_t v) { return v > 1 ? v : std::int64_t{1}; };
  if (g.lda < max1(a_rows))
    fail("lda=" + s(g.lda) + " is less than the " + s(a_rows) + " rows of A as stored (" + s(a_rows) + " x " +
         s(a_cols) + ")");
  if (g.ldb < max1(b_rows))
    fail("ldb=" + s(g.ldb) + " is less than the " + s(b_rows) + " rows of B as stored (" + s(b_rows) + " x " +
         s(b_cols) + ")");
  if (g.ldd < max1(g.m))
    fail("ldd=" + s(g.ldd) + " is less than the " + s(g.m) + " rows of D (" + s(g.m) + " x " + s(g.n) + ")");
  const bool reads_c = g.beta != 0.0f;
  if (reads_c && g.ldc < max1(g.m))
    fail("ldc=" + s(g.ldc) + " is less than the " + s(g.m) + " rows of C (" + s(g.m) + " x " + s(g.n) + ")");
  if (reads_c && g.c == g.d && (g.ldc != g.ldd || g.stride_c != g.stride_d))
    fail("in-place C == D needs ldc == ldd and stride_c == stride_d");

  if (g.batch > 1) {
    if (g.stride_a < 0 || g.stride_b < 0 || g.stride_c < 0) fail("negative batch stride");
    if (g.m > 0 && g.n > 0 && g.stride_d < g.ldd * g.n)
      fail("stride_d=" + s(g.stride_d) + " < ldd * n = " + s(g.ldd * g.n) + ": the batches of D would overlap");
  }
  const bool empty_out = g.m == 0 || g.n == 0;
  if (!empty_out) {
    if (!g.d) fail("D is null");
    if (g.k > 0 && (!g.a || !g.b)) fail(std::string(!g.a ? "A" : "B") + " is null");
    if (reads_c && !g.c) fail("beta != 0 but C is null");
    if (has_bias && !g.bias) fail(std::string("epilogue ") + epilogue_name(g.epilogue) + " needs a bias pointer");
  }
}

}  // namespace twin::rt
