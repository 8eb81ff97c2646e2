// RetroDecoderCrossAttention and RetroDecoderBiasDropoutAdd on the optimized twin
// (megatron/core/models/retro/decoder_attention.py; reference/retro/decoder_attention.h): the
// decoder's chunks attend to their neighbours (or, in the first Retro layer, the retriever
// encoder's output on them), reshuffled on the device by retro_kernels.cuh's index maps.
#include "core/dropout_site.h"
#include "optimized/retro/retro_layer_impl.h"

namespace twin::opt::retro {

namespace {

// A reshuffle between the decoder's sequence [ns, bs] and its l = ceil(ns / m) chunks [m, bs*l]
// (retro_kernels.cuh), the attending chunks starting at token `pad`.
RetroMapArgs chunk_map(RetroMap map, std::int64_t ns, std::int64_t bs, std::int64_t m, std::int64_t pad) {
  RetroMapArgs a;
  a.map = map;
  a.ns = ns;
  a.bs = bs;
  a.m = m;
  a.l = (ns + m - 1) / m;
  a.pad = pad;
  return a;
}

}  // namespace

// RetroDecoderCrossAttention + RetroDecoderBiasDropoutAdd. ln: the pre_cross_attn_layernorm
// output [ns, bs, d]; residual: the self_attn_bda output. `context` in: the neighbour embeddings
// (with the encoder) or the encoder output; out: the encoder output [r*k, bs*l, d].
DTensor Layer::decoder_cross_attention(const RankContext& ex, const DTensor& ln, const DTensor& residual,
                                       std::optional<DTensor>& context, const DTensor* mask, std::uint64_t offset,
                                       const std::string& pre) const {
  const std::int64_t m = rs.m, k = rs.k, r = rs.r, ns = ln.shape[0], bs = ln.shape[1], d = h;
  const std::int64_t l = (ns + m - 1) / m, N = bs * l, pad = (ns - 1) % m;
  const std::string sizes = " (r = retro_retrieved_length = " + std::to_string(r) +
                            ", k = retro_num_neighbors = " + std::to_string(k) + ", bs = " + std::to_string(bs) +
                            ", l = ceil(ns / m) = ceil(" + std::to_string(ns) + " / " + std::to_string(m) +
                            ") = " + std::to_string(l) + ")";
  if (!context)
    throw std::invalid_argument(std::string("RetroDecoderCrossAttention: key_value_states (") +
                                (encoder ? "the neighbour embeddings" : "the encoder output") + ") cannot be None");
  const std::uint64_t attn_offset = dropout_offset(offset, DropoutSite::CrossAttention);
  DTensor kv_in;  // [r*k, N, d]
  if (encoder) {
    const Shape want{r, k * N, d};
    if (context->shape != want)
      throw ShapeError(
          "RetroDecoderCrossAttention: neighbour embeddings (context) expected shape [r, k * bs * l, d] = " +
          shape_str(want) + sizes + ", got " + shape_str(context->shape));
    // Chunk the decoder states for the encoder: first ns % m tokens right-padded into chunk 0.
    const RetroMapArgs chunk = chunk_map(RetroMap::ChunkEncoderContext, ns, bs, m, 0);
    DTensor chunked = ex.alloc({m, N, d});  // [m, bs*l, d]
    ex.ops->retro_gather_rows(ex.dt, ln.get(), chunked.get(), chunk, ns * bs, int(d), ex.st());
    const RoundingCount hidden_rounding = rounding_now();
    auto [encoded, enc_context] =
        encoder->forward(ex, *context, chunked, mask, attn_offset + kRetroEncoderBlock, pre + "encoder.");
    ex.tap(pre + "encoder", encoded);  // [r, k*bs*l, d]
    rounding_join(hidden_rounding);
    kv_in = view(encoded, {r * k, N, d});
  } else {
    const Shape want{r * k, N, d};
    if (context->shape != want)
      throw ShapeError("RetroDecoderCrossAttention: encoder output (context) expected shape [r * k, bs * l, d] = " +
                       shape_str(want) + sizes + ", got " + shape_str(context->shape));
    kv_in = *context;
  }
  // Attending chunks: from the last token of the first chunk, right-padded to l*m. [m, N, d]
  const RetroMapArgs attending = chunk_map(RetroMap::PadAttendingChunks, ns, bs, m, pad);
  const DTensor padded = ex.alloc({m, N, d});
  ex.ops->retro_gather_rows(ex.dt, ln.get(), padded.get(), attending, ns * bs, int(d), ex.st());

  // attn: linear_kv on the neighbours, linear_q on the chunks, core attention (no mask), linear_proj.
  const std::int64_t D = std::int64_t(np_l(ex)) * hn;                                   // this rank's heads
  const DTensor kv = linear(ex, kv_in, "cross_attention.attn.linear_kv", true, 2 * D);  // [r*k, N, np_l * 2hn]
  ex.tap(pre + "attn.linear_kv.0", kv);
  const DTensor q = linear(ex, padded, "cross_attention.attn.linear_q", true, D);  // [m, N, np_l * hn]
  ex.tap(pre + "attn.linear_q.0", q);
  const AttnOperands ops = AttnOperands::from_q_kv(q.get(), N * D, kv.get(), N, D, int(hn), dtype_size(ex.dt));
  const DTensor core = ex.alloc({m, N, D});
  ex.ops->dot_product_attention_forward(
      ex.dt, ops, core.get(), attn_params(ex, int(m), int(r * k), int(N), cross_attention_dropout, attn_offset),
      ex.st());
  ex.tap(pre + "attn.core_attention", core);
  const DTensor proj = row_parallel_linear(ex, core, "cross_attention.attn.linear_proj");  // [m, N, d]
  proj_taps(ex, proj, pre.substr(0, pre.size() - std::string("cross_attention.").size()), "cross_attention.attn",
            "linear_proj");
  ex.tap(pre + "attention_output", proj);
  ex.tap_param(pre + "attention_bias", host_param("cross_attention.attn.linear_proj.bias"));
  ex.tap(pre + "context", kv_in);
  context = kv_in;

  // RetroDecoderBiasDropoutAdd: zero-residual bda on the chunks, unchunked, + residual. [ns, bs, d]
  const RetroMapArgs unchunk = chunk_map(RetroMap::UnchunkDecoderOutput, ns, bs, m, pad);
  DTensor out = ex.alloc(residual.shape);
  ex.ops->retro_decoder_bias_dropout_add(
      ex.dt, proj.get(), w(ex, "cross_attention.attn.linear_proj.bias"), residual.get(), out.get(), unchunk, int(d),
      hidden_dropout_args(ex, dropout_offset(offset, DropoutSite::CrossAttnBda)), ex.st());
  return out;
}

}  // namespace twin::opt::retro
