// megatron/core/tensor_parallel/layers.py: ColumnParallelLinear and RowParallelLinear at tensor
// parallel size 1 (both are then the same op).
//
// weight is [output_size, input_size] (Megatron/torch layout); forward(x) = (y, bias) with
//   skip_bias_add = false: y = x @ weight^T + bias, bias returned as none
//   skip_bias_add = true:  y = x @ weight^T,        bias returned separately (added later, in the
//                                                   bias-activation or bias-dropout-add)
// Megatron computes torch.matmul(input, weight.t()) and then `output + bias` as a second op, so
// the GEMM output and the biased output are each stored in the activation dtype.
//
// Backward (LinearWithGradAccumulationAndAsyncCommunication.backward at TP 1, no gradient
// accumulation fusion), from the gradient dy of the biased output (for skip_bias_add: of x W^T +
// bias wherever the caller adds the bias, which has the same gradient):
//   grad_input  = dy @ weight            fp32 accumulation over output_size, stored in the activation dtype
//   grad_weight = dy^T @ input           fp32 accumulation over the n rows, stored in the parameter dtype
//   grad_bias   = dy.sum(dim=0)          fp32 accumulation over the n rows, stored in the parameter dtype
// The forward saves its input (LinearSaved) for grad_weight.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "reference/fast/fast_gemm.h"
#include "reference/precision.h"
#include "reference/state_dict.h"

namespace twin::reference {

struct OutputWithBias {
  Mat output;                  // [n, out]
  std::optional<RowVec> bias;  // [out] when skip_bias_add and the layer has a bias
};

// What Linear's backward needs from its forward.
struct LinearSaved {
  Mat input;  // [n, input_size]
};

// One parameter's gradient under its state_dict key (relative to the module that collects it),
// [rows, cols] values with the parameter's shape. A module's backward lists them in the order it
// computes them.
// magnitude: what the gradient's rounding error scales with. A parameter's gradient is a sum over
// the n rows (tokens) of products, |fl(sum t_i) - sum t_i| <= gamma_n sum |t_i|, and an error
// eps |dy_i| in each upstream gradient moves it by eps sum |dy_i| |x_i| too: so max over its
// elements of sum_i |t_i|, not max |gradient| (which cancels, e.g. to ~0 for a key bias, which
// softmax's shift invariance leaves without gradient).
// value is a tensor in the gradient's own dtype, so a layer's gradients never all sit in double at
// once (a real-size layer's would be four times the golden's parameters): a Linear's weight
// gradient is stored chunk by chunk in Precision::storage_dtype(); values built as a Mat (already
// rounded to that dtype) are kept in F64, which holds them exactly.
struct ParamGrad {
  std::string name;
  Tensor value;  // `shape`
  Shape shape;
  double magnitude = -1.0;  // < 0: max |value|

  ParamGrad() = default;
  ParamGrad(std::string name, Tensor value, Shape shape, double magnitude = -1.0);
  ParamGrad(std::string name, const Mat& value, Shape shape, double magnitude = -1.0);
  // The values as doubles, [shape[0], the rest] ([1, n] for a vector).
  Mat mat() const;
  // The values in dt with the parameter's shape (they are rounded to the storage dtype already, so
  // converting to it is exact); no copy when value is in dt.
  Tensor stored(DType dt) const;
};
using ParamGrads = std::vector<ParamGrad>;

struct LinearGrads {
  Mat input;                                            // [n, input_size]
  Tensor weight;                                        // [output_size, input_size], Precision::storage_dtype()
  RowVec bias;                                          // [output_size] (empty without bias)
  double weight_magnitude = 0.0, bias_magnitude = 0.0;  // max sum_i |dy_i x_i| / max sum_i |dy_i| (ParamGrad)
};

class Linear {
 public:
  Linear(int input_size, int output_size, bool bias, bool skip_bias_add, Precision p);

  OutputWithBias forward(const Mat& x, LinearSaved* saved = nullptr) const;  // x [n, input_size]
  // dy [n, output_size]: the gradient of the (biased) output. ShapeError on a shape mismatch.
  LinearGrads backward(const Mat& dy, const LinearSaved& saved) const;
  void load_state_dict(const StateDict& sd, const std::string& prefix);  // weight (+ bias)

  int input_size() const { return input_size_; }
  int output_size() const { return output_size_; }
  bool has_bias() const { return has_bias_; }
  bool skip_bias_add() const { return skip_bias_add_; }

  // The weight is set through set_weight (or load_state_dict) only: fast mode keeps it converted
  // for its GEMM (reference/fast/fast_gemm.h's GemmOperand), and set_weight is where that is redone.
  // It is held in its own dtype (load_state_dict borrows the golden's mapped tensor: no copy) and
  // read by the GEMMs chunk by chunk (reference/parallel.h).
  Mat weight() const;                                      // [output_size, input_size], a copy as doubles
  void set_weight(const Mat& w);                           // ShapeError unless [output_size, input_size]; kept in F64
  void set_weight(Tensor w);                               // any float dtype, [output_size, input_size]
  const Tensor& stored_weight() const { return weight_; }  // as set
  RowVec bias;                                             // [output_size] (empty without bias)

 private:
  Tensor weight_;            // [output_size, input_size], any float dtype
  GemmOperand fast_weight_;  // weight_ as fast mode's GEMM reads it (ComputeMode::Fast only)
  void backward_fast(const Mat& dy, const LinearSaved& saved, LinearGrads& g) const;
  int input_size_, output_size_;
  bool has_bias_, skip_bias_add_;
  Precision p_;
};

// Appends <prefix>weight and <prefix>bias (when the linear has one).
void add_param_grads(ParamGrads& out, const std::string& prefix, const LinearGrads& g);

using ColumnParallelLinear = Linear;
using RowParallelLinear = Linear;

}  // namespace twin::reference
