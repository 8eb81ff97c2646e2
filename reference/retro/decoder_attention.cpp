#include "reference/retro/decoder_attention.h"

#include <string>

#include "reference/retro/chunking.h"
#include "reference/transformer_block.h"

namespace twin::reference::retro {

RetroDecoderCrossAttention::RetroDecoderCrossAttention(const TransformerConfig& config, int layer_number,
                                                       AttnMaskType attn_mask_type, Precision p,
                                                       std::unique_ptr<TransformerBlock> enc)
    : BaseRetroCrossAttention(config, layer_number, attn_mask_type, p), encoder(std::move(enc)) {}

RetroDecoderCrossAttention::~RetroDecoderCrossAttention() = default;

void RetroDecoderCrossAttention::load_state_dict(const StateDict& sd, const std::string& prefix) {
  BaseRetroCrossAttention::load_state_dict(sd, prefix);
  if (encoder) encoder->load_state_dict(sd, prefix + "encoder.");
}

namespace {

// What the module's backward reads from its forward.
struct RetroDecoderSaved {
  std::int64_t ns = 0, bs = 0, l = 0, pad = 0;
  CrossAttentionSaved attn;
  TransformerBlockSaved encoder;  // the first Retro layer's
};

}  // namespace

AttentionOutput RetroDecoderCrossAttention::forward(const Mat& hidden_states, const AttentionArgs& args,
                                                    const Taps& taps) {
  return forward_saving(hidden_states, args, taps, nullptr);
}

std::optional<std::string> RetroDecoderCrossAttention::backward_unsupported() const {
  if (encoder)
    if (auto why = encoder->backward_unsupported()) return "the encoder's " + *why;
  return std::nullopt;
}

AttentionOutput RetroDecoderCrossAttention::forward_saving(const Mat& hidden_states, const AttentionArgs& args,
                                                           const Taps& taps, std::shared_ptr<void>* saved) {
  std::shared_ptr<RetroDecoderSaved> st;
  if (saved) {
    st = std::make_shared<RetroDecoderSaved>();
    *saved = st;
  }
  // hidden_states: [ ns, bs, d ]
  const std::int64_t m = retro_chunk_length, k = retro_num_neighbors, r = retro_retrieved_length;
  const std::int64_t ns = args.s, bs = args.b, d = config_.hidden_size;
  if (ns <= 0 || bs <= 0 || hidden_states.rows() != ns * bs || hidden_states.cols() != d)
    throw ShapeError("RetroDecoderCrossAttention: hidden_states expected shape [ns, bs, " + std::to_string(d) +
                     "] with ns = " + std::to_string(ns) + ", bs = " + std::to_string(bs) + ", got " +
                     std::to_string(hidden_states.rows()) + " x " + std::to_string(hidden_states.cols()) + " rows");
  if (!args.key_value_states)
    throw std::invalid_argument(std::string("RetroDecoderCrossAttention: key_value_states (") +
                                (encoder ? "the neighbour embeddings" : "the encoder output") + ") cannot be None");
  const Tensor& kv_in = *args.key_value_states;
  const std::int64_t l = num_chunks(ns, m);
  const std::string sizes = " (r = retro_retrieved_length = " + std::to_string(r) +
                            ", k = retro_num_neighbors = " + std::to_string(k) + ", bs = " + std::to_string(bs) +
                            ", l = ceil(ns / m) = ceil(" + std::to_string(ns) + " / " + std::to_string(m) +
                            ") = " + std::to_string(l) + ")";

  Tensor key_value_states;  // [ r*k, bs*l, d ]
  // Retrieve neighbors.
  if (encoder) {
    const Shape want{r, k * bs * l, d};
    if (kv_in.shape() != want)
      throw ShapeError(
          "RetroDecoderCrossAttention: neighbour embeddings (context) expected shape [r, k * bs * l, d] = " +
          shape_str(want) + sizes + ", got " + shape_str(kv_in.shape()));
    // Chunk & permute hidden states; the first ns % m tokens are right-padded into chunk 0.
    // - hidden_states:  [ l*m, bs, d ]
    // - chunked_output: [ m, bs*l, d ]
    const Tensor chunked_output =
        p_.to_tensor(gather_rows(hidden_states, chunk_encoder_context_map(ns, bs, m)), {m, bs * l, d});

    // Encode neighbors. (Note: 'key_value_states' re-assigned here.) [ r, k*bs*l, d ]
    LayerInputs encoder_inputs;
    encoder_inputs.attention_mask = args.attention_mask;
    encoder_inputs.context = &chunked_output;
    encoder_inputs.context_mask = nullptr;  // get_all_true_mask returns None
    DropoutRng encoder_rng = args.rng.with_offset(args.rng.offset + kRetroEncoderBlock);
    const RoundingCount hidden_states_rounding = rounding_now();
    const Tensor encoded =
        taps.record("encoder", encoder->forward(kv_in, encoder_inputs, args.training, encoder_rng,
                                                taps.child("encoder"), nullptr, st ? &st->encoder : nullptr));
    // The attending chunks come from hidden_states, not through the encoder's tap (a no-op end to
    // end, where the count only grows; in isolation that tap reset it).
    rounding_join(hidden_states_rounding);
    key_value_states = encoded.reshape({r * k, bs * l, d});  // [ r*k, bs*l, d ]
  } else {
    const Shape want{r * k, bs * l, d};
    if (kv_in.shape() != want)
      throw ShapeError("RetroDecoderCrossAttention: encoder output (context) expected shape [r * k, bs * l, d] = " +
                       shape_str(want) + sizes + ", got " + shape_str(kv_in.shape()));
    key_value_states = kv_in;
  }

  // Attend starting at last token of first chunk; pad attending tokens to l*m and permute.
  // - padded_chunked_output: [ m, bs*l, d ]
  const std::int64_t pad = attending_pad(ns, m);
  const Mat padded_chunked_output = gather_rows(hidden_states, pad_attending_chunks_map(ns, bs, m));

  // Attend to encoded neighbors (mask None).
  AttentionOutput out = attn.forward_mats(
      padded_chunked_output, static_cast<int>(m), static_cast<int>(bs * l),
      to_mat(key_value_states, r * k * bs * l, d, "key_value_states"), static_cast<int>(r * k),
      /*attention_mask=*/nullptr, args.training, args.rng, taps.child("attn"), st ? &st->attn : nullptr);
  if (st) {
    st->ns = ns;
    st->bs = bs;
    st->l = l;
    st->pad = pad;
  }

  // Return dimensions for bias-dropout step.
  out.output = taps.record("attention_output", out.output, {m, bs * l, d}, p_);
  if (out.bias && taps.enabled()) taps.record_param("attention_bias", p_.to_tensor(*out.bias, {d}));
  out.context = taps.record("context", key_value_states);
  out.extra = std::make_shared<RetroDecoderChunking>(RetroDecoderChunking{ns, bs, d, l, pad, m});
  return out;
}

CrossAttentionWithBdaGrads RetroDecoderCrossAttention::backward_with_bda(const Mat& d, const Mat* d_context,
                                                                         void* saved, const AttentionArgs& args,
                                                                         const CrossAttentionBdaArgs& bda) const {
  auto* st = static_cast<RetroDecoderSaved*>(saved);
  if (!st || st->ns <= 0)
    throw std::logic_error("RetroDecoderCrossAttention backward: `saved` was not filled by forward_saving");
  const std::int64_t m = retro_chunk_length, k = retro_num_neighbors, r = retro_retrieved_length;
  const std::int64_t ns = st->ns, bs = st->bs, l = st->l, pad = st->pad, h = config_.hidden_size;
  if (d.rows() != ns * bs || d.cols() != h)
    throw ShapeError("RetroDecoderCrossAttention backward: d has " + std::to_string(d.rows()) + " x " +
                     std::to_string(d.cols()) + " rows, expected [ns, bs, d] = [" + std::to_string(ns) + ", " +
                     std::to_string(bs) + ", " + std::to_string(h) + "]");
  if (d_context && (d_context->rows() != r * k * bs * l || d_context->cols() != h))
    throw ShapeError("RetroDecoderCrossAttention backward: d context has " + std::to_string(d_context->rows()) + " x " +
                     std::to_string(d_context->cols()) + " rows, expected [r * k, bs * l, d] = [" +
                     std::to_string(r * k) + ", " + std::to_string(bs * l) + ", " + std::to_string(h) + "]");
  CrossAttentionWithBdaGrads g;
  // RetroDecoderBiasDropoutAdd: d residual = d; the unchunking's transpose; dropout's backward.
  g.residual = d;
  Mat dx = scatter_rows(d, unchunk_decoder_output_map(m, ns, bs, l, pad), m * bs * l);  // [m, bs*l, d]
  dx = dropout_backward(dx, bda.hidden_dropout, bda.training, bda.rng, p_);
  // attn (mask None) on the attending chunks and key_value_states [r*k, bs*l, d].
  CrossAttentionGrads ag = attn.backward(dx, st->attn, static_cast<int>(m), static_cast<int>(r * k),
                                         static_cast<int>(bs * l), /*attention_mask=*/nullptr, args.training, args.rng);
  for (ParamGrad& pg : ag.params) g.params.push_back({"attn." + pg.name, std::move(pg.value), pg.shape, pg.magnitude});
  Mat dhidden = scatter_rows(ag.hidden_states, pad_attending_chunks_map(ns, bs, m), ns * bs);  // [ns, bs, d]
  Mat dkv = std::move(ag.key_value_states);                                                    // [r*k, bs*l, d]
  if (d_context) {
    dkv = p_.act(dkv + *d_context);  // rounds: accumulated gradient, activation dtype
    p_.count_act();
  }
  if (!encoder) {
    g.key_value_states = std::move(dkv);
    g.hidden_states = std::move(dhidden);
    return g;
  }
  // The encoder: d of its output [r, k*bs*l, d] (the same memory as [r*k, bs*l, d]).
  const TransformerBlockGrads eg = encoder->backward(p_.to_tensor(dkv, {r, k * bs * l, h}), std::move(st->encoder));
  for (const ParamGrad& pg : eg.params) g.params.push_back({"encoder." + pg.name, pg.value, pg.shape, pg.magnitude});
  g.key_value_states = to_mat(eg.hidden_states, r * k * bs * l, h, "encoder grad");  // d neighbour embeddings
  if (!eg.context) throw std::logic_error("RetroDecoderCrossAttention backward: the encoder returned no d context");
  const Mat dchunked = to_mat(*eg.context, m * bs * l, h, "encoder d context");  // d chunked_output
  // hidden_states fed the chunking and the attending chunks: autograd sums the two (stored).
  g.hidden_states = p_.act(dhidden + scatter_rows(dchunked, chunk_encoder_context_map(ns, bs, m), ns * bs));
  p_.count_act();  // rounds: accumulated gradient, activation dtype
  return g;
}

Mat retro_decoder_bias_dropout_add(const AttentionOutput& x_with_bias, const Mat& residual, double prob, bool training,
                                   const DropoutRng& rng, const Precision& prec) {
  const auto* dims = static_cast<const RetroDecoderChunking*>(x_with_bias.extra.get());
  if (!dims) throw std::logic_error("RetroDecoderBiasDropoutAdd needs the output of RetroDecoderCrossAttention");
  const auto& [ns, bs, d, l, pad, m] = *dims;
  const Mat& attention_output = x_with_bias.output;  // [ m, bs*l, d ]
  if (attention_output.rows() != m * bs * l || attention_output.cols() != d)
    throw ShapeError("RetroDecoderBiasDropoutAdd: attention_output has " + std::to_string(attention_output.rows()) +
                     " x " + std::to_string(attention_output.cols()) + " rows, expected [m, bs*l, d] = [" +
                     std::to_string(m) + ", " + std::to_string(bs * l) + ", " + std::to_string(d) + "]");
  if (residual.rows() != ns * bs || residual.cols() != d)
    throw ShapeError("RetroDecoderBiasDropoutAdd: residual has " + std::to_string(residual.rows()) + " x " +
                     std::to_string(residual.cols()) + " rows, expected [ns, bs, d] = [" + std::to_string(ns) + ", " +
                     std::to_string(bs) + ", " + std::to_string(d) + "]");

  // Bias-dropout-add with a zero residual. [ m, bs*l, d ]
  const Mat x = bias_dropout_add(attention_output, x_with_bias.bias, Mat::Zero(attention_output.rows(), d), prob,
                                 training, rng, prec);

  // Permute chunks back to sequence dimension and prepend zeros for non-attending tokens.
  // [ m, bs*l, d ] -> [ m, bs, l, d ] -> [ l, m, bs, d ] -> [ m*l, bs, d ] -> [ ns, bs, d ]
  Mat out = gather_rows(x, unchunk_decoder_output_map(m, ns, bs, l, pad));

  // Add residual. [ ns, bs, d ]
  out += residual;
  prec.act_inplace(out);  // rounds: x + residual, activation dtype
  prec.count_act();
  return out;
}

BdaBuilder retro_decoder_bias_dropout_add_builder() {
  return [](bool training, bool /*fused: same math*/, DropoutRng rng, Precision p) -> BdaFunc {
    return [training, rng, p](const AttentionOutput& x_with_bias, const Mat& residual, double prob) {
      return retro_decoder_bias_dropout_add(x_with_bias, residual, prob, training, rng, p);
    };
  };
}

}  // namespace twin::reference::retro
