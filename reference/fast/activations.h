// ComputeMode::Fast's Gelu and Silu (and their GLU) on whole matrices in fp32 arithmetic with
// Eigen's vectorised fp32 exp and erf (a few fp32 ulps, as torch's own fp32 kernels), the same
// stores as the readable act1 (reference/activations.cpp): far inside the bound's one store of the
// activation dtype per `rounds:` plus its fp32 reductions, which test_fast_mode checks. The
// readable functions call these in fast mode and count the rounding points themselves.
#pragma once

#include "reference/activations.h"
#include "reference/precision.h"

namespace twin::reference::fast {

// Whether fast mode has its own loop for f (the others run the readable path in every mode).
inline bool has_activation(ActivationFunc f) { return f == ActivationFunc::Gelu || f == ActivationFunc::Silu; }
// act1(f, x) of every element, as the readable apply_activation stores it.
Mat activation(ActivationFunc f, const Mat& x, const Precision& p);
// glu(f, x) without a clamp or a linear offset: act(x_glu) * x_linear, as the readable glu.
Mat glu(ActivationFunc f, const Mat& x, const Precision& p);

}  // namespace twin::reference::fast
