// megatron/core/transformer/torch_norm.py: WrappedTorchNorm -> torch.nn.LayerNorm / RMSNorm, and
// L2Norm. Each normalises every row of x (the last dimension, `hidden_size` wide).
//
//   LayerNorm: y = (x - mean) * rsqrt(var + eps) * gamma + beta     (var biased, over the row)
//   RMSNorm:   y = x * rsqrt(mean(x^2) + eps) * gamma
//   L2Norm:    y = x * rsqrt(mean(x^2) + eps)                        (no parameters)
// gamma is `weight`, or 1 + weight with zero-centred gamma (Megatron's
// layernorm_zero_centered_gamma; WrappedTorchNorm itself rejects that flag, TE norms honour it).
// Statistics are computed in fp32 (torch's CUDA kernel upcasts bf16/fp16 inputs), the output
// stored in the activation dtype. torch 1.13's CPU LayerNorm instead keeps the statistics in the
// activation dtype T (Welford in T; mean, rstd and the shift -rstd * mean stored in T), so the
// rounding points LayerNorm counts are those of that path: any correct implementation does no
// worse (see LayerNorm::forward).
//
// Backward (autograd through these ops), from dy [n, hidden] and the saved input x:
//   LayerNorm: x_hat = (x - mean) rstd; dgamma = sum_rows dy x_hat; dbeta = sum_rows dy;
//              dx = rstd (dy gamma - mean(dy gamma) - x_hat mean(dy gamma x_hat))
//   RMSNorm:   dx_hat = dy gamma (stored in T); dgamma = sum_rows dy x_hat;
//              dx = rstd dx_hat - x rstd^3 mean(dx_hat x) (fp32, then .to(T)'s backward stores in T)
//   L2Norm:    dx = rstd dy - x rstd^3 mean(dy x)
// The statistics are recomputed from x exactly as the forward rounded them.
#pragma once

#include <memory>
#include <string>

#include "reference/linear.h"
#include "reference/precision.h"
#include "reference/state_dict.h"
#include "reference/taps.h"

namespace twin::reference {

// Gradients of a norm: input [n, hidden], weight and bias [hidden] (empty when the norm has none).
struct NormGrads {
  Mat input;
  RowVec weight, bias;
  double weight_magnitude = 0.0, bias_magnitude = 0.0;  // max sum_rows |dy x_hat| / |dy| (ParamGrad)
  std::string param_prefix;  // where weight and bias sit below the norm's own key ("norm." of a wrapper)
};

// LayerNormInterface: forward(x) -> y of the same shape.
class Norm {
 public:
  virtual ~Norm() = default;
  virtual Mat forward(const Mat& x) const = 0;  // [n, hidden] -> [n, hidden]
  virtual void load_state_dict(const StateDict& sd, const std::string& prefix) = 0;
  virtual int hidden_size() const = 0;
  // The weight (gamma parameter as stored, not 1 + weight); empty for L2Norm.
  virtual RowVec weight() const { return RowVec(); }
  // The magnitude the error of forward(x) scales with (RecordEntry::magnitude), or -1 when it is
  // the output's own max |y|.
  virtual double error_magnitude(const Mat& /*x*/) const { return -1.0; }
  // dy [n, hidden], x the forward's input. ShapeError on a shape mismatch; std::logic_error for a
  // norm without a backward.
  virtual NormGrads backward(const Mat& dy, const Mat& x) const;
};

class LayerNorm : public Norm {
 public:
  LayerNorm(int hidden_size, double eps, bool zero_centered_gamma, Precision p);
  Mat forward(const Mat& x) const override;
  void load_state_dict(const StateDict& sd, const std::string& prefix) override;  // weight, bias
  int hidden_size() const override { return hidden_size_; }
  RowVec weight() const override { return weight_; }
  // max over elements of |gamma| (|x| + |mean|) rstd + |beta|: statistics rounded in T err relative
  // to the terms x * rstd and -mean * rstd before they cancel, not to the output.
  double error_magnitude(const Mat& x) const override;
  NormGrads backward(const Mat& dy, const Mat& x) const override;
  RowVec weight_, bias_;  // [hidden]; default gamma 1 (0 zero-centred), beta 0

 private:
  RowVec gamma() const;  // weight, or 1 + weight with zero-centred gamma
  int hidden_size_;
  double eps_;
  bool zero_centered_gamma_;
  Precision p_;
};

class RMSNorm : public Norm {
 public:
  RMSNorm(int hidden_size, double eps, bool zero_centered_gamma, Precision p);
  Mat forward(const Mat& x) const override;
  void load_state_dict(const StateDict& sd, const std::string& prefix) override;  // weight
  int hidden_size() const override { return hidden_size_; }
  RowVec weight() const override { return weight_; }
  NormGrads backward(const Mat& dy, const Mat& x) const override;
  RowVec weight_;  // [hidden]

 private:
  int hidden_size_;
  double eps_;
  bool zero_centered_gamma_;
  Precision p_;
};

class L2Norm : public Norm {
 public:
  L2Norm(int hidden_size, double eps, Precision p) : hidden_size_(hidden_size), eps_(eps), p_(p) {}
  Mat forward(const Mat& x) const override;
  void load_state_dict(const StateDict&, const std::string&) override {}
  int hidden_size() const override { return hidden_size_; }
  NormGrads backward(const Mat& dy, const Mat& x) const override;

 private:
  int hidden_size_;
  double eps_;
  Precision p_;
};

// Appends <prefix>weight and <prefix>bias where the norm has them.
void add_param_grads(ParamGrads& out, const std::string& prefix, const NormGrads& g);

// WrappedTorchNorm(config, hidden_size, eps): LayerNorm or RMSNorm by config.normalization
// (ConfigError for anything else, and for layernorm_zero_centered_gamma, as its assertion).
std::unique_ptr<Norm> wrapped_torch_norm(const TransformerConfig& config, int hidden_size, double eps, Precision p);

}  // namespace twin::reference
