// megatron/core/models/retro/encoder_attention.py: the Retro encoder layer's cross attention,
// bias-dropout-add and pre-MLP layernorm. Each iterates over the k retrieved neighbours.
//
// Notation: r retrieved tokens per neighbour, k neighbours, bs*l chunks, d hidden, m chunk length.
//   RetroEncoderCrossAttention: hidden_states [r, bs*l*k, d] (batch column (b*l + chunk)*k + n)
//     reshaped to [r, bs*l, k, d]; for each neighbour n: chunked_output = [:, :, n] ([r, bs*l, d]),
//     attn(Q = chunked_output, K/V = key_value_states [m, bs*l, d], mask None). The residual of
//     neighbour n is chunked_output itself (the pre-cross-attn-layernorm output, not the layer's
//     residual). Returns k tuples (attention_output, attention_bias, residual).
//   RetroEncoderBiasDropoutAdd: bias-dropout-add per tuple, then torch.stack(dim=1).reshape(r, -1, d):
//     the output's batch column is n*(bs*l) + (b*l + chunk), neighbour-major.
//   RetroEncoderLayerNorm: split the columns into k blocks, norm each, stack back (same layout).
//
// Taps (relative to "cross_attention."): "n.0", "n.1" (bias, when present), "n.2" for neighbour
// n, as the fixture hooks flatten the list of tuples; `attn` records under "attn." ("#1", ... on
// the repeated calls).
//
// Dropout streams: neighbour n's attention dropout and bias-dropout-add use offset
// rng.offset + (n + 1) * 2^32 of the stream the layer hands them (layer offsets stay below 2^32).
//
// Backward (RetroEncoderCrossAttention with RetroEncoderBiasDropoutAdd, CrossAttentionBackward):
//   the stack's transpose gives d out_n of each neighbour; d residual_n = d out_n; d (attention
//   output + bias) = dropout's backward; attn's backward -> d chunked_output_n (the query path)
//   and d key_value_states; d chunked_output_n = the two summed (autograd, stored: rounds);
//   the split's transpose puts each neighbour's rows back into d hidden_states. The k neighbours'
//   d key_value_states and attn's parameter gradients are accumulated in neighbour order, each
//   addition stored in the activation / parameter dtype (rounds). The layer's residual gets no
//   gradient: this bda does not read it.
// RetroEncoderLayerNorm's backward is its norm's on every row (forward's split and stack move
// whole rows); its parameters' gradients sit under "norm.".
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "reference/fused_bias_dropout.h"
#include "reference/retro/base_attention.h"
#include "reference/transformer_layer.h"

namespace twin::reference::retro {

// Neighbour n's dropout stream within the encoder cross attention's stream.
inline DropoutRng neighbour_rng(const DropoutRng& rng, std::int64_t n) {
  return rng.with_offset(retro_neighbour_offset(rng.offset, static_cast<std::uint64_t>(n)));
}

struct RetroEncoderAttentionTuple {
  Mat attention_output;                  // [r * bs*l, d]
  std::optional<RowVec> attention_bias;  // [d]
  Mat residual;                          // [r * bs*l, d]
};
// What RetroEncoderCrossAttention hands its bda (AttentionOutput::extra).
struct RetroEncoderAttentionTuples {
  std::vector<RetroEncoderAttentionTuple> tuples;
  std::int64_t batch = 0;  // bs * l
};

class RetroEncoderCrossAttention : public BaseRetroCrossAttention, public CrossAttentionBackward {
 public:
  RetroEncoderCrossAttention(const TransformerConfig& config, int layer_number, AttnMaskType attn_mask_type,
                             Precision p)
      : BaseRetroCrossAttention(config, layer_number, attn_mask_type, p) {}

  // hidden_states [r * (bs*l*k), d] with args.s = r, args.b = k * bs*l; args.key_value_states:
  // the chunked decoder hidden states [m, bs*l, d]. ShapeError naming both shapes when they do
  // not fit. The tuples go to AttentionOutput::extra (output and bias stay empty).
  AttentionOutput forward(const Mat& hidden_states, const AttentionArgs& args, const Taps& taps) override;
  // saved: when given, each neighbour's attn activations (one CrossAttentionSaved per neighbour).
  std::vector<RetroEncoderAttentionTuple> forward_tuples(const Mat& hidden_states, const AttentionArgs& args,
                                                         const Taps& taps,
                                                         std::vector<CrossAttentionSaved>* saved = nullptr);

  AttentionOutput forward_saving(const Mat& hidden_states, const AttentionArgs& args, const Taps& taps,
                                 std::shared_ptr<void>* saved) override;
  // d [r * k*bs*l, d] of the bda's output; d_context must be null (the module returns no context).
  CrossAttentionWithBdaGrads backward_with_bda(const Mat& d, const Mat* d_context, void* saved,
                                               const AttentionArgs& args,
                                               const CrossAttentionBdaArgs& bda) const override;
};

// RetroEncoderBiasDropoutAdd._forward: k tuples of [r * bs*l, d] -> [r * (k*bs*l), d],
// neighbour-major columns. The layer's `residual` is not used: each tuple carries its own.
Mat retro_encoder_bias_dropout_add(const std::vector<RetroEncoderAttentionTuple>& x_with_bias, std::int64_t batch,
                                   double prob, bool training, const DropoutRng& rng, const Precision& prec);
// The cross_attn_bda builder (ModuleSpec(module=RetroEncoderBiasDropoutAdd)).
BdaBuilder retro_encoder_bias_dropout_add_builder();

class RetroEncoderLayerNorm : public Norm {
 public:
  // `norm`: the `submodules` norm (FusedLayerNorm / TENorm); its parameters live under "norm.".
  RetroEncoderLayerNorm(int retro_num_neighbors, std::unique_ptr<Norm> norm);

  // [n, d] rows -> [n, d]. The norm is per token (row), so splitting the columns into k blocks,
  // norming each and stacking them back (forward_split) leaves every row where it was: this is
  // the same as norming every row.
  Mat forward(const Mat& x) const override;
  // The literal steps on input [r * K, d], K = k * bs*l columns: torch.split(K // k, dim=1), norm,
  // torch.stack(dim=1).reshape(r, -1, d). ShapeError when K is not a multiple of k.
  Mat forward_split(const Mat& input, std::int64_t K) const;
  void load_state_dict(const StateDict& sd, const std::string& prefix) override;  // prefix + "norm."
  int hidden_size() const override { return norm->hidden_size(); }
  RowVec weight() const override { return norm->weight(); }
  double error_magnitude(const Mat& x) const override { return norm->error_magnitude(x); }
  NormGrads backward(const Mat& dy, const Mat& x) const override;

  std::unique_ptr<Norm> norm;
  int retro_num_neighbors;
};

}  // namespace twin::reference::retro
