// Bounds that grow with the numerics, built on the comparator's per-dtype defaults
// (Tolerance::for_dtype, torch.testing.assert_close's values). Each returns the reason with it.
#pragma once

#include <cstdint>

#include "core/record.h"
#include "parity/compare.h"

namespace twin::parity {

// Higham's gamma_n = n u / (1 - n u): the relative bound of a length-n sum in a format of unit
// roundoff u, |fl(sum a_i b_i) - sum a_i b_i| <= gamma_n sum |a_i b_i|.
double gamma_n(std::int64_t n, double u);

// Two implementations of one reduction of length k, both accumulating in fp32 but in different
// orders, and rounding once to `out`: they differ by at most 2 gamma_k(u_fp32) * magnitude, where
// magnitude bounds sum |a_i b_i| over the output; the final rounding is covered by the dtype's rtol.
Tolerance reduction_bound(DType out, std::int64_t k, double magnitude);

// One op computed twice in fp32 with different (but correctly rounded) math-library calls and
// reduction orders, with `stores` rounding points to dtype out on the way: each store may land one
// ulp apart (2 u relative) when the fp32 values before it differ; a length-k fp32 reduction adds
// 2 gamma_k. Both act on values of size up to `magnitude`: atol grows with it.
Tolerance op_bound(DType out, int stores, std::int64_t k, double magnitude);

// A whole layer: the optimized twin may be off from the reference by the dtype's default plus twice
// the reference's own max error against the fp64 ("exact") run of the same inputs (the
// FlashAttention test rule: no worse than twice the reference's own error), plus one ulp of the
// output's magnitude (2 u max|e|): two correct implementations that each store the output may land
// one ulp apart anywhere, even where the reference's measured error (a sample, small for tiny
// tensors) is below an ulp. The absolute part covers outputs that cancel (residual adds), where a
// relative bound says nothing.
Tolerance reference_error_bound(DType dt, double reference_max_error_vs_exact, double magnitude);

// A golden comparison, from the rounding points the twin executed before the value (its
// RoundingCount): two implementations of Megatron's math that store at the same points may land
// one rounding apart at each store (unit roundoff u of that dtype, relative to the magnitude the
// error propagates with) and 2 gamma_R(u_fp32) apart over fp32-accumulated reductions of total
// length R, so eps = sum over dtypes of n u + 2 gamma_R(fp32), atol = eps x magnitude, rtol = eps.
// The magnitude is max |expected| unless the entry names another (RecordEntry::magnitude). No
// rounding point (a parameter, a copy): exact.
Tolerance golden_bound(const RecordEntry& e, const Tensor& expected);

// max |x| over a tensor (0 for empty): the magnitude used by the bounds above.
double max_abs(const Tensor& t);
// max |a - b| over two tensors of one shape (ShapeError otherwise).
double max_abs_diff(const Tensor& a, const Tensor& b);

}  // namespace twin::parity
