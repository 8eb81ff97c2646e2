// The mask DotProductAttention applies to one [sq, sk] slice of its scores, shared by the readable
// path (dot_product_attention.cpp) and fast mode's (fast/dot_product_attention.cpp).
#pragma once

#include <cstdint>
#include <vector>

#include "reference/dot_product_attention.h"

namespace twin::reference {

// The mask actually applied to the [sq, sk] slice (batch bi, head h) of the scores
// (FusedScaleMaskSoftmax.forward_torch_softmax): masked(i, j) is true where the score is filled.
struct DotProductAttention::SliceMask {
  enum class Source { None, Given, Causal, Window } source = Source::None;
  const DotProductAttention& a;
  int sq, sk, bi, h;
  const Tensor* attention_mask;

  const std::vector<double>* mask_values;  // attention_mask->to_f64(), read once per forward, or nullptr

  SliceMask(const DotProductAttention& a_, int sq_, int sk_, int bi_, int h_, const Tensor* mask,
            const std::vector<double>* values = nullptr)
      : a(a_), sq(sq_), sk(sk_), bi(bi_), h(h_), attention_mask(mask), mask_values(values) {
    if (a.window_size_) {
      source = Source::Window;
    } else if (a.attn_mask_type == AttnMaskType::causal && attention_mask == nullptr && sq > 1) {
      if (sq != sk) throw ShapeError("DotProductAttention: causal mask is only for self attention (sq != sk)");
      source = Source::Causal;
    } else if (attention_mask != nullptr) {
      source = Source::Given;
    }
  }
  bool operator()(int i, int j) const {
    switch (source) {
      case Source::None:
        return false;
      case Source::Causal:
        return j > i;  // triu(ones, diagonal=1)
      case Source::Window: {
        const int d = sk - sq;  // ~(tril(triu(m, d - w0), d + w1))
        return !(j - i >= d - (*a.window_size_)[0] && j - i <= d + (*a.window_size_)[1]);
      }
      case Source::Given: {
        const Shape& sh = attention_mask->shape();
        const std::int64_t b0 = sh[0] == 1 ? 0 : bi, h0 = sh[1] == 1 ? 0 : h;
        const std::int64_t at = ((b0 * sh[1] + h0) * sq + i) * sk + j;
        return (mask_values ? (*mask_values)[static_cast<std::size_t>(at)] : attention_mask->at_f64(at)) != 0.0;
      }
    }
    return false;
  }
};

}  // namespace twin::reference
