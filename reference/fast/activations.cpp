#include "reference/fast/activations.h"

#include <cmath>

#include <unsupported/Eigen/SpecialFunctions>

#include "reference/fast/fast_gemm.h"  // to_float, to_double

namespace twin::reference::fast {

using RowArrayF = Eigen::Array<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

namespace {
// Silu after exp: x = R(x / R(1 + R(e))), e = exp(-x), R the bf16 rounding, in one pass.
TWIN_VECTOR_CLONES void silu_after_exp_bf16(float* x, const float* e, Eigen::Index n) {
  using R = Precision;
  for (Eigen::Index i = 0; i < n; ++i) x[i] = R::round_bf16(x[i] / R::round_bf16(R::round_bf16(e[i]) + 1.0f));
}
// The GLU's product R(a * lin), written as double.
TWIN_VECTOR_CLONES void glu_product_bf16(const float* a, const float* lin, double* y, Eigen::Index n) {
  for (Eigen::Index i = 0; i < n; ++i) y[i] = Precision::round_bf16(a[i] * lin[i]);
}
}  // namespace

// act1's Gelu / Silu of fp32 values x in place, in fp32 arithmetic, each `rounds:` of act1 a
// Precision::act_inplace of the fp32 result (the same values as act1's double ops then act()).
// Each expression is evaluated into an fp32 array on its own: Eigen vectorises exp and erf only
// while no cast to double sits in the same expression.
static void activation_inplace(ActivationFunc f, RowArrayF& x, const Precision& p) {
  if (f == ActivationFunc::Silu && p.params_dtype == DType::BF16) {  // the same, in one pass after exp
    const RowArrayF e = (-x).exp();
    return silu_after_exp_bf16(x.data(), e.data(), x.size());  // rounds: exp(-x), 1 + ..., x / ...
  }
  if (f == ActivationFunc::Silu) {
    RowArrayF e = (-x).exp();
    p.act_inplace(e.data(), e.size());  // rounds: exp(-x)
    e += 1.0f;
    p.act_inplace(e.data(), e.size());  // rounds: 1 + ...
    x /= e;
    p.act_inplace(x.data(), x.size());  // rounds: x / ...
    return;
  }
  // Gelu: x * 0.5 * (1 + erf(x / sqrt(2))), one store
  x = x * 0.5f * (1.0f + (x * static_cast<float>(M_SQRT1_2)).erf());
  p.act_inplace(x.data(), x.size());  // rounds: output
}

Mat activation(ActivationFunc f, const Mat& x, const Precision& p) {
  RowArrayF xf(x.rows(), x.cols());
  to_float(x.data(), xf.data(), x.size());
  activation_inplace(f, xf, p);
  Mat y(x.rows(), x.cols());
  to_double(xf.data(), y.data(), xf.size());
  return y;
}

Mat glu(ActivationFunc f, const Mat& x, const Precision& p) {
  const Eigen::Index half = x.cols() / 2;
  RowArrayF a(x.rows(), half), lin(x.rows(), half);  // torch.chunk(x, 2, dim=-1)
  for (Eigen::Index r = 0; r < x.rows(); ++r) {
    to_float(x.data() + r * x.cols(), a.data() + r * half, half);
    to_float(x.data() + r * x.cols() + half, lin.data() + r * half, half);
  }
  activation_inplace(f, a, p);
  Mat y(x.rows(), half);
  if (p.params_dtype == DType::BF16) {
    glu_product_bf16(a.data(), lin.data(), y.data(), a.size());  // rounds: act(x_glu) * x_linear
    return y;
  }
  a *= lin;
  p.act_inplace(a.data(), a.size());  // rounds: act(x_glu) * x_linear
  to_double(a.data(), y.data(), a.size());
  return y;
}

}  // namespace twin::reference::fast
