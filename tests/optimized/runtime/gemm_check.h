// gemm_check.h: host-side helpers for GEMM tests (simulator and GPU): dtype-generic host buffers
// and the check of D against a double-precision product with a tolerance from fp32 accumulation.
#pragma once

#include "core/dtype.h"
#include "optimized/runtime/gemm.h"

#include <Eigen/Dense>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace gemm_check {

using twin::DType;
using twin::rt::Epilogue;
using twin::rt::GemmArgs;
using twin::rt::Op;

// Host buffers of any dtype (the simulator's device memory is host memory; these are plain
// vectors because the sim GEMM does not require device allocations).
struct Buf {
  DType dt;
  std::vector<unsigned char> bytes;
  Buf(DType dt, std::size_t n) : dt(dt), bytes(n * twin::dtype_size(dt)) {}
  std::size_t size() const { return bytes.size() / twin::dtype_size(dt); }
  void* data() { return bytes.data(); }
  float get(std::size_t i) const {
    std::uint16_t h;
    float f;
    switch (dt) {
      case DType::F32:
        std::memcpy(&f, &bytes[i * 4], 4);
        return f;
      case DType::BF16:
        std::memcpy(&h, &bytes[i * 2], 2);
        return twin::bf16_bits_to_float(h);
      default:
        std::memcpy(&h, &bytes[i * 2], 2);
        return twin::fp16_bits_to_float(h);
    }
  }
  void set(std::size_t i, float v) {
    std::uint16_t h;
    switch (dt) {
      case DType::F32:
        std::memcpy(&bytes[i * 4], &v, 4);
        break;
      case DType::BF16:
        h = twin::float_to_bf16_bits(v);
        std::memcpy(&bytes[i * 2], &h, 2);
        break;
      default:
        h = twin::float_to_fp16_bits(v);
        std::memcpy(&bytes[i * 2], &h, 2);
        break;
    }
  }
  void fill_random(std::mt19937& rng, float lo, float hi) {
    std::uniform_real_distribution<float> d(lo, hi);
    for (std::size_t i = 0; i < size(); ++i) set(i, d(rng));
  }
};

inline double activation(Epilogue e, double x) {
  switch (e) {
    case Epilogue::Relu:
    case Epilogue::ReluBias:
      return x > 0 ? x : 0;
    // tanh-GELU (Hendrycks & Gimpel): sqrt(2/pi) computed, 0.044715 from the paper.
    case Epilogue::Gelu:
    case Epilogue::GeluBias:
      return 0.5 * x * (1 + std::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
    default:
      return x;
  }
}
inline bool has_bias(Epilogue e) { return e == Epilogue::Bias || e == Epilogue::ReluBias || e == Epilogue::GeluBias; }

// Checks D (after the GEMM) against the double-precision reference computed from A, B, C (C as
// it was before the GEMM: c_before), and that D's padding and batch gaps still hold `sentinel`.
// Returns "" or the first difference.
inline std::string check_gemm(const GemmArgs& g, const Buf& a, const Buf& b, const Buf* c_before, const Buf* bias,
                              const Buf& d, float sentinel, const std::string& what) {
  std::vector<bool> covered(d.size(), false);
  for (std::int64_t bt = 0; bt < g.batch; ++bt) {
    Eigen::MatrixXd A(g.m, g.k), B(g.k, g.n);  // op(A) [m, k], op(B) [k, n]
    for (std::int64_t i = 0; i < g.m; ++i)
      for (std::int64_t p = 0; p < g.k; ++p)
        A(i, p) = a.get(bt * g.stride_a + (g.transa == Op::N ? i + p * g.lda : p + i * g.lda));
    for (std::int64_t p = 0; p < g.k; ++p)
      for (std::int64_t j = 0; j < g.n; ++j)
        B(p, j) = b.get(bt * g.stride_b + (g.transb == Op::N ? p + j * g.ldb : j + p * g.ldb));
    Eigen::MatrixXd prod = A * B;                       // [m, n]
    Eigen::MatrixXd mag = A.cwiseAbs() * B.cwiseAbs();  // [m, n] sum of |a||b|
    for (std::int64_t j = 0; j < g.n; ++j)
      for (std::int64_t i = 0; i < g.m; ++i) {
        double cv = g.beta != 0 ? c_before->get(bt * g.stride_c + i + j * g.ldc) : 0.0;
        double bv = has_bias(g.epilogue) ? bias->get(i) : 0.0;
        double pre = g.alpha * prod(i, j) + g.beta * cv + bv;
        double ref = activation(g.epilogue, pre);
        std::size_t di = bt * g.stride_d + i + j * g.ldd;
        covered[di] = true;
        // fp32 accumulation of k products: <= k * u32 * sum|a||b|; alpha/beta/bias/activation in
        // fp32 add ~12 more roundings of magnitudes <= M; the activations are <= 1.2-Lipschitz;
        // then one rounding to D's dtype.
        double M = std::abs(g.alpha) * mag(i, j) + std::abs(g.beta * cv) + std::abs(bv);
        double tol = 1.2 * (g.k + 12) * twin::unit_roundoff(DType::F32) * M + twin::unit_roundoff(d.dt) * std::abs(ref);
        double got = d.get(di);
        if (!(std::abs(got - ref) <= tol))
          return what + ": D(" + std::to_string(i) + "," + std::to_string(j) + ") batch " + std::to_string(bt) + " = " +
                 std::to_string(got) + ", expected " + std::to_string(ref) + " (tolerance " + std::to_string(tol) + ")";
      }
  }
  for (std::size_t i = 0; i < d.size(); ++i)
    if (!covered[i] && d.get(i) != sentinel)
      return what + ": element " + std::to_string(i) + " outside D was written (" + std::to_string(d.get(i)) + ")";
  return "";
}

}  // namespace gemm_check
