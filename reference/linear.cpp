#include "reference/linear.h"

namespace twin::reference {

Linear::Linear(int input_size, int output_size, bool bias, bool skip_bias_add, Precision p)
    : weight(Mat::Zero(output_size, input_size)),
      bias(bias ? RowVec::Zero(output_size) : RowVec()),
      input_size_(input_size),
      output_size_(output_size),
      has_bias_(bias),
      skip_bias_add_(skip_bias_add),
      p_(p) {}

void Linear::load_state_dict(const StateDict& sd, const std::string& prefix) {
  weight = sd.matrix(prefix + "weight", output_size_, input_size_);
  if (has_bias_) bias = sd.vector(prefix + "bias", output_size_);
}

OutputWithBias Linear::forward(const Mat& x) const {
  if (x.cols() != input_size_)
    throw ShapeError("Linear: input last dimension " + std::to_string(x.cols()) + " does not match weight [" +
                     std::to_string(output_size_) + ", " + std::to_string(input_size_) + "]");
  OutputWithBias out;
  out.output = x * weight.transpose();  // [n, out]
  p_.act_inplace(out.output);           // rounds: GEMM output (fp32 accumulation), activation dtype
  p_.count_reduce(input_size_);
  p_.count_act();
  if (has_bias_) {
    if (skip_bias_add_) {
      out.bias = bias;
    } else {
      out.output.rowwise() += bias;
      p_.act_inplace(out.output);  // rounds: output + bias, activation dtype
      p_.count_act();
    }
  }
  return out;
}

}  // namespace twin::reference
