#include "reference/activations.h"

#include <cmath>

#include <unsupported/Eigen/SpecialFunctions>

#include "reference/fast/activations.h"

namespace twin::reference {

ActivationFunc activation_from_name(const std::string& name) {
  if (name == "gelu") return ActivationFunc::Gelu;
  if (name == "erf_gelu") return ActivationFunc::ErfGelu;
  if (name == "openai_gelu") return ActivationFunc::OpenAIGelu;
  if (name == "fast_gelu") return ActivationFunc::FastGelu;
  if (name == "quick_gelu") return ActivationFunc::QuickGelu;
  if (name == "silu" || name == "swish") return ActivationFunc::Silu;
  if (name == "relu") return ActivationFunc::Relu;
  if (name == "squared_relu") return ActivationFunc::SquaredRelu;
  throw ConfigError("activation_func: unknown activation '" + name +
                    "' (gelu, erf_gelu, openai_gelu, fast_gelu, quick_gelu, silu, relu, squared_relu)");
}

const char* activation_name(ActivationFunc f) {
  switch (f) {
    case ActivationFunc::Gelu:
      return "gelu";
    case ActivationFunc::ErfGelu:
      return "erf_gelu";
    case ActivationFunc::OpenAIGelu:
      return "openai_gelu";
    case ActivationFunc::FastGelu:
      return "fast_gelu";
    case ActivationFunc::QuickGelu:
      return "quick_gelu";
    case ActivationFunc::Silu:
      return "silu";
    case ActivationFunc::Relu:
      return "relu";
    case ActivationFunc::SquaredRelu:
      return "squared_relu";
  }
  return "?";
}

static double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// One element; `r` is the store into the activation dtype after each torch op.
static double act1(ActivationFunc f, double x, const Precision& p) {
  switch (f) {
    case ActivationFunc::Gelu:                                       // one fused torch kernel
      return p.act(x * 0.5 * (1.0 + std::erf(x / std::sqrt(2.0))));  // rounds: output
    case ActivationFunc::ErfGelu: {
      const double e = p.act(std::erf(p.act(x / 1.41421)));  // rounds: x / 1.41421, erf(...)
      return p.act(p.act(x * 0.5) * p.act(e + 1.0));         // rounds: each op
    }
    case ActivationFunc::OpenAIGelu:  // jit-fused tanh form: one store
      return p.act(0.5 * x * (1.0 + std::tanh(0.7978845608028654 * x * (1.0 + 0.044715 * x * x))));  // rounds: output
    case ActivationFunc::FastGelu:
      return p.act(0.5 * x * (1.0 + std::tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x))));  // rounds: output
    case ActivationFunc::QuickGelu: {
      const double s = p.act(sigmoid(p.act(1.702 * x)));  // rounds: 1.702 * x, sigmoid(...)
      return p.act(x * s);                                // rounds: product
    }
    case ActivationFunc::Silu:
      // torch 1.13's CPU silu kernel is x / (1 + exp(-x)) on Vectorized<scalar_t>: for bf16/fp16
      // each op stores (verified bitwise against LibTorch 1.13, tests/reference/moe/test_moe_torch_crosscheck.cpp).
      return p.act(x / p.act(1.0 + p.act(std::exp(-x))));  // rounds: exp(-x), 1 + ..., x / ...
    case ActivationFunc::Relu:
      return x > 0.0 ? x : 0.0;  // exact
    case ActivationFunc::SquaredRelu: {
      const double r = x > 0.0 ? x : 0.0;
      return p.act(r * r);  // rounds: pow(relu(x), 2)
    }
  }
  return x;
}

// Stores on the longest path through act1 (the `rounds:` marks above).
static int act1_stores(ActivationFunc f) {
  switch (f) {
    case ActivationFunc::ErfGelu:
      return 4;  // x / 1.41421, erf, + 1, product
    case ActivationFunc::QuickGelu:
      return 3;
    case ActivationFunc::Silu:
      return 3;
    case ActivationFunc::Relu:
      return 0;
    default:
      return 1;
  }
}

Mat apply_activation(ActivationFunc f, const Mat& x, const Precision& p) {
  if (p.fast() && fast::has_activation(f)) {  // the same stores in fp32 arithmetic (fast/activations.h)
    p.count_act(act1_stores(f));
    return fast::activation(f, x, p);
  }
  Mat y(x.rows(), x.cols());
  for (Eigen::Index i = 0; i < x.size(); ++i) y.data()[i] = act1(f, x.data()[i], p);
  p.count_act(act1_stores(f));
  return y;
}

Mat glu(ActivationFunc f, const Mat& x, double glu_linear_offset, std::optional<double> clamp_value,
        const Precision& p) {
  if (x.cols() % 2 != 0) throw ShapeError("glu: last dimension " + std::to_string(x.cols()) + " is not even");
  const Eigen::Index half = x.cols() / 2;
  if (p.fast() && fast::has_activation(f) && !clamp_value && glu_linear_offset == 0.0) {
    // Fast mode: the same stores as below, in fp32 arithmetic (fast/activations.h).
    p.count_act(act1_stores(f));  // the activation's path is the longer: the product follows it
    p.count_act();
    return fast::glu(f, x, p);
  }
  Mat x_glu = x.leftCols(half);      // torch.chunk(x, 2, dim=-1)[0]
  Mat x_linear = x.rightCols(half);  // [1]
  if (clamp_value) {
    const double val = *clamp_value;
    x_glu = x_glu.cwiseMin(val);
    x_linear = x_linear.cwiseMin(val).cwiseMax(-val);
  }
  const RoundingCount at_input = rounding_now();
  const Mat a = apply_activation(f, x_glu, p);
  const RoundingCount activation_path = rounding_now();
  rounding_set(at_input);
  if (glu_linear_offset != 0.0) p.count_act();  // the x_linear branch
  rounding_join(activation_path);
  p.count_act();  // the product
  Mat y(x.rows(), half);
  p.with_act([&](auto act) {
    for (Eigen::Index i = 0; i < y.size(); ++i) {
      const double lin = glu_linear_offset == 0.0
                             ? x_linear.data()[i]
                             : act(x_linear.data()[i] + glu_linear_offset);  // rounds: x_linear + offset
      y.data()[i] = act(a.data()[i] * lin);                                  // rounds: act(x_glu) * (...)
    }
  });
  return y;
}

