// The fp32 GEMMs of the reference's fast mode (ComputeMode::Fast, reference/precision.h).
//
// C = alpha A op(B) with fp32 inputs and fp32 accumulation, as Megatron's own GEMMs (torch.matmul,
// baddbmm, bmm) accumulate: through OpenBLAS's cblas_sgemm when the build found OpenBLAS, else
// through Eigen's own float GEMM (the fallback: same arithmetic class, slower; gemm_backend()
// says which). The order of the fp32 sums is the library's, which is what the counted bound
// allows for (two fp32 reductions of length K in any orders: 2 gamma_K(u_fp32) apart).
//
// Threads: OpenBLAS's own pool (OPENBLAS_NUM_THREADS, or set_gemm_threads); the Eigen fallback is
// single-threaded.
#pragma once

#include <Eigen/Core>
#include <string>

namespace twin::reference {

using FMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;  // [rows, cols], row-major

// a [m, k], b [n, k]: alpha a b^T [m, n] (x @ weight^T, q k^T).
FMat matmul_nt(const FMat& a, const FMat& b, float alpha = 1.0f);
// a [m, k], b [k, n]: a b [m, n] (probs @ v).
FMat matmul_nn(const FMat& a, const FMat& b);

// "OpenBLAS <version/config>" or "Eigen (no OpenBLAS at build time)": recorded by benchmarks.
std::string gemm_backend();
// Threads of the BLAS pool (OpenBLAS); no effect on the single-threaded Eigen fallback.
void set_gemm_threads(int n);

}  // namespace twin::reference
