#include "reference/torch_norm.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace twin::reference {

static void check_width(const Mat& x, int hidden, const char* what) {
  if (x.cols() != hidden)
    throw ShapeError(std::string(what) + ": input last dimension " + std::to_string(x.cols()) +
                     " does not match normalized_shape [" + std::to_string(hidden) + "]");
}

NormGrads Norm::backward(const Mat&, const Mat&) const {
  throw std::logic_error("this norm has no backward in the reference yet");
}

// ---- LayerNorm --------------------------------------------------------------------------------
LayerNorm::LayerNorm(int hidden_size, double eps, bool zero_centered_gamma, Precision p)
    : weight_(RowVec::Constant(hidden_size, zero_centered_gamma ? 0.0 : 1.0)),
      bias_(RowVec::Zero(hidden_size)),
      hidden_size_(hidden_size),
      eps_(eps),
      zero_centered_gamma_(zero_centered_gamma),
      p_(p) {}

void LayerNorm::load_state_dict(const StateDict& sd, const std::string& prefix) {
  weight_ = sd.vector(prefix + "weight", hidden_size_);
  bias_ = sd.vector(prefix + "bias", hidden_size_);
}

RowVec LayerNorm::gamma() const { return zero_centered_gamma_ ? RowVec((weight_.array() + 1.0).matrix()) : weight_; }

namespace {
// The forwards' row loops, apart from the (virtual) forwards so that they can be vector clones.
TWIN_VECTOR_CLONES void layer_norm_rows(const Mat& x, const RowVec& gamma, const RowVec& beta, double eps,
                                        const Precision& p, Mat& y) {
  p.with_act([&](auto act) {
    for (Eigen::Index r = 0; r < x.rows(); ++r) {
      const double mean = p.f32(x.row(r).mean());  // rounds: fp32 statistic
      const double var = (x.row(r).array() - mean).square().mean();
      const double rstd = p.f32(1.0 / std::sqrt(var + eps));  // rounds: fp32 statistic
      const double *xr = x.data() + r * x.cols(), *gv = gamma.data(), *bv = beta.data();
      double* yr = y.data() + r * x.cols();
      for (Eigen::Index c = 0; c < x.cols(); ++c)
        yr[c] = act((xr[c] - mean) * rstd * gv[c] + bv[c]);  // rounds: output, activation dtype
    }
  });
}

TWIN_VECTOR_CLONES void rms_norm_rows(const Mat& x, const RowVec& gamma, double eps, const Precision& p, Mat& y) {
  p.with_act([&](auto act) {
    for (Eigen::Index r = 0; r < x.rows(); ++r) {
      const double rstd = p.f32(1.0 / std::sqrt(x.row(r).squaredNorm() / x.cols() + eps));  // rounds: fp32 statistic
      const double *xr = x.data() + r * x.cols(), *gv = gamma.data();
      double* yr = y.data() + r * x.cols();
      for (Eigen::Index c = 0; c < x.cols(); ++c) {
        // torch's rms_norm casts x * rstd back to the input dtype before the weight multiply.
        const double xhat = act(xr[c] * rstd);  // rounds: normalised value, activation dtype
        yr[c] = act(xhat * gv[c]);              // rounds: output, activation dtype
      }
    }
  });
}
}  // namespace

Mat LayerNorm::forward(const Mat& x) const {
  check_width(x, hidden_size_, "LayerNorm");
  Mat y(x.rows(), x.cols());
  layer_norm_rows(x, gamma(), bias_, eps_, p_, y);
  p_.count_reduce(2 * x.cols());  // mean, then variance
  // Counted as torch 1.13's CPU kernel rounds (statistics in T): the mean, the variance, rstd and
  // the shift -rstd * mean, each stored in T (u |mean| rstd |gamma| or u |x_hat gamma| each, both
  // at most u x error_magnitude), then the output. Kernels with fp32 statistics (torch CUDA, TE,
  // this reference) round less. Measured against torch 1.13 bf16 on rows of width 8..4096 with
  // |mean| / std up to 100: at most 3.3 u x error_magnitude apart from this reference.
  p_.count_act(5);
  return y;
}

double LayerNorm::error_magnitude(const Mat& x) const {
  const RowVec gamma = this->gamma();
  double m = 0.0;
  for (Eigen::Index r = 0; r < x.rows(); ++r) {
    const double mean = x.row(r).mean();
    const double rstd = 1.0 / std::sqrt((x.row(r).array() - mean).square().mean() + eps_);
    for (Eigen::Index c = 0; c < x.cols(); ++c)
      m = std::max(m, std::fabs(gamma[c]) * (std::fabs(x(r, c)) + std::fabs(mean)) * rstd + std::fabs(bias_[c]));
  }
  return m;
}

