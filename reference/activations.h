// The activation functions a Megatron config can name (config.activation_func), element-wise:
//   gelu          torch.nn.functional.gelu, exact erf form: x * 0.5 * (1 + erf(x / sqrt(2)))
//   erf_gelu      transformer/utils.py erf_gelu: x * 0.5 * (erf(x / 1.41421) + 1)
//   openai_gelu   transformer/utils.py gelu_impl (tanh form, 0.7978845608028654)
//   fast_gelu     activations.py fast_gelu (tanh form, 0.7978845608)
//   quick_gelu    activations.py: x * sigmoid(1.702 x)
//   silu          torch.nn.functional.silu: x * sigmoid(x)
//   relu          torch.nn.functional.relu
//   squared_relu  activations.py: relu(x)^2
// and the gated linear unit of mlp.py: x split in halves [x_glu | x_linear] along the last
// dimension, optional clamp (activation_func_clamp_value), act(x_glu) * (x_linear + glu_linear_offset).
//
// Backward: dx = dy act'(x), one store in the activation dtype per autograd node on the way
// (torch's gelu_backward / silu_backward are single kernels; composed forms store per op). GLU:
// d act = dy (x_linear + offset), d x_linear = dy act(x_glu), each stored, then act's backward;
// clamp passes the gradient where min <= x <= max (torch.clamp's backward). relu' at 0 is 0
// (threshold_backward), as torch takes it.
#pragma once

#include <optional>
#include <string>

#include "reference/precision.h"

namespace twin::reference {

enum class ActivationFunc { Gelu, ErfGelu, OpenAIGelu, FastGelu, QuickGelu, Silu, Relu, SquaredRelu };

// ConfigError naming the value for an unknown name.
ActivationFunc activation_from_name(const std::string& name);
const char* activation_name(ActivationFunc f);

// act(x) element-wise, each torch op's output stored in the activation dtype.
Mat apply_activation(ActivationFunc f, const Mat& x, const Precision& p);

// mlp.py glu(x): x [n, 2 f] -> [n, f].
Mat glu(ActivationFunc f, const Mat& x, double glu_linear_offset, std::optional<double> clamp_value,
        const Precision& p);

// Gradient of apply_activation at x: dy act'(x). x the forward's input.
Mat activation_backward(ActivationFunc f, const Mat& x, const Mat& dy, const Precision& p);

// Gradient of glu at x [n, 2 f] for dy [n, f]: [n, 2 f].
Mat glu_backward(ActivationFunc f, const Mat& x, const Mat& dy, double glu_linear_offset,
                 std::optional<double> clamp_value, const Precision& p);

}  // namespace twin::reference
