// megatron/core/models/retro/decoder_attention.py: RetroDecoderCrossAttention (chunked cross
// attention to the retrieved neighbours) and RetroDecoderBiasDropoutAdd.
//
// Notation: ns sequence length, bs batch, d hidden, m = retro_chunk_length, l = ceil(ns / m),
// k = retro_num_neighbors, r = retro_retrieved_length.
//
// RetroDecoderCrossAttention.forward(hidden_states [ns, bs, d], attention_mask, key_value_states):
//   if it owns the encoder (the first Retro decoder layer): key_value_states are the neighbour
//     embeddings [r, k*bs*l, d]; the first ns % m tokens are right-padded into chunk 0 and the
//     chunks permuted to chunked_output [m, bs*l, d];
//     key_value_states = encoder(hidden_states=key_value_states, attention_mask,
//                                context=chunked_output, context_mask=None).reshape(r*k, bs*l, d)
//   else key_value_states is the encoder output [r*k, bs*l, d] of the first Retro layer.
//   pad = (ns - 1) % m; hidden_states[pad:] right-padded with m - 1 zeros and permuted to
//   padded_chunked_output [m, bs*l, d]; attn(padded_chunked_output, None, key_value_states).
//   Returns the dict {ns, bs, d, l, pad, attention_output [m, bs*l, d], attention_bias [d],
//   context [r*k, bs*l, d]}: here AttentionOutput (output, bias, context) with the scalars in
//   ::extra (RetroDecoderChunking).
// RetroDecoderBiasDropoutAdd: bias-dropout-add with a zero residual on [m, bs*l, d], permuted
//   back to [l*m, bs, d], pad zeros prepended, cut to ns, residual added.
//
// Taps (relative to "cross_attention."): "encoder" (the encoder block's output [r, k*bs*l, d])
// after its layers' "encoder.layers.N.*", then "attn.*", then the dict entries
// "attention_output", "attention_bias" (when present) and "context".
//
// Dropout streams (core/dropout_site.h): the encoder block runs at rng.offset + kRetroEncoderBlock
// of the attention stream the layer hands this module; the chunked cross attention uses the stream
// itself.
//
// Backward (RetroDecoderCrossAttention with RetroDecoderBiasDropoutAdd, CrossAttentionBackward):
//   d residual = d out; d x = the unchunking's transpose of d out (zero where no token attends),
//   then dropout's backward; attn's backward -> d padded_chunked_output and d key_value_states;
//   d key_value_states += d context (the context this module returned is key_value_states itself:
//   autograd sums the two, stored: rounds). Later layers: that is d key_value_states of the layer's
//   input. First layer: it is d of the encoder's output; the encoder block's backward gives d of
//   the neighbour embeddings and d chunked_output (the encoder layers' context), whose chunking's
//   transpose is summed (rounds) with the attending chunks' transpose into d hidden_states.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>

#include "reference/fused_bias_dropout.h"
#include "reference/retro/base_attention.h"
#include "reference/transformer_layer.h"

namespace twin::reference {
class TransformerBlock;
}

namespace twin::reference::retro {

// The scalars of the dict (AttentionOutput::extra), and m = retro_chunk_length, which
// RetroDecoderBiasDropoutAdd reads from its config in Megatron (a BdaBuilder has no config).
struct RetroDecoderChunking {
  std::int64_t ns = 0, bs = 0, d = 0, l = 0, pad = 0;
  std::int64_t m = 0;
};

class RetroDecoderCrossAttention : public BaseRetroCrossAttention, public CrossAttentionBackward {
 public:
  // encoder: the block built from get_retro_encoder_block_spec, for the first Retro decoder layer
  // only (nullptr otherwise).
  RetroDecoderCrossAttention(const TransformerConfig& config, int layer_number, AttnMaskType attn_mask_type,
                             Precision p, std::unique_ptr<TransformerBlock> encoder);
  ~RetroDecoderCrossAttention() override;

  // hidden_states [ns * bs, d] with args.s = ns, args.b = bs; args.key_value_states: the neighbour
  // embeddings [r, k*bs*l, d] when this module owns the encoder, else the encoder output
  // [r*k, bs*l, d]. ShapeError naming the expected and the actual shape when they do not fit.
  AttentionOutput forward(const Mat& hidden_states, const AttentionArgs& args, const Taps& taps) override;
  void load_state_dict(const StateDict& sd, const std::string& prefix) override;  // attn.*, encoder.*

  AttentionOutput forward_saving(const Mat& hidden_states, const AttentionArgs& args, const Taps& taps,
                                 std::shared_ptr<void>* saved) override;
  // d [ns * bs, d] of the bda's output; d_context of the returned context [r*k, bs*l, d] or null.
  CrossAttentionWithBdaGrads backward_with_bda(const Mat& d, const Mat* d_context, void* saved,
                                               const AttentionArgs& args,
                                               const CrossAttentionBdaArgs& bda) const override;
  std::optional<std::string> backward_unsupported() const override;

  std::unique_ptr<TransformerBlock> encoder;
};

// RetroDecoderBiasDropoutAdd._forward(x_with_bias, residual [ns * bs, d], prob) -> [ns * bs, d].
Mat retro_decoder_bias_dropout_add(const AttentionOutput& x_with_bias, const Mat& residual, double prob, bool training,
                                   const DropoutRng& rng, const Precision& prec);
// The cross_attn_bda builder (ModuleSpec(module=RetroDecoderBiasDropoutAdd)).
BdaBuilder retro_decoder_bias_dropout_add_builder();

}  // namespace twin::reference::retro