NormGrads LayerNorm::backward(const Mat& dy, const Mat& x) const {
  check_width(x, hidden_size_, "LayerNorm backward");
  if (dy.rows() != x.rows() || dy.cols() != x.cols())
    throw ShapeError("LayerNorm backward: grad_output does not match the saved input");
  const RowVec gamma = this->gamma();
  const double h = static_cast<double>(x.cols());
  NormGrads g;
  g.input.resize(x.rows(), x.cols());
  g.weight = RowVec::Zero(x.cols());
  g.bias = RowVec::Zero(x.cols());
  RowVec weight_abs = RowVec::Zero(x.cols()), bias_abs = RowVec::Zero(x.cols());
  for (Eigen::Index r = 0; r < x.rows(); ++r) {
    const double mean = p_.f32(x.row(r).mean());  // as the forward rounded it
    const double var = (x.row(r).array() - mean).square().mean();
    const double rstd = p_.f32(1.0 / std::sqrt(var + eps_));
    const RowVec xhat = ((x.row(r).array() - mean) * rstd).matrix();
    const RowVec dxhat = dy.row(r).cwiseProduct(gamma);
    const double mean_dxhat = dxhat.sum() / h, mean_dxhat_xhat = dxhat.dot(xhat) / h;
    for (Eigen::Index c = 0; c < x.cols(); ++c)
      g.input(r, c) = p_.act(rstd * (dxhat[c] - mean_dxhat - xhat[c] * mean_dxhat_xhat));  // rounds: dx, T
    g.weight += dy.row(r).cwiseProduct(xhat);
    g.bias += dy.row(r);
    weight_abs += dy.row(r).cwiseProduct(xhat).cwiseAbs();
    bias_abs += dy.row(r).cwiseAbs();
  }
  g.weight_magnitude = weight_abs.maxCoeff();
  g.bias_magnitude = bias_abs.maxCoeff();
  p_.act_inplace(g.weight);                  // rounds: dgamma, parameter dtype
  p_.act_inplace(g.bias);                    // rounds: dbeta, parameter dtype
  p_.count_reduce(2 * x.cols() + x.rows());  // the row means of dx; the column sums of the parameter grads
  p_.count_act();
  return g;
}

// ---- RMSNorm ----------------------------------------------------------------------------------
RMSNorm::RMSNorm(int hidden_size, double eps, bool zero_centered_gamma, Precision p)
    : weight_(RowVec::Constant(hidden_size, zero_centered_gamma ? 0.0 : 1.0)),
      hidden_size_(hidden_size),
      eps_(eps),
      zero_centered_gamma_(zero_centered_gamma),
      p_(p) {}

void RMSNorm::load_state_dict(const StateDict& sd, const std::string& prefix) {
  weight_ = sd.vector(prefix + "weight", hidden_size_);
}

Mat RMSNorm::forward(const Mat& x) const {
  check_width(x, hidden_size_, "RMSNorm");
  const RowVec gamma = zero_centered_gamma_ ? RowVec((weight_.array() + 1.0).matrix()) : weight_;
  Mat y(x.rows(), x.cols());
  rms_norm_rows(x, gamma, eps_, p_, y);
  p_.count_reduce(x.cols());
  p_.count_f32();
  p_.count_act(2);
  return y;
}

