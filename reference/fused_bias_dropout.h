// megatron/core/fusions/fused_bias_dropout.py: bias-dropout-add.
//
//   _bias_dropout_add_func((x, bias), residual, prob, training):
//     residual = residual.to(x.dtype)
//     out = residual + dropout(x + bias, p=prob, training=training)
// Dropout (torch.nn.functional.dropout semantics, Philox mask of philox.h): identity when not
// training or prob == 0; otherwise kept elements are scaled by 1 / (1 - prob).
// get_bias_dropout_add(training, fused) returns this function; fusion has no numeric effect here.
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

}  // namespace twin::reference
