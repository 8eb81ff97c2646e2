// megatron/core/transformer/dot_product_attention.py (DotProductAttention) with
// fusions/fused_softmax.py (FusedScaleMaskSoftmax.forward_torch_softmax, the unfused path) and
// transformer/utils.py (attention_mask_func, get_default_causal_mask,
// get_sliding_window_causal_mask).
//
//   key, value = repeat_interleave(np / ng, dim=2)                   # GQA: head h reads group h / (np/ng)
//   scores = baddbmm(q, k^T, beta=0, alpha=softmax_scale)            # [b, np, sq, sk]
//   softmax_scale = softmax_scale or 1/sqrt(hn); with apply_query_key_layer_scaling
//   softmax_scale /= layer_number and the softmax multiplies the scores by coeff = layer_number
//   mask: window_size -> sliding-window causal mask (replaces any mask); else causal mask type and
//         no mask and sq > 1 -> triu(ones(sq, sq), 1); else the given mask (True = masked)
//   scores.masked_fill_(mask, -10000.0); probs = softmax(scores) (fp32 when the input is
//   fp16/bf16 and attention_softmax_in_fp32, then cast back); attention dropout on probs
//   context = bmm(probs, v) -> [sq, b, np * hn]
//
// Backward (autograd through the same ops): d probs = d context v^T, d v = probs^T d context;
// dropout's mask regenerated from the stream; softmax backward y (dy - sum(dy y)) on the softmax's
// own output (fp32 under attention_softmax_in_fp32); masked scores get no gradient; d q = alpha
// (d scores k), d k = alpha (d scores^T q), each bmm stored before the product with alpha (torch's
// baddbmm backward: grad.bmm(...).mul_(alpha)); GQA sums the heads of a group into their key / value.
// The probabilities are recomputed from q and k as the forward rounded them (no [b, np, sq, sk]
// tensor is saved); the saved activations are q, k, v (CoreAttentionSaved in attention.h).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/tensor.h"
#include "reference/philox.h"
#include "reference/precision.h"
#include "reference/state_dict.h"

namespace twin::reference {

struct CoreAttentionGrads {
  Mat query, key, value;  // shapes of the forward's query / key / value
};

enum class AttnMaskType { padding, causal, no_mask, padding_causal, arbitrary };
AttnMaskType attn_mask_type_from_name(const std::string& name);  // ConfigError for unknown names

class DotProductAttention {
 public:
  DotProductAttention(const TransformerConfig& config, int layer_number, AttnMaskType attn_mask_type, Precision p,
                      std::optional<double> attention_dropout = std::nullopt,
                      std::optional<double> softmax_scale = std::nullopt, std::optional<int> k_channels = std::nullopt,
                      std::optional<int> v_channels = std::nullopt);

  // query [sq, b, np, hn], key [sk, b, ng, hn], value [sk, b, ng, hv], all as row-major
  // (s * b * heads) x hn (hv) matrices: hn = k_channels, hv = v_channels (the kv_channels of the
  // config unless given, as Transformer Engine's attention takes them: multi-latent attention's
  // q / k head dim differs from its v head dim). attention_mask: BOOL, [b or 1, 1 or np, sq, sk]
  // (True = masked), or nullptr. Returns context [sq * b, np * hv].
  Mat forward(const Mat& query, const Mat& key, const Mat& value, int sq, int sk, int b, const Tensor* attention_mask,
              bool training, const DropoutRng& rng) const;

  // Gradients of forward for dcontext [sq * b, np * hv], on the forward's own inputs. ConfigError
  // for softmax_type "learnable" (the offset's gradient is not implemented).
  CoreAttentionGrads backward(const Mat& dcontext, const Mat& query, const Mat& key, const Mat& value, int sq, int sk,
                              int b, const Tensor* attention_mask, bool training, const DropoutRng& rng) const;

  // The attention probabilities forward() multiplies v by: [b, np, sq, sk] after the softmax's
  // stores (and dropout), as (b * np * sq) x sk rows, row (bi * np + h) * sq + i. ComputeMode::Fast
  // without dropout takes them from forward_fast's own softmax, else from probabilities(): the
  // values the context is computed from, for tests of the softmax's rounding points.
  Mat stored_probabilities(const Mat& query, const Mat& key, int sq, int sk, int b, const Tensor* attention_mask,
                           bool training, const DropoutRng& rng) const;

  // The magnitudes forward()'s rounding error scales with (core/attention_bound.h), per (query,
  // batch, head) F64 [sq, b, np]: its head's max |value| and the row's largest softmax input, here
  // from q k^T in fp64 (a factor of the bound needs no more than that), with the mask and the sink
  // logit as forward applies them.
  Tensor error_magnitudes(const Mat& query, const Mat& key, const Mat& value, int sq, int sk, int b,
                          const Tensor* attention_mask, bool training) const;

  // learnable softmax offset (softmax_type == "learnable"): core_attention.softmax_offset [np]
  void load_state_dict(const StateDict& sd, const std::string& prefix);

  double softmax_scale;         // alpha of the baddbmm (already divided by coeff)
  std::optional<double> coeff;  // layer_number with apply_query_key_layer_scaling
  int layer_number;
  AttnMaskType attn_mask_type;
  double attention_dropout;
  std::optional<RowVec> softmax_offset;  // off-by-one (zeros) or learnable [np]

 private:
  struct SliceMask;
  // ComputeMode::Fast's forward without dropout: per (batch, head) slice, q k^T and probs v as
  // fp32 GEMMs (defined in reference/fast/dot_product_attention.cpp), the same rounding points as
  // probabilities() + forward.
  // probs_out, when given, receives the stored probabilities as stored_probabilities() lays them out.
  Mat forward_fast(const Mat& query, const Mat& key, const Mat& value, int sq, int sk, int b,
                   const Tensor* attention_mask, Mat* probs_out = nullptr) const;
  Mat probabilities(const Mat& query, const Mat& key, int sq, int sk, int b, int bi, int h,
                    const Tensor* attention_mask, bool training, const DropoutRng& rng, Mat* softmax_out = nullptr,
                    std::vector<bool>* masked_out = nullptr) const;
  int np_, ng_, hn_, hv_;  // heads, query groups, q / k head dim, v head dim
  bool softmax_in_fp32_, input_in_float16_;
  std::string softmax_type_;
  std::optional<std::vector<int>> window_size_;
  Precision p_;
};

// Validates an attention mask for scores [b, np, sq, sk]: ShapeError naming both shapes.
void check_attention_mask(const Tensor& mask, int b, int np, int sq, int sk, const std::string& what);

}  // namespace twin::reference