NormGrads RMSNorm::backward(const Mat& dy, const Mat& x) const {
  check_width(x, hidden_size_, "RMSNorm backward");
  if (dy.rows() != x.rows() || dy.cols() != x.cols())
    throw ShapeError("RMSNorm backward: grad_output does not match the saved input");
  const RowVec gamma = zero_centered_gamma_ ? RowVec((weight_.array() + 1.0).matrix()) : weight_;
  const double h = static_cast<double>(x.cols());
  NormGrads g;
  g.input.resize(x.rows(), x.cols());
  g.weight = RowVec::Zero(x.cols());
  RowVec weight_abs = RowVec::Zero(x.cols());
  for (Eigen::Index r = 0; r < x.rows(); ++r) {
    const double rstd = p_.f32(1.0 / std::sqrt(x.row(r).squaredNorm() / h + eps_));  // as the forward rounded it
    RowVec dxhat(x.cols());
    for (Eigen::Index c = 0; c < x.cols(); ++c) {
      const double xhat = p_.act(x(r, c) * rstd);  // the forward's stored x_hat
      dxhat[c] = p_.act(dy(r, c) * gamma[c]);      // rounds: y * weight's grad of y, T
      g.weight[c] += p_.act(dy(r, c) * xhat);      // rounds: the weight's grad product, T (then summed)
      weight_abs[c] += std::fabs(dy(r, c) * xhat);
    }
    const double mean_dxhat_x = p_.f32(dxhat.dot(x.row(r)) / h);  // rounds: fp32 reduction
    for (Eigen::Index c = 0; c < x.cols(); ++c)                   // rounds: fp32 grad of x * r, then .to(T)'s backward
      g.input(r, c) = p_.act(p_.f32(rstd * dxhat[c] - x(r, c) * rstd * rstd * rstd * mean_dxhat_x));
  }
  p_.act_inplace(g.weight);  // rounds: dgamma, parameter dtype
  g.weight_magnitude = weight_abs.maxCoeff();
  p_.count_act(2);
  p_.count_f32(2);
  p_.count_reduce(x.cols() + x.rows());
  p_.count_act();
  return g;
}

NormGrads L2Norm::backward(const Mat& dy, const Mat& x) const {
  check_width(x, hidden_size_, "L2Norm backward");
  if (dy.rows() != x.rows() || dy.cols() != x.cols())
    throw ShapeError("L2Norm backward: grad_output does not match the saved input");
  const double h = static_cast<double>(x.cols());
  NormGrads g;
  g.input.resize(x.rows(), x.cols());
  for (Eigen::Index r = 0; r < x.rows(); ++r) {
    const double rstd = p_.f32(1.0 / std::sqrt(x.row(r).squaredNorm() / h + eps_));
    const double mean_dy_x = p_.f32(dy.row(r).dot(x.row(r)) / h);  // rounds: fp32 reduction
    for (Eigen::Index c = 0; c < x.cols(); ++c)                    // rounds: fp32 grad, .to(T)
      g.input(r, c) = p_.act(p_.f32(rstd * dy(r, c) - x(r, c) * rstd * rstd * rstd * mean_dy_x));
  }
  p_.count_f32(2);
  p_.count_reduce(x.cols());
  p_.count_act();
  return g;
}

// ---- L2Norm -----------------------------------------------------------------------------------
Mat L2Norm::forward(const Mat& x) const {
  check_width(x, hidden_size_, "L2Norm");
  Mat y(x.rows(), x.cols());
  for (Eigen::Index r = 0; r < x.rows(); ++r) {
    const double rstd = p_.f32(1.0 / std::sqrt(x.row(r).squaredNorm() / x.cols() + eps_));  // rounds: fp32 statistic
    for (Eigen::Index c = 0; c < x.cols(); ++c) y(r, c) = p_.act(x(r, c) * rstd);           // rounds: .type_as(x)
  }
  p_.count_reduce(x.cols());
  p_.count_f32();
  p_.count_act();
  return y;
}

void add_param_grads(ParamGrads& out, const std::string& prefix, const NormGrads& g) {
  if (g.weight.size())
    out.push_back({prefix + g.param_prefix + "weight", g.weight, {g.weight.size()}, g.weight_magnitude});
  if (g.bias.size()) out.push_back({prefix + g.param_prefix + "bias", g.bias, {g.bias.size()}, g.bias_magnitude});
}

std::unique_ptr<Norm> wrapped_torch_norm(const TransformerConfig& config, int hidden_size, double eps, Precision p) {
  // WrappedTorchNorm's assertion: torch's norms have no zero-centred gamma (TE norms do; the
  // LayerNorm / RMSNorm classes here support it for such specs).
  if (config.layernorm_zero_centered_gamma)
    throw ConfigError(
        "layernorm_zero_centered_gamma: zero_centered_gamma not supported by torch LayerNorm "
        "(WrappedTorchNorm, the local spec's norm)");
  if (config.normalization == "LayerNorm")
    return std::make_unique<LayerNorm>(hidden_size, eps, config.layernorm_zero_centered_gamma, p);
  if (config.normalization == "RMSNorm")
    return std::make_unique<RMSNorm>(hidden_size, eps, config.layernorm_zero_centered_gamma, p);
  throw ConfigError("normalization: '" + config.normalization +
                    "' is not supported (Only LayerNorm, RMSNorm and L2Norm are currently supported)");
}

}  // namespace twin::reference
