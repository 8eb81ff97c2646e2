#include "reference/fused_bias_dropout.h"

#include <string>

#include "core/tensor.h"

namespace twin::reference {

Mat dropout(const Mat& x, double p, bool training, const DropoutRng& rng, const Precision& prec) {
  const std::uint32_t threshold = dropout_keep_threshold(p);  // validates p
  if (!training || p == 0.0) return x;
  Mat y(x.rows(), x.cols());
  const double scale = p == 1.0 ? 0.0 : 1.0 / (1.0 - p);
  for (Eigen::Index e = 0; e < x.size(); ++e) {
    const bool keep = (philox_word(rng.seed, rng.offset, static_cast<std::uint64_t>(e)) >> 8) < threshold;
    y.data()[e] = keep ? prec.act(x.data()[e] * scale) : 0.0;  // rounds: x * mask * scale, activation dtype
  }
  prec.count_act();
  return y;
}

TWIN_VECTOR_CLONES Mat bias_dropout_add(const Mat& x, const std::optional<RowVec>& bias, const Mat& residual_in,
                                        double prob, bool training, const DropoutRng& rng, const Precision& prec) {
  if (residual_in.rows() != x.rows() || residual_in.cols() != x.cols())
    throw ShapeError("bias_dropout_add: residual [" + std::to_string(residual_in.rows()) + ", " +
                     std::to_string(residual_in.cols()) + "] does not match x [" + std::to_string(x.rows()) + ", " +
                     std::to_string(x.cols()) + "]");
  if (bias && bias->size() != x.cols())
    throw ShapeError("bias_dropout_add: bias [" + std::to_string(bias->size()) +
                     "] does not match x's last dimension " + std::to_string(x.cols()));
  if (bias) prec.count_act();
  prec.count_act();              // the sum; the residual was computed before x: its count is already included
  dropout_keep_threshold(prob);  // validates prob
  if (!training || prob == 0.0) {
    // No dropout: the ops below in one pass (the same roundings, element by element).
    Mat out(x.rows(), x.cols());
    const Eigen::Index cols = x.cols();
    prec.with_act([&](auto act) {
      for (Eigen::Index r = 0; r < x.rows(); ++r) {
        const double* xr = x.data() + r * cols;
        const double* res = residual_in.data() + r * cols;
        double* o = out.data() + r * cols;
        if (bias) {
          const double* bv = bias->data();
          for (Eigen::Index c = 0; c < cols; ++c)  // rounds: x + bias; residual.to(x.dtype); residual + out
            o[c] = act(act(res[c]) + act(xr[c] + bv[c]));
        } else {
          for (Eigen::Index c = 0; c < cols; ++c) o[c] = act(act(res[c]) + xr[c]);  // rounds: as above, no bias
        }
      }
    });
    return out;
  }
  const Mat residual = prec.act(residual_in);  // rounds: residual.to(x.dtype)
  Mat h = x;
  if (bias) {
    h.rowwise() += *bias;
    prec.act_inplace(h);  // rounds: x + bias, activation dtype
  }
  Mat out = residual + dropout(h, prob, training, rng, prec);
  prec.act_inplace(out);  // rounds: residual + out, activation dtype
  return out;
}

Mat dropout_backward(const Mat& dy, double p, bool training, const DropoutRng& rng, const Precision& prec) {
  const std::uint32_t threshold = dropout_keep_threshold(p);  // validates p
  if (!training || p == 0.0) return dy;
  Mat dx(dy.rows(), dy.cols());
  const double scale = p == 1.0 ? 0.0 : 1.0 / (1.0 - p);
  for (Eigen::Index e = 0; e < dy.size(); ++e) {
    const bool keep = (philox_word(rng.seed, rng.offset, static_cast<std::uint64_t>(e)) >> 8) < threshold;
    dx.data()[e] = keep ? prec.act(dy.data()[e] * scale) : 0.0;  // rounds: dy * mask * scale, activation dtype
  }
  prec.count_act();
  return dx;
}

BiasDropoutAddGrads bias_dropout_add_backward(const Mat& dout, double prob, bool training, const DropoutRng& rng,
                                              const Precision& prec) {
  BiasDropoutAddGrads g;
  g.residual = dout;
  g.x = dropout_backward(dout, prob, training, rng, prec);
  return g;
}

}  // namespace twin::reference
