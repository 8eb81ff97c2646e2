// gemm.h: matrix multiplication with cuBLASLt semantics, on the GPU (cuBLASLt) or the simulator.
//
// Design: one argument struct mirrors cublasLtMatmul: column-major operands (element (i, j) of a
// matrix at ptr[i + j * ld], batch b at ptr + b * stride elements), D = epilogue(alpha * op(A) *
// op(B) + beta * C + bias), op(A) is m x k, op(B) is k x n, C and D are m x n. Inputs are bf16,
// fp16 or fp32 (A and B the same), the compute type is fp32 (fp32 accumulation), C and D share one
// dtype (the input dtype or fp32), and the result is rounded once to D's dtype. Both backends run
// the same validation (validate_gemm), which rejects what cuBLAS rejects, e.g. lda < rows of A,
// with a message naming the argument. A torch Linear on row-major tensors, Y[rows, out] =
// X[rows, in] * W[out, in]^T, is column-major Y^T = W * X^T: transa = T with a = W, lda = in;
// transb = N with b = X, ldb = in; m = out, n = rows, k = in; d = Y, ldd = out.
#pragma once

#include "core/dtype.h"
#include "optimized/runtime/device.h"

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace twin::rt {

enum class Op { N, T };  // CUBLAS_OP_N, CUBLAS_OP_T

// cublasLtEpilogue_t: BIAS adds a length-m vector to every column of D (before the activation).
// GELU is the tanh approximation, as in cuBLASLt.
enum class Epilogue { Default, Relu, Gelu, Bias, ReluBias, GeluBias };
const char* epilogue_name(Epilogue e);

struct GemmError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

struct GemmArgs {
  Op transa = Op::N, transb = Op::N;
  std::int64_t m = 0, n = 0, k = 0;
  float alpha = 1.0f, beta = 0.0f;
  DType ab_dtype = DType::F32;  // A and B
  DType cd_dtype = DType::F32;  // C and D
  const void* a = nullptr;      // stored (transa == N ? m x k : k x m)
  std::int64_t lda = 0, stride_a = 0;
  const void* b = nullptr;  // stored (transb == N ? k x n : n x k)
  std::int64_t ldb = 0, stride_b = 0;
  const void* c = nullptr;  // read only when beta != 0; may equal d (same ld and stride)
  std::int64_t ldc = 0, stride_c = 0;
  void* d = nullptr;
  std::int64_t ldd = 0, stride_d = 0;
  std::int64_t batch = 1;  // strided batched GEMM when > 1
  Epilogue epilogue = Epilogue::Default;
  const void* bias = nullptr;     // length m, shared by all batches
  DType bias_dtype = DType::F32;  // cd_dtype or F32
};

// Throws GemmError naming the offending argument(s); `who` prefixes the message.
void validate_gemm(const GemmArgs& g, const char* who = "gemm");
// The cost model's declaration of one GEMM (runtime/cost_model.h), made by both backends per GEMM:
// 2 m n k FLOPs per batch; A and B read once (once in all when a stride is 0: shared by the
// batches), C read when beta != 0, D written, the bias once.
void declare_gemm_cost(const GemmArgs& g, const char* kernel = "gemm");

class Gemm {
 public:
  virtual ~Gemm() = default;
  virtual Backend backend() const = 0;
  // A (strided batched) GEMM, enqueued on `stream`.
  virtual void run(const GemmArgs& g, cudaStream_t stream) = 0;
  // Independent GEMMs of different shapes (e.g. one per expert); empty ones (m, n or k == 0) are
  // allowed (k == 0 gives D = beta * C + bias). All are validated before any runs.
  virtual void run_grouped(const std::vector<GemmArgs>& groups, cudaStream_t stream) = 0;
};

Gemm& gemm(Backend b);

// How the GPU backend runs a grouped GEMM: the groups one cublasGemmGroupedBatchedEx call can take
// (D = alpha op(A) op(B) + beta C written over C, fp32 compute, 32-bit sizes, no epilogue, no batch)
// go in one call per dtype pair, the others one cublasLtMatmul each; groups with m or n == 0 are in
// neither (nothing to write). Shared with the tests, so the split is checked without a GPU.
struct GroupedGemmCalls {
  std::vector<std::vector<std::size_t>> grouped;  // indices into the groups, one list per call
  std::vector<std::size_t> alone;                 // indices run one matmul each
};
GroupedGemmCalls split_grouped_gemm(const std::vector<GemmArgs>& groups);
// Why cublasGemmGroupedBatchedEx cannot take g ("" when it can).
std::string grouped_call_refusal(const GemmArgs& g);

// Epilogue activation in fp32 (shared by the simulator and tests).
float apply_epilogue_activation(Epilogue e, float x);

}  // namespace twin::rt
