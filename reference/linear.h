// megatron/core/tensor_parallel/layers.py: ColumnParallelLinear and RowParallelLinear at tensor
// parallel size 1 (both are then the same op).
//
// weight is [output_size, input_size] (Megatron/torch layout); forward(x) = (y, bias) with
//   skip_bias_add = false: y = x @ weight^T + bias, bias returned as none
//   skip_bias_add = true:  y = x @ weight^T,        bias returned separately (added later, in the
//                                                   bias-activation or bias-dropout-add)
// Megatron computes torch.matmul(input, weight.t()) and then `output + bias` as a second op, so
// the GEMM output and the biased output are each stored in the activation dtype.
#pragma once

#include <optional>
#include <string>

#include "reference/precision.h"
#include "reference/state_dict.h"

namespace twin::reference {

struct OutputWithBias {
  Mat output;                  // [n, out]
  std::optional<RowVec> bias;  // [out] when skip_bias_add and the layer has a bias
};

class Linear {
 public:
  Linear(int input_size, int output_size, bool bias, bool skip_bias_add, Precision p);

  OutputWithBias forward(const Mat& x) const;                            // x [n, input_size]
  void load_state_dict(const StateDict& sd, const std::string& prefix);  // weight (+ bias)

  int input_size() const { return input_size_; }
  int output_size() const { return output_size_; }
  bool has_bias() const { return has_bias_; }
  bool skip_bias_add() const { return skip_bias_add_; }

  Mat weight;   // [output_size, input_size]
  RowVec bias;  // [output_size] (empty without bias)

 private:
  int input_size_, output_size_;
  bool has_bias_, skip_bias_add_;
  Precision p_;
};

using ColumnParallelLinear = Linear;
using RowParallelLinear = Linear;

}  // namespace twin::reference
