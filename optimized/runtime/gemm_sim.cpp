// gemm_sim.cpp: the simulator's GEMM (cuBLASLt semantics on the host).
//
// Design: op(A) and op(B) are widened to fp32 matrices and multiplied by Eigen in fp32 (fp32
// accumulation, like cuBLASLt's CUBLAS_COMPUTE_32F; the summation order is Eigen's blocking, not
// cuBLAS's, so results agree to fp32 accumulation error, not bitwise), in chunks of D's columns on
// the simulator's workers (bitwise the same at any worker count). The epilogue alpha * acc +
// beta * C + bias -> activation is evaluated in fp32 and rounded once to D's dtype. Work is
// enqueued on the stream, so it is captured into graphs like kernel launches.
#include "core/dtype.h"
#include "optimized/runtime/gemm.h"
#include "optimized/runtime/sim_stream.h"

#include <Eigen/Core>
#include <algorithm>
#include <atomic>
#include <thread>
#include <vector>

#include "optimized/runtime/cudasim_options.h"

namespace twin::rt {
namespace {

using MatF = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::ColMajor>;

float load(DType dt, const void* base, std::int64_t idx) {
  switch (dt) {
    case DType::F32:
      return static_cast<const float*>(base)[idx];
    case DType::BF16:
      return bf16_bits_to_float(static_cast<const std::uint16_t*>(base)[idx]);
    case DType::F16:
      return fp16_bits_to_float(static_cast<const std::uint16_t*>(base)[idx]);
    default:
      throw GemmError(std::string("gemm [sim]: unsupported dtype ") + dtype_name(dt));
  }
}
void store(DType dt, void* base, std::int64_t idx, float v) {
  switch (dt) {
    case DType::F32:
      static_cast<float*>(base)[idx] = v;
      break;
    case DType::BF16:
      static_cast<std::uint16_t*>(base)[idx] = float_to_bf16_bits(v);
      break;
    case DType::F16:
      static_cast<std::uint16_t*>(base)[idx] = float_to_fp16_bits(v);
      break;
    default:
      throw GemmError(std::string("gemm [sim]: unsupported dtype ") + dtype_name(dt));
  }
}

// op(X) as an fp32 rows x cols matrix; X stored column-major with leading dimension ld.
MatF widen(DType dt, const void* base, std::int64_t ld, Op op, std::int64_t rows, std::int64_t cols) {
  MatF out(rows, cols);
  for (std::int64_t j = 0; j < cols; ++j)
    for (std::int64_t i = 0; i < rows; ++i) out(i, j) = load(dt, base, op == Op::N ? i + j * ld : j + i * ld);
  return out;
}

std::size_t esize(DType dt) { return dtype_size(dt); }

// fn(j0, j1) for the columns of D in fixed chunks of 64, on up to the simulator's workers: each chunk
// is one Eigen product alone, so D is bitwise the same at any worker count (a real layer's GEMMs on
// every core; a small one, below 8 MFLOP, on the stream's thread alone).
template <class F>
void for_column_chunks(std::int64_t n, double flops, const F& fn) {
  constexpr std::int64_t kChunk = 64;
  const std::int64_t chunks = (n + kChunk - 1) / kChunk;
  const std::int64_t workers = flops >= 8e6 ? std::min<std::int64_t>(cudasim::options().workers, chunks) : 1;
  std::atomic<std::int64_t> next{0};
  auto work = [&] {
    for (std::int64_t ch; (ch = next++) < chunks;) fn(ch * kChunk, std::min(n, (ch + 1) * kChunk));
  };
  std::vector<std::thread> threads;
  for (std::int64_t w = 1; w < workers; ++w) threads.emplace_back(work);
  work();
  for (std::thread& t : threads) t.join();
}

void compute(const GemmArgs& g) {
  if (g.m == 0 || g.n == 0) return;
  const bool has_bias =
      g.epilogue == Epilogue::Bias || g.epilogue == Epilogue::ReluBias || g.epilogue == Epilogue::GeluBias;
  for (std::int64_t bt = 0; bt < g.batch; ++bt) {
    const void* a = static_cast<const char*>(g.a) + bt * g.stride_a * esize(g.ab_dtype);
    const void* b = static_cast<const char*>(g.b) + bt * g.stride_b * esize(g.ab_dtype);
    const MatF A = g.k > 0 ? widen(g.ab_dtype, a, g.lda, g.transa, g.m, g.k) : MatF();  // [m, k]
    const void* c = g.beta != 0.0f ? static_cast<const char*>(g.c) + bt * g.stride_c * esize(g.cd_dtype) : nullptr;
    void* d = static_cast<char*>(g.d) + bt * g.stride_d * esize(g.cd_dtype);
    for_column_chunks(g.n, 2.0 * double(g.m) * double(g.n) * double(g.k), [&](std::int64_t j0, std::int64_t j1) {
      MatF acc = MatF::Zero(g.m, j1 - j0);  // [m, j1 - j0]
      if (g.k > 0) {
        // op(B)'s columns j0..j1: op(B)[:, j] is B's column j (N) or row j (T).
        const void* bj = static_cast<const char*>(b) + (g.transb == Op::N ? j0 * g.ldb : j0) * esize(g.ab_dtype);
        acc.noalias() = A * widen(g.ab_dtype, bj, g.ldb, g.transb, g.k, j1 - j0);
      }
      for (std::int64_t j = j0; j < j1; ++j)
        for (std::int64_t i = 0; i < g.m; ++i) {
          float v = g.alpha * acc(i, j - j0);
          if (c) v += g.beta * load(g.cd_dtype, c, i + j * g.ldc);
          if (has_bias) v += load(g.bias_dtype, g.bias, i);
          store(g.cd_dtype, d, i + j * g.ldd, apply_epilogue_activation(g.epilogue, v));
        }
    });
  }
}

class SimGemm final : public Gemm {
 public:
  Backend backend() const override { return Backend::Sim; }
  void run(const GemmArgs& g, cudaStream_t stream) override {
    validate_gemm(g, "gemm [sim]");
    declare_gemm_cost(g);
    cudasim::detail::enqueue(stream, [g] { compute(g); });
  }
  void run_grouped(const std::vector<GemmArgs>& groups, cudaStream_t stream) override {
    for (std::size_t i = 0; i < groups.size(); ++i) {
      std::string who = "grouped gemm [sim] group " + std::to_string(i);
      validate_gemm(groups[i], who.c_str());
    }
    for (const auto& g : groups) declare_gemm_cost(g, "grouped_gemm");
    cudasim::detail::enqueue(stream, [groups] {
      for (const auto& g : groups) compute(g);
    });
  }
};

}  // namespace

Gemm& sim_gemm() {
  static SimGemm g;
  return g;
}

}  // namespace twin::rt
