#include "reference/fast_gemm.h"

#include <stdexcept>

#ifdef TWIN_REFERENCE_OPENBLAS
#include <cblas.h>
// OpenBLAS's own API (cblas.h here may be netlib's header, which lacks them).
extern "C" {
void openblas_set_num_threads(int num_threads);
char* openblas_get_config(void);
}
#endif

namespace twin::reference {

namespace {
void check_inner(const char* what, Eigen::Index ka, Eigen::Index kb) {
  if (ka != kb)
    throw std::invalid_argument(std::string(what) + ": inner dimensions differ (" + std::to_string(ka) + " vs " +
                                std::to_string(kb) + ")");
}
}  // namespace

FMat matmul_nt(const FMat& a, const FMat& b, float alpha) {
  check_inner("matmul_nt", a.cols(), b.cols());
  FMat c(a.rows(), b.rows());
  if (c.size() == 0) return c;
  if (a.cols() == 0) return FMat::Zero(a.rows(), b.rows());
#ifdef TWIN_REFERENCE_OPENBLAS
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(a.rows()), static_cast<int>(b.rows()),
              static_cast<int>(a.cols()), alpha, a.data(), static_cast<int>(a.cols()), b.data(),
              static_cast<int>(b.cols()), 0.0f, c.data(), static_cast<int>(c.cols()));
#else
  c.noalias() = alpha * (a * b.transpose());
#endif
  return c;
}

FMat matmul_nn(const FMat& a, const FMat& b) {
  check_inner("matmul_nn", a.cols(), b.rows());
  FMat c(a.rows(), b.cols());
  if (c.size() == 0) return c;
  if (a.cols() == 0) return FMat::Zero(a.rows(), b.cols());
#ifdef TWIN_REFERENCE_OPENBLAS
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(a.rows()), static_cast<int>(b.cols()),
              static_cast<int>(a.cols()), 1.0f, a.data(), static_cast<int>(a.cols()), b.data(),
              static_cast<int>(b.cols()), 0.0f, c.data(), static_cast<int>(c.cols()));
#else
  c.noalias() = a * b;
#endif
  return c;
}

std::string gemm_backend() {
#ifdef TWIN_REFERENCE_OPENBLAS
  return std::string("OpenBLAS cblas_sgemm (") + openblas_get_config() + ")";
#else
  return "Eigen float GEMM (OpenBLAS not found at build time)";
#endif
}

void set_gemm_threads(int n) {
  if (n < 1) throw std::invalid_argument("set_gemm_threads: need at least one thread, got " + std::to_string(n));
#ifdef TWIN_REFERENCE_OPENBLAS
  openblas_set_num_threads(n);
#endif
}

}  // namespace twin::reference
