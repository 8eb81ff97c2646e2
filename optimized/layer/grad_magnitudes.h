// The magnitudes a parameter gradient's rounding error scales with (the reference's ParamGrad:
// the largest sum of absolute terms one element of the gradient accumulates), computed on the host
// from the output gradients and inputs a rank's backward left in its buffers, for any layer kind.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "optimized/layer/rank_plan.h"

namespace twin::opt {

// |t| in double.
std::vector<double> abs_values(const Tensor& t);
// A weight's: max over (o, i) of sum_rows |dy[r, o]| |x[r, i]| (dy [rows, out], x [rows, in], both |.|).
double weight_magnitude(const std::vector<double>& dy, const std::vector<double>& x, std::int64_t rows,
                        std::int64_t out, std::int64_t in);
// A bias's (and a LayerNorm bias's): max over columns of sum_rows |dy[r, c]|.
double column_magnitude(const std::vector<double>& dy, std::int64_t rows, std::int64_t cols);
// A norm weight's: max over columns of sum_rows |dy[r, c] x_hat[r, c]|, x_hat the normalised input
// (LayerNorm: (x - mean) rstd; RMSNorm: x rstd), in double.
double norm_weight_magnitude(const std::vector<double>& dy, const Tensor& x, std::int64_t rows, std::int64_t cols,
                             bool rms, double eps);
// The q rows or the k rows ([rows, hn], heads in layout order) of a [n, qw] tensor in the fused
// linear_qkv layout of `p`: token t, group g holds hpg q heads then k then v, each hn wide.
std::vector<double> gather_heads(const std::vector<double>& full, std::int64_t n, const RankPlan& p, bool keys);

}  // namespace twin::opt
