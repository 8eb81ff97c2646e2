#include "reference/linear.h"

#include "reference/fast/fast_gemm.h"
#include "reference/parallel.h"

namespace twin::reference {

Linear::Linear(int input_size, int output_size, bool bias, bool skip_bias_add, Precision p)
    : bias(bias ? RowVec::Zero(output_size) : RowVec()),
      input_size_(input_size),
      output_size_(output_size),
      has_bias_(bias),
      skip_bias_add_(skip_bias_add),
      p_(p) {
  // Zeros until a weight is set, in the dtype parameters are stored in (a real-size layer never
  // holds a double copy of its weights beside the golden's).
  set_weight(Tensor::zeros(p_.storage_dtype(), {output_size, input_size}));
}

void Linear::set_weight(const Mat& w) { set_weight(to_tensor(DType::F64, w, {w.rows(), w.cols()})); }

void Linear::set_weight(Tensor w) {
  if (w.dim() != 2 || w.size(0) != output_size_ || w.size(1) != input_size_ || !is_floating(w.dtype()))
    throw ShapeError("Linear: weight " + w.describe() + " does not match [output_size, input_size] = [" +
                     std::to_string(output_size_) + ", " + std::to_string(input_size_) + "]");
  weight_ = std::move(w);
  // Fast mode converts the weight here, once, not in every forward. Its values are
  // activation-dtype values (parameters are stored in it), so exact in fp32.
  if (p_.fast()) fast_weight_ = GemmOperand(weight(), p_.params_dtype == DType::BF16);
}

Mat Linear::weight() const { return to_mat(weight_, output_size_, input_size_, "Linear weight"); }

void Linear::load_state_dict(const StateDict& sd, const std::string& prefix) {
  set_weight(sd.get(prefix + "weight", {output_size_, input_size_}));
  if (has_bias_) bias = sd.vector(prefix + "bias", output_size_);
}

OutputWithBias Linear::forward(const Mat& x, LinearSaved* saved) const {
  if (x.cols() != input_size_)
    throw ShapeError("Linear: input last dimension " + std::to_string(x.cols()) + " does not match weight [" +
                     std::to_string(output_size_) + ", " + std::to_string(input_size_) + "]");
  if (saved) saved->input = x;
  OutputWithBias out;
  const bool add_bias = has_bias_ && !skip_bias_add_;
  if (p_.fast()) {  // x and weight hold activation-dtype values: exact in fp32
    FMat y = matmul_nt(x, fast_weight_, p_.params_dtype == DType::BF16);  // [n, out], fp32 sums
    p_.act_inplace(y.data(), y.size());                                   // rounds: GEMM output (fp32 accumulation)
    if (add_bias) {
      y.rowwise() += bias.cast<float>();   // an activation-dtype bias: exact in fp32
      p_.act_inplace(y.data(), y.size());  // rounds: + bias
    }
    out.output.resize(y.rows(), y.cols());
    to_double(y.data(), out.output.data(), y.size());
  } else {
    out.output = gemm_x_wt(x, weight_);  // [n, out]
    p_.act_inplace(out.output);          // rounds: GEMM output (fp32 accumulation), activation dtype
    if (add_bias) {
      out.output.rowwise() += bias;
      p_.act_inplace(out.output);  // rounds: output + bias, activation dtype
    }
  }
  p_.count_reduce(input_size_);
  p_.count_act();
  if (add_bias) p_.count_act();
  if (has_bias_ && skip_bias_add_) out.bias = bias;
  return out;
}

ParamGrad::ParamGrad(std::string name, Tensor value, Shape shape, double magnitude)
    : name(std::move(name)), value(std::move(value)), shape(std::move(shape)), magnitude(magnitude) {
  if (shape_numel(this->shape) != this->value.numel())
    throw ShapeError("ParamGrad " + this->name + ": " + this->value.describe() + " for shape " +
                     shape_str(this->shape));
}

ParamGrad::ParamGrad(std::string name, const Mat& value, Shape shape, double magnitude)
    : ParamGrad(std::move(name), to_tensor(DType::F64, value, {value.rows(), value.cols()}), std::move(shape),
                magnitude) {}

Mat ParamGrad::mat() const {
  const std::int64_t rows = shape.size() < 2 ? 1 : shape[0];
  return to_mat(value, rows, rows ? value.numel() / rows : 0, "grad " + name);
}

Tensor ParamGrad::stored(DType dt) const { return (value.dtype() == dt ? value : value.to(dt)).reshape(shape); }

void add_param_grads(ParamGrads& out, const std::string& prefix, const LinearGrads& g) {
  out.push_back({prefix + "weight", g.weight, g.weight.shape(), g.weight_magnitude});
  if (g.bias.size()) out.push_back({prefix + "bias", g.bias, {g.bias.size()}, g.bias_magnitude});
}

LinearGrads Linear::backward(const Mat& dy, const LinearSaved& saved) const {
  if (dy.cols() != output_size_ || dy.rows() != saved.input.rows() || saved.input.cols() != input_size_)
    throw ShapeError("Linear backward: grad_output [" + std::to_string(dy.rows()) + ", " + std::to_string(dy.cols()) +
                     "] does not match the saved input [" + std::to_string(saved.input.rows()) + ", " +
                     std::to_string(saved.input.cols()) + "] and weight [" + std::to_string(output_size_) + ", " +
                     std::to_string(input_size_) + "]");
  LinearGrads g;
  if (p_.fast()) {
    backward_fast(dy, saved, g);
  } else {
    g.input = p_.act(gemm_dy_w(dy, weight_));  // rounds: dgrad GEMM output (fp32 accumulation), activation dtype
    // wgrad: a reduction over the rows, stored in the parameter (= activation) dtype.
    g.weight = Tensor::empty(p_.storage_dtype(), {output_size_, input_size_});
    g.weight_magnitude = gemm_wgrad(
        dy, saved.input, [&](Mat& m) { p_.act_inplace(m); },  // rounds: wgrad GEMM output
        g.weight);
  }
  p_.count_reduce(output_size_);
  p_.count_act();
  if (has_bias_) {
    g.bias = dy.colwise().sum();
    p_.act_inplace(g.bias);  // rounds: grad_output.sum(dim=0)
    g.bias_magnitude = dy.cwiseAbs().colwise().sum().maxCoeff();
  }
  p_.count_reduce(dy.rows());
  p_.count_act();
  return g;
}

// Fast mode's dgrad and wgrad: fp32 GEMMs through fast_gemm.h, as the forward's. dy and the saved
// input hold activation-dtype values (each was stored), so exact in fp32. The magnitude |dy|^T |x|
// in fp32 too: a sum of k non-negative terms is at most gamma_k(u_fp32) below its true value, so it
// is scaled up by (1 + 2 k u_fp32) to stay the bound's upper estimate.
void Linear::backward_fast(const Mat& dy, const LinearSaved& saved, LinearGrads& g) const {
  const bool bf16 = p_.params_dtype == DType::BF16;
  const FMat dyf = dy.cast<float>(), dyt = dyf.transpose(),
             xf = saved.input.cast<float>();     // [n, out] [out, n] [n, in]
  FMat dx = matmul_nn(dyf, fast_weight_, bf16);  // [n, in]
  p_.act_inplace(dx.data(), dx.size());          // rounds: dgrad GEMM output (fp32 accumulation)
  g.input = dx.cast<double>();
  FMat dw = matmul_nn(dyt, xf, bf16);    // [out, in]
  p_.act_inplace(dw.data(), dw.size());  // rounds: wgrad GEMM output
  g.weight = p_.to_tensor(Mat(dw.cast<double>()), {output_size_, input_size_});
  const FMat mag = matmul_nn(FMat(dyt.cwiseAbs()), FMat(xf.cwiseAbs()), bf16);
  g.weight_magnitude = double(mag.size() ? mag.maxCoeff() : 0.0f) * (1.0 + 2.0 * double(dy.rows()) * 0x1p-24);
}

}  // namespace twin::reference
