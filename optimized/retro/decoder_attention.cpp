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
                                       const std::string& pre, LayerActs* a) const {
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
    if (a) a->encoder = std::make_unique<BlockActs>();
    auto [encoded, enc_context] = encoder->forward(ex, *context, chunked, mask, attn_offset + kRetroEncoderBlock,
                                                   pre + "encoder.", a ? a->encoder.get() : nullptr);
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
  ex.tap(pre + "attn.linear_kv.0", kv, {2, 1});                                         // this rank's heads
  const DTensor q = linear(ex, padded, "cross_attention.attn.linear_q", true, D);       // [m, N, np_l * hn]
  ex.tap(pre + "attn.linear_q.0", q, {2, 1});
  const AttnOperands ops = AttnOperands::from_q_kv(q.get(), N * D, kv.get(), N, D, int(hn), dtype_size(ex.dt));
  const DTensor core = ex.alloc({m, N, D});
  AttnParams ap = attn_params(ex, int(m), int(r * k), int(N), cross_attention_dropout, attn_offset);
  const std::optional<DTensor> stats =
      a || ex.recording() ? std::optional<DTensor>(save_softmax_stats(ex, ap)) : std::nullopt;
  if (a) {
    a->query_in = padded;
    a->kv_in = kv_in;
    a->q = q;
    a->kv = kv;
    a->cross_core = core;
    a->cross_stats = {*stats};
  }
  ex.ops->dot_product_attention_forward(ex.dt, ops, core.get(), ap, ex.st());
  if (ex.recording())  // v: the last hn columns of each head's [k | v] in linear_kv's output
    ex.tap(pre + "attn.core_attention", core, {2, 1},
           core_attention_magnitudes(ex, *stats, ap, view(kv, {r * k, N, np_l(ex), 2 * hn}), hn));
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

// RetroDecoderBiasDropoutAdd's and RetroDecoderCrossAttention's backward (the reference's
// backward_with_bda): d residual = d h2 (the caller's); d attention output = the unchunking's
// transpose of d h2, then dropout's backward; attn's backward; d key_value_states += d of the
// context handed on (it is key_value_states itself); the first Retro layer's encoder block's
// backward gives d of the neighbour embeddings and d chunked_output, whose chunking's transpose
// joins the attending chunks' in d lnc (autograd's sum, stored).
std::pair<DTensor, DTensor> Layer::decoder_cross_attention_backward(const RankContext& ex, const LayerActs& a,
                                                                    const DTensor& d_h2,
                                                                    std::optional<DTensor> d_context,
                                                                    std::uint64_t offset, const std::string& pre,
                                                                    RankParamGrads& g) const {
  const std::int64_t m = rs.m, k = rs.k, r = rs.r, ns = a.lnc.shape[0], bs = a.lnc.shape[1], d = h;
  const std::int64_t l = (ns + m - 1) / m, N = bs * l, pad = (ns - 1) % m;
  const std::uint64_t attn_offset = dropout_offset(offset, DropoutSite::CrossAttention);
  // cross_attn_bda: rows no token took stay zero.                        // [ns, bs, d] -> [m, N, d]
  const DTensor d_proj = ex.zeros({m * N, d});
  ex.ops->retro_scatter_rows(ex.dt, d_h2.get(), d_proj.get(), chunk_map(RetroMap::UnchunkDecoderOutput, ns, bs, m, pad),
                             m * N, int(d), ex.st());
  ex.ops->bias_dropout_add_backward(ex.dt, d_proj.get(), d_proj.get(), nullptr, nullptr, m * N, int(d),
                                    hidden_dropout_args(ex, dropout_offset(offset, DropoutSite::CrossAttnBda)), 0,
                                    nullptr, 0, ex.st());
  // attn on the attending chunks and key_value_states                   // [m, N, d], [r*k, N, d]
  const CrossCall call{a.query_in,          a.q,    a.kv_in,    a.kv,   a.cross_core,
                       a.cross_stats.at(0), int(m), int(r * k), int(N), attn_offset};
  auto [d_padded, d_kv_in] = cross_attn_backward(ex, call, d_proj, pre, g);
  if (d_context) d_kv_in = ex.grad_sum(d_kv_in, *d_context);
  DTensor d_lnc = ex.zeros({ns, bs, d});  // tokens before pad attend nowhere
  ex.ops->retro_scatter_rows(ex.dt, d_padded.get(), d_lnc.get(),
                             chunk_map(RetroMap::PadAttendingChunks, ns, bs, m, pad), ns * bs, int(d), ex.st());
  if (!encoder) return {d_lnc, view(d_kv_in, {r * k, N, d})};
  // The encoder: d of its output [r, k*N, d] (the same memory as [r*k, N, d]).
  auto [d_neighbours, d_chunked] =
      encoder->backward(ex, *a.encoder, view(d_kv_in, {r, k * N, d}), std::nullopt, attn_offset + kRetroEncoderBlock,
                        pre + "cross_attention.encoder.", g);
  if (!d_chunked) throw std::logic_error("RetroDecoderCrossAttention backward: the encoder returned no d context");
  const DTensor d_chunk = ex.zeros({ns, bs, d});  // the right padding of chunk 0 came from no token
  ex.ops->retro_scatter_rows(ex.dt, d_chunked->get(), d_chunk.get(),
                             chunk_map(RetroMap::ChunkEncoderContext, ns, bs, m, 0), ns * bs, int(d), ex.st());
  return {ex.grad_sum(d_lnc, d_chunk), d_neighbours};
}

}  // namespace twin::opt::retro
