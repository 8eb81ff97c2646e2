// megatron/core/fusions/fused_bias_dropout.py: bias-dropout-add.
//
//   _bias_dropout_add_func((x, bias), residual, prob, training):
//     residual = residual.to(x.dtype)
//     out = residual + dropout(x + bias, p=prob, training=training)
// Dropout (torch.nn.functional.dropout semantics, Philox mask of philox.h): identity when not
// training or prob == 0; otherwise kept elements are scaled by 1 / (1 - prob).
// get_bias_dropout_add(training, fused) returns this function; fusion has no numeric effect here.
//
// Backward: d residual = d out (the add passes it, .to(x.dtype) is the identity at one dtype);
// d (x + bias) = dropout's backward of d out: the forward's Philox mask regenerated from the same
// stream, kept elements scaled by 1 / (1 - prob) (stored in the activation dtype), dropped ones
// 0; d bias = the column sums of d (x + bias), which the linear owning the bias computes
// (Linear::backward).
#pragma once

#include <optional>

#include "reference/philox.h"
#include "reference/precision.h"

namespace twin::reference {

// torch.nn.functional.dropout(x, p, training) with the Philox mask of `rng` over x's flat
// row-major elements. Each kept product is stored in the activation dtype.
Mat dropout(const Mat& x, double p, bool training, const DropoutRng& rng, const Precision& prec);

// x [n, h], bias [h] or none, residual [n, h] (already in the activation dtype, or rounded to it
// here as residual.to(x.dtype)).
Mat bias_dropout_add(const Mat& x, const std::optional<RowVec>& bias, const Mat& residual, double prob, bool training,
                     const DropoutRng& rng, const Precision& prec);

// dropout's backward: dy masked and scaled exactly as dropout(x, p, training, rng) did.
Mat dropout_backward(const Mat& dy, double p, bool training, const DropoutRng& rng, const Precision& prec);

struct BiasDropoutAddGrads {
  Mat x;         // d x (= d (x + bias))
  Mat residual;  // d residual
};
BiasDropoutAddGrads bias_dropout_add_backward(const Mat& dout, double prob, bool training, const DropoutRng& rng,
                                              const Precision& prec);

}  // namespace twin::reference