// ---- backward ----------------------------------------------------------------------------------
namespace {
constexpr double kInvSqrt2Pi = 0.3989422804014327;  // 1 / sqrt(2 pi)

// d/dx of the tanh-form gelu 0.5 x (1 + tanh(c x (1 + 0.044715 x^2))).
double tanh_gelu_grad(double x, double c) {
  const double t = std::tanh(c * x * (1.0 + 0.044715 * x * x));
  return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044715 * x * x);
}

// act'(x) in exact arithmetic.
double act1_grad(ActivationFunc f, double x) {
  switch (f) {
    case ActivationFunc::Gelu:
      return 0.5 * (1.0 + std::erf(x / std::sqrt(2.0))) + x * kInvSqrt2Pi * std::exp(-0.5 * x * x);
    case ActivationFunc::ErfGelu: {
      const double z = x / 1.41421;
      return 0.5 * (std::erf(z) + 1.0) + 0.5 * x * (2.0 / std::sqrt(M_PI)) * std::exp(-z * z) / 1.41421;
    }
    case ActivationFunc::OpenAIGelu:
      return tanh_gelu_grad(x, 0.7978845608028654);
    case ActivationFunc::FastGelu:
      return tanh_gelu_grad(x, 0.7978845608);
    case ActivationFunc::QuickGelu: {
      const double s = sigmoid(1.702 * x);
      return s + x * 1.702 * s * (1.0 - s);
    }
    case ActivationFunc::Silu: {
      const double s = sigmoid(x);
      return s * (1.0 + x * (1.0 - s));  // torch's silu_backward
    }
    case ActivationFunc::Relu:
      return x > 0.0 ? 1.0 : 0.0;
    case ActivationFunc::SquaredRelu:
      return x > 0.0 ? 2.0 * x : 0.0;
  }
  return 0.0;
}

// Stores of the backward on the longest path (one per autograd node that stores in T).
int act1_grad_stores(ActivationFunc f) {
  switch (f) {
    case ActivationFunc::Gelu:
    case ActivationFunc::Silu:
      return 1;  // gelu_backward / silu_backward: one kernel
    case ActivationFunc::Relu:
      return 0;  // threshold_backward: exact
    case ActivationFunc::SquaredRelu:
      return 2;  // pow backward, then threshold_backward
    default:
      return act1_stores(f);  // composed forms: one store per forward op, in reverse
  }
}
}  // namespace

Mat activation_backward(ActivationFunc f, const Mat& x, const Mat& dy, const Precision& p) {
  if (dy.rows() != x.rows() || dy.cols() != x.cols())
    throw ShapeError("activation backward: grad_output does not match the saved input");
  Mat dx(x.rows(), x.cols());
  for (Eigen::Index i = 0; i < x.size(); ++i)
    dx.data()[i] = p.act(dy.data()[i] * act1_grad(f, x.data()[i]));  // rounds: dy act'(x), activation dtype
  p.count_act(act1_grad_stores(f));
  return dx;
}

Mat glu_backward(ActivationFunc f, const Mat& x, const Mat& dy, double glu_linear_offset,
                 std::optional<double> clamp_value, const Precision& p) {
  if (x.cols() % 2 != 0) throw ShapeError("glu backward: last dimension " + std::to_string(x.cols()) + " is not even");
  const Eigen::Index half = x.cols() / 2;
  if (dy.rows() != x.rows() || dy.cols() != half)
    throw ShapeError("glu backward: grad_output does not match half the saved input");
  // Element by element, the forward's chunks and clamps included: no [n, ffn] copy of either half
  // and no intermediate gradient buffer (at real sizes each would be as large as the saved input).
  const double lim = clamp_value.value_or(0.0);
  Mat dx(x.rows(), x.cols());
  for (Eigen::Index r = 0; r < x.rows(); ++r)
    for (Eigen::Index c = 0; c < half; ++c) {
      const double x_glu = clamp_value ? std::min(x(r, c), lim) : x(r, c);  // chunk [0].clamp(max=lim)
      const double x_lin = clamp_value ? std::max(std::min(x(r, c + half), lim), -lim) : x(r, c + half);
      const double lin = glu_linear_offset == 0.0 ? x_lin : p.act(x_lin + glu_linear_offset);
      const double a = act1(f, x_glu, p);          // the forward's stored act(x_glu)
      const double d_act = p.act(dy(r, c) * lin);  // rounds: mul's grad of act(x_glu)
      double d_lin = p.act(dy(r, c) * a);          // rounds: mul's grad of x_linear
      if (clamp_value && (x(r, c + half) > lim || x(r, c + half) < -lim)) d_lin = 0.0;  // clamp's backward
      dx(r, c + half) = d_lin;
      const double d_glu = p.act(d_act * act1_grad(f, x_glu));  // rounds: dy act'(x), as activation_backward
      dx(r, c) = clamp_value && x(r, c) > lim ? 0.0 : d_glu;    // clamp(max)'s backward
    }
  p.count_act();                     // the product's gradients
  p.count_act(act1_grad_stores(f));  // the activation's backward (activation_backward's count)
  return dx;
}

}  // namespace twin::reference
