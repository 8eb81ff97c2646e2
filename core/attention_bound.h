// The magnitudes a core attention output's rounding error scales with (RecordEntry::block_magnitude),
// one per (token, head), as both twins report them for their core_attention taps.
//
// context_i = sum_j p_ij v_j with p_i = softmax(x_i), x_i the row's softmax input (the stored
// scores, times coeff). Every rounding point after the softmax (the probabilities' stores, dropout's
// product, probs @ v) errs relative to sum_j p_ij |v_j| <= max |v|. The points up to and at the
// scores' store err relative to the scores: an absolute error dx_ij = u |x_ij| that the softmax turns
// into dp_ij = p_ij (dx_ij - sum_k p_ik dx_ik), so
//   |d context_i| <= sum_j |dp_ij| max |v| <= 2 u (sum_j p_ij |x_ij|) max |v|.
// With m_i the row's largest input and n its number of terms, x_ij - m_i = ln p_ij + ln Z_i with
// Z_i = sum_k exp(x_ik - m_i) >= 1, so sum_j p_ij |x_ij| <= |m_i| + sum_j p_ij (-ln p_ij) <= |m_i| + ln n.
// Hence the magnitude of query row i of a (batch, head): max |v| (1 + 2 (|m_i| + ln n)) / (1 - dropout),
// max |v| over the values that head reads. A bf16 store of a score of 54 (a Llama-3-8B layer at
// s 1024 has such) errs by up to 2^-8 x 54 = 0.21, a 23% change of its probability: two correct
// implementations that round it to neighbouring bf16 values differ in the context by far more than
// a rounding of max |context|.
//
// Masked scores are the constant fill (-10000, stored in fp32 or the activation dtype), the same
// in every implementation: a row of fills only contributes no score error (its term is 0).
#pragma once

#include <cmath>
#include <cstdint>

#include "core/tensor.h"

namespace twin {

// The largest fill a masked score can be stored as: -10000 in fp32 or fp16, -9984 in bf16.
inline constexpr double kMaskedScoreFill = -9984.0;

// A softmax row's term |m| + ln n: m its largest input (an unmasked score), n its number of terms
// (keys, and the sink logit with a softmax offset). 0 for a row whose largest input is a fill.
inline double softmax_row_amplification(double row_max, int n_terms) {
  if (row_max <= kMaskedScoreFill || n_terms < 1) return 0.0;
  return std::fabs(row_max) + std::log(double(n_terms));
}

// One (batch, head, query) row's magnitude from its head's max |v| and its row term.
inline double core_attention_error_magnitude(double max_abs_value, double max_row_amplification, double dropout = 0.0) {
  return max_abs_value * (1.0 + 2.0 * max_row_amplification) / (dropout < 1.0 ? 1.0 - dropout : 1.0);
}

// Every row's magnitude, F64 [sq, b, heads] (the context [sq, b, heads * hv] by blocks of hv: a
// RecordEntry::block_magnitude), from what an implementation that keeps the softmax's row
// statistics holds: stats [b, heads, sq, 2] fp32, each row's (largest input m, sum) over n_terms
// terms, and values [sk, b, groups, width] whose columns [v0, width) are group g's v (the rest: q or
// k columns beside them); head h reads group h / (heads / groups).
Tensor core_attention_error_magnitudes(const Tensor& stats, int n_terms, const Tensor& values, std::int64_t v0,
                                       double dropout);

}  // namespace twin
