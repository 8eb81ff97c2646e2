#include "reference/fast/fast_gemm.h"

#include "reference/precision.h"  // TWIN_VECTOR_CLONES

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <type_traits>
#include <vector>

#if defined(TWIN_REFERENCE_DNNL)
#include <omp.h>

#include <dnnl.hpp>
#elif defined(TWIN_REFERENCE_OPENBLAS)
#include <cblas.h>
// OpenBLAS's own API (cblas.h here may be netlib's header, which lacks them).
extern "C" {
void openblas_set_num_threads(int num_threads);
char* openblas_get_config(void);
}
#endif

namespace twin::reference {

TWIN_VECTOR_CLONES void to_double(const float* src, double* dst, Eigen::Index n) {
  for (Eigen::Index i = 0; i < n; ++i) dst[i] = src[i];
}
TWIN_VECTOR_CLONES void to_float(const double* src, float* dst, Eigen::Index n) {
  for (Eigen::Index i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

namespace {
void check_inner(const char* what, Eigen::Index ka, Eigen::Index kb) {
  if (ka != kb)
    throw std::invalid_argument(std::string(what) + ": inner dimensions differ (" + std::to_string(ka) + " vs " +
                                std::to_string(kb) + ")");
}

#if defined(TWIN_REFERENCE_DNNL)
// The upper half of each value's fp32 bits into `out` (a value is read as its fp32 rounding, as
// the fp32 paths read it); false when some fp32 value is not a bf16 value (its lower half is not
// zero), which the bf16 matmul would read wrongly. One pass without calls or branches, which GCC
// vectorises (fast_gemm.cpp is built with -O3).
template <class Scalar>
TWIN_ALWAYS_INLINE std::uint32_t upper_halves(const Scalar* src, Eigen::Index n, std::uint16_t* dst) {
  std::uint32_t low = 0;
  for (Eigen::Index i = 0; i < n; ++i) {
    const float f = static_cast<float>(src[i]);
    std::uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    low |= u & 0xffffu;
    dst[i] = static_cast<std::uint16_t>(u >> 16);
  }
  return low;
}
// The loop above for each source type, as vector clones (a template cannot be one).
TWIN_VECTOR_CLONES std::uint32_t upper_halves_of(const double* src, Eigen::Index n, std::uint16_t* dst) {
  return upper_halves(src, n, dst);
}
TWIN_VECTOR_CLONES std::uint32_t upper_halves_of(const float* src, Eigen::Index n, std::uint16_t* dst) {
  return upper_halves(src, n, dst);
}
template <class Scalar>
bool bf16_bits_n(const Scalar* src, Eigen::Index n, std::vector<std::uint16_t>& out) {
  out.resize(static_cast<std::size_t>(n));
  return upper_halves_of(src, n, out.data()) == 0;
}
template <class Matrix>
bool bf16_bits(const Matrix& m, std::vector<std::uint16_t>& out) {
  return bf16_bits_n(m.data(), m.size(), out);
}

// Whether oneDNN has a bf16 matmul on this CPU (its kernels need AVX-512; asked once).
bool bf16_matmul_supported() {
  static const bool supported = [] {
    using dt = dnnl::memory::data_type;
    using tag = dnnl::memory::format_tag;
    try {
      const dnnl::engine engine(dnnl::engine::kind::cpu, 0);
      const dnnl::memory::desc a({2, 2}, dt::bf16, tag::ab), b({2, 2}, dt::bf16, tag::ab), c({2, 2}, dt::f32, tag::ab);
      dnnl::matmul::primitive_desc(dnnl::matmul::desc(a, b, c), engine);
      return true;
    } catch (const dnnl::error&) {
      return false;
    }
  }();
  return supported;
}

// c [m, n] = a [m, k] times b ([k, n], stored as [n, k] when b_transposed), both as bf16 bits;
// false where this CPU has no bf16 matmul (oneDNN's needs AVX-512: an AVX2 machine gets the fp32
// GEMM, which computes the same fp32 sums of the same exact products).
bool bf16_matmul(const std::uint16_t* a, const std::uint16_t* b, bool b_transposed, Eigen::Index k, FMat& c) {
  using dt = dnnl::memory::data_type;
  using tag = dnnl::memory::format_tag;
  static thread_local dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  static thread_local dnnl::stream stream(engine);
  const dnnl::memory::dim m = c.rows(), n = c.cols();
  const dnnl::memory::desc a_md({m, k}, dt::bf16, tag::ab), b_md({k, n}, dt::bf16, b_transposed ? tag::ba : tag::ab),
      c_md({m, n}, dt::f32, tag::ab);
  if (!bf16_matmul_supported()) return false;
  // oneDNN's primitive cache makes a repeated shape's creation cheap (about a microsecond).
  const dnnl::matmul matmul(dnnl::matmul::primitive_desc(dnnl::matmul::desc(a_md, b_md, c_md), engine));
  dnnl::memory am(a_md, engine, const_cast<std::uint16_t*>(a)), bm(b_md, engine, const_cast<std::uint16_t*>(b)),
      cm(c_md, engine, c.data());
  matmul.execute(stream, {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}});
  stream.wait();
  return true;
}

// Both as bf16 bits when every value is one: then c = a op(b) through the bf16 matmul.
template <class Matrix>
bool try_bf16_matmul(const Matrix& a, const Matrix& b, bool b_transposed, FMat& c) {
  static thread_local std::vector<std::uint16_t> ab, bb;
  return bf16_bits(a, ab) && bf16_bits(b, bb) && bf16_matmul(ab.data(), bb.data(), b_transposed, a.cols(), c);
}
#endif

// c = alpha a op(b), op(b) = b^T when b_transposed; the shapes are checked by the callers.
void gemm(const FMat& a, const FMat& b, bool b_transposed, float alpha, bool inputs_bf16, FMat& c) {
  const auto m = a.rows(), k = a.cols(), n = c.cols();
#if defined(TWIN_REFERENCE_DNNL)
  if (inputs_bf16 && try_bf16_matmul(a, b, b_transposed, c)) {
    if (alpha != 1.0f) c *= alpha;
    return;
  }
  const dnnl_status_t st = dnnl_sgemm('N', b_transposed ? 'T' : 'N', m, n, k, alpha, a.data(), k, b.data(),
                                      b_transposed ? k : n, 0.0f, c.data(), n);
  if (st != dnnl_success) throw std::runtime_error("dnnl_sgemm failed with status " + std::to_string(int(st)));
#elif defined(TWIN_REFERENCE_OPENBLAS)
  (void)inputs_bf16;
  cblas_sgemm(CblasRowMajor, CblasNoTrans, b_transposed ? CblasTrans : CblasNoTrans, static_cast<int>(m),
              static_cast<int>(n), static_cast<int>(k), alpha, a.data(), static_cast<int>(k), b.data(),
              static_cast<int>(b_transposed ? k : n), 0.0f, c.data(), static_cast<int>(n));
#else
  (void)inputs_bf16, (void)m, (void)k, (void)n;
  if (b_transposed)
    c.noalias() = alpha * (a * b.transpose());
  else
    c.noalias() = alpha * (a * b);
#endif
}
}  // namespace

FMat matmul_nt(const FMat& a, const FMat& b, float alpha, bool inputs_bf16) {
  check_inner("matmul_nt", a.cols(), b.cols());
  if (a.rows() == 0 || b.rows() == 0 || a.cols() == 0) return FMat::Zero(a.rows(), b.rows());
  FMat c(a.rows(), b.rows());
  gemm(a, b, true, alpha, inputs_bf16, c);
  return c;
}

FMat matmul_nn(const FMat& a, const FMat& b, bool inputs_bf16) {
  check_inner("matmul_nn", a.cols(), b.rows());
  if (a.rows() == 0 || b.cols() == 0 || a.cols() == 0) return FMat::Zero(a.rows(), b.cols());
  FMat c(a.rows(), b.cols());
  gemm(a, b, false, 1.0f, inputs_bf16, c);
  return c;
}

FMat matmul_nt(const DMat& a, const DMat& b, bool inputs_bf16) {
  check_inner("matmul_nt", a.cols(), b.cols());
  if (a.rows() == 0 || b.rows() == 0 || a.cols() == 0) return FMat::Zero(a.rows(), b.rows());
#if defined(TWIN_REFERENCE_DNNL)
  if (inputs_bf16) {
    FMat c(a.rows(), b.rows());
    if (try_bf16_matmul(a, b, true, c)) return c;
  }
#endif
  return matmul_nt(FMat(a.cast<float>()), FMat(b.cast<float>()), 1.0f, false);
}

namespace {
template <class Matrix>
void make_operand(const Matrix& m, bool inputs_bf16, std::vector<std::uint16_t>& bf16, FMat& f32) {
#if defined(TWIN_REFERENCE_DNNL)
  if (inputs_bf16 && m.size() > 0 && bf16_matmul_supported() && bf16_bits(m, bf16)) return;
  bf16.clear();
#else
  (void)inputs_bf16, (void)bf16;
#endif
  f32 = m.template cast<float>();
}
}  // namespace

GemmOperand::GemmOperand(const DMat& m, bool inputs_bf16) : rows_(m.rows()), cols_(m.cols()) {
  make_operand(m, inputs_bf16, bf16_, f32_);
}
GemmOperand::GemmOperand(const FMat& m, bool inputs_bf16) : rows_(m.rows()), cols_(m.cols()) {
  make_operand(m, inputs_bf16, bf16_, f32_);
}

FMat GemmOperand::f32() const {
  if (!holds_bf16()) return f32_;
  FMat f(rows_, cols_);
  for (Eigen::Index i = 0; i < f.size(); ++i) {
    const std::uint32_t u = std::uint32_t(bf16_[static_cast<std::size_t>(i)]) << 16;  // exact
    std::memcpy(f.data() + i, &u, sizeof u);
  }
  return f;
}

namespace {
// c = alpha a op(b) for a prepared b (op(b) = b^T when b_transposed); the shapes are checked by
// the callers, and a is not empty.
template <class Matrix>
FMat gemm_prepared(const Matrix& a, const GemmOperand& b, bool b_transposed, float alpha, bool inputs_bf16) {
  FMat c(a.rows(), b_transposed ? b.rows() : b.cols());
#if defined(TWIN_REFERENCE_DNNL)
  if (inputs_bf16 && b.holds_bf16()) {
    static thread_local std::vector<std::uint16_t> ab;
    if (bf16_bits(a, ab) && bf16_matmul(ab.data(), b.bf16_bits().data(), b_transposed, a.cols(), c)) {
      if (alpha != 1.0f) c *= alpha;
      return c;
    }
  }
#endif
  (void)inputs_bf16;
  FMat af;
  const FMat* ap;
  if constexpr (std::is_same_v<Matrix, FMat>) {
    ap = &a;
  } else {
    af = a.template cast<float>();
    ap = &af;
  }
  if (b.holds_bf16())
    gemm(*ap, b.f32(), b_transposed, alpha, false, c);
  else
    gemm(*ap, b.f32_values(), b_transposed, alpha, false, c);
  return c;
}
}  // namespace

FMat matmul_nt(const DMat& a, const GemmOperand& b, bool inputs_bf16) {
  check_inner("matmul_nt", a.cols(), b.cols());
  if (a.rows() == 0 || b.rows() == 0 || a.cols() == 0) return FMat::Zero(a.rows(), b.rows());
  return gemm_prepared(a, b, true, 1.0f, inputs_bf16);
}

FMat matmul_nt(const FMat& a, const GemmOperand& b, float alpha, bool inputs_bf16) {
  check_inner("matmul_nt", a.cols(), b.cols());
  if (a.rows() == 0 || b.rows() == 0 || a.cols() == 0) return FMat::Zero(a.rows(), b.rows());
  return gemm_prepared(a, b, true, alpha, inputs_bf16);
}

FMat matmul_nn(const FMat& a, const GemmOperand& b, bool inputs_bf16) {
  check_inner("matmul_nn", a.cols(), b.rows());
  if (a.rows() == 0 || b.cols() == 0 || a.cols() == 0) return FMat::Zero(a.rows(), b.cols());
  return gemm_prepared(a, b, false, 1.0f, inputs_bf16);
}

std::string gemm_backend() {
#if defined(TWIN_REFERENCE_DNNL)
  const dnnl_version_t* v = dnnl_version();
  return "oneDNN " + std::to_string(v->major) + "." + std::to_string(v->minor) + "." + std::to_string(v->patch) +
         (bf16_matmul_supported() ? " (dnnl_sgemm; bf16 matmul for bf16 inputs)"
                                  : " (dnnl_sgemm; no bf16 matmul on this CPU: bf16 inputs through dnnl_sgemm)");
#elif defined(TWIN_REFERENCE_OPENBLAS)
  return std::string("OpenBLAS cblas_sgemm (") + openblas_get_config() + ")";
#else
  return "Eigen float GEMM (neither oneDNN nor OpenBLAS found at build time)";
#endif
}

void set_gemm_threads(int n) {
  if (n < 1) throw std::invalid_argument("set_gemm_threads: need at least one thread, got " + std::to_string(n));
#if defined(TWIN_REFERENCE_DNNL)
  omp_set_num_threads(n);  // oneDNN's CPU runtime here is OpenMP
#elif defined(TWIN_REFERENCE_OPENBLAS)
  openblas_set_num_threads(n);
#endif
}

}  // namespace twin::reference
