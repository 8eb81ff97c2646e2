// RetroEncoderCrossAttention and RetroEncoderBiasDropoutAdd on the optimized twin
// (megatron/core/models/retro/encoder_attention.py; reference/retro/encoder_attention.h): every
// neighbour attends to the decoder's chunks, one core attention per neighbour reading its queries
// in place, each under its own Philox offset.
#include <cstring>

#include "core/dropout_site.h"
#include "optimized/retro/retro_layer_impl.h"

namespace twin::opt::retro {

// RetroEncoderCrossAttention + RetroEncoderBiasDropoutAdd. ln: the pre_cross_attn_layernorm
// output [r, N*k, d] (column j*k + n); chunked: the decoder chunks [m, N, d]. Returns [r, k*N, d]
// neighbour-major.
DTensor Layer::encoder_cross_attention(const RankContext& ex, const DTensor& ln, const DTensor& chunked,
                                       std::uint64_t offset, const std::string& pre, LayerActs* a) const {
  const std::int64_t k = rs.k, r = rs.r, d = h;
  if (chunked.shape.size() != 3 || chunked.shape[2] != d)
    throw ShapeError("RetroEncoderCrossAttention: key_value_states expected shape [m, bs*l, " + std::to_string(d) +
                     "], got " + shape_str(chunked.shape));
  const std::int64_t sk = chunked.shape[0], N = chunked.shape[1];
  if (ln.shape[0] != r || ln.shape[1] != k * N)
    throw ShapeError("RetroEncoderCrossAttention: neighbour hidden states " + shape_str(ln.shape) +
                     " do not fit [r, k * bs*l, d] = [" + std::to_string(r) + ", " + std::to_string(k * N) + ", " +
                     std::to_string(d) + "]");
  const std::uint64_t attn_offset = dropout_offset(offset, DropoutSite::CrossAttention);
  const std::int64_t D = std::int64_t(np_l(ex)) * hn;  // this rank's heads
  // Each neighbour is a branch from the input: all have the same count, joined after the loop.
  const RoundingCount at_input = rounding_now();
  const DTensor kv = linear(ex, chunked, "cross_attention.attn.linear_kv", true, 2 * D);  // [m, N, np * 2hn]
  const DTensor q = linear(ex, ln, "cross_attention.attn.linear_q", true, D);             // [r, N*k, np * hn]
  const RoundingCount after_q = rounding_now();
  const DTensor core = ex.alloc({k * r, N, D});  // neighbour n's context at rows [n*r, (n+1)*r)
  if (a) {
    a->query_in = ln;
    a->kv_in = chunked;
    a->q = q;
    a->kv = kv;
    a->cross_core = core;
    a->cross_stats.clear();
  }
  for (std::int64_t n = 0; n < k; ++n) {
    rounding_set(after_q);
    // Neighbour n's queries are column j*k + n of every retrieved position: read in place.
    const AttnOperands ops =
        AttnOperands::from_q_kv(static_cast<const char*>(q.get()) + std::size_t(n * D) * dtype_size(ex.dt), N * k * D,
                                kv.get(), N, D, int(hn), dtype_size(ex.dt));
    const std::uint64_t neighbour_offset = retro_neighbour_offset(attn_offset, std::uint64_t(n));
    AttnParams ap = attn_params(ex, int(r), int(sk), int(N), cross_attention_dropout, neighbour_offset);
    if (a) a->cross_stats.push_back(save_softmax_stats(ex, ap));
    ex.ops->dot_product_attention_forward(
        ex.dt, ops, static_cast<char*>(core.get()) + std::size_t(n * r * N * D) * dtype_size(ex.dt), ap, ex.st());
  }
  const DTensor proj = row_parallel_linear(ex, core, "cross_attention.attn.linear_proj");  // [k*r, N, d]
  const RoundingCount neighbours_end = rounding_now();
  if (ex.recording()) {
    const Tensor all = ex.download(proj);
    const Tensor lnh = ex.download(ln);
    const Tensor* bias = host_param("cross_attention.attn.linear_proj.bias");
    const std::size_t es = dtype_size(ex.dt), row = std::size_t(d) * es;
    for (std::int64_t n = 0; n < k; ++n) {
      const std::string i = std::to_string(n);
      Tensor out = Tensor::empty(ex.dt, {r, N, d});
      std::memcpy(out.raw_mut(), all.raw() + std::size_t(n * r * N) * row, std::size_t(r * N) * row);
      rounding_set(neighbours_end);
      ex.tap_value(pre + i + ".0", std::move(out));
      ex.tap_param(pre + i + ".1", bias);
      Tensor res = Tensor::empty(ex.dt, {r, N, d});  // chunked_output = hidden_states.reshape(r, -1, k, d)[:, :, n]
      for (std::int64_t t = 0; t < r; ++t)
        for (std::int64_t j = 0; j < N; ++j)
          std::memcpy(res.raw_mut() + std::size_t(t * N + j) * row, lnh.raw() + std::size_t((t * N + j) * k + n) * row,
                      row);
      rounding_set(at_input);
      ex.tap_value(pre + i + ".2", std::move(res));
    }
  }
  rounding_set(neighbours_end);
  DTensor out = ex.alloc({r, k * N, d});
  ex.ops->retro_encoder_bias_dropout_add(
      ex.dt, proj.get(), w(ex, "cross_attention.attn.linear_proj.bias"), ln.get(), out.get(), r, N, k, int(d),
      hidden_dropout_args(ex, dropout_offset(offset, DropoutSite::CrossAttnBda)), ex.st());
  return out;
}

// RetroEncoderBiasDropoutAdd's and RetroEncoderCrossAttention's backward (the reference's
// backward_with_bda), neighbour by neighbour as Megatron's loop ran: the stack's transpose gives
// each neighbour's d out (also the gradient of its residual, chunked_output_n); dropout's
// backward under its offset; attn's backward; d chunked_output_n = d query + d residual (stored)
// into its columns of d lnc; d key_value_states and the attention's parameter gradients summed
// over the neighbours (autograd's accumulation, stored). No gradient of the layer's residual h1:
// the bda does not read it. d h2 [r, k*N, d] -> (d lnc [r, N*k, d], d chunked [m, N, d]).
std::pair<DTensor, DTensor> Layer::encoder_cross_attention_backward(const RankContext& ex, const LayerActs& a,
                                                                    const DTensor& d_h2, std::uint64_t offset,
                                                                    const std::string& pre, RankParamGrads& g) const {
  const std::int64_t k = rs.k, r = rs.r, d = h, sk = a.kv_in.shape[0], N = a.kv_in.shape[1], rows = r * N;
  const std::int64_t D = std::int64_t(np_l(ex)) * hn;
  const std::size_t es = dtype_size(ex.dt);
  const std::uint64_t attn_offset = dropout_offset(offset, DropoutSite::CrossAttention);
  const DropoutArgs drop = hidden_dropout_args(ex, dropout_offset(offset, DropoutSite::CrossAttnBda));
  RetroMapArgs stack;  // the k outputs one after another -> [r, k*N]: a permutation, every row written
  stack.map = RetroMap::StackNeighbors;
  stack.r = r;
  stack.N = N;
  stack.k = k;
  const DTensor douts = ex.alloc({k * rows, d});
  ex.ops->retro_scatter_rows(ex.dt, d_h2.get(), douts.get(), stack, k * rows, int(d), ex.st());
  const DTensor d_lnc = ex.alloc({r, N * k, d});  // the neighbours' columns partition it: every row written
  std::optional<DTensor> d_chunked;
  for (std::int64_t n = 0; n < k; ++n) {
    RetroMapArgs split = stack;  // neighbour n's columns j*k + n of [r, N*k]
    split.map = RetroMap::SplitNeighbors;
    split.n = n;
    const DTensor dout = row_slice(douts, n * rows, (n + 1) * rows, es);  // [r*N, d]
    const DTensor dx = ex.alloc({rows, d});
    DropoutArgs drop_n = drop;
    drop_n.offset = retro_neighbour_offset(drop.offset, std::uint64_t(n));
    ex.ops->bias_dropout_add_backward(ex.dt, dout.get(), dx.get(), nullptr, nullptr, rows, int(d), drop_n, 0, nullptr,
                                      0, ex.st());
    // Neighbour n's query rows and its linear_q output rows, gathered (the forward read them in place).
    const DTensor query_in = ex.alloc({rows, d}), q = ex.alloc({rows, D});
    ex.ops->retro_gather_rows(ex.dt, a.query_in.get(), query_in.get(), split, k * rows, int(d), ex.st());
    ex.ops->retro_gather_rows(ex.dt, a.q.get(), q.get(), split, k * rows, int(D), ex.st());
    const CrossCall call{query_in,
                         q,
                         a.kv_in,
                         a.kv,
                         row_slice(a.cross_core, n * rows, (n + 1) * rows, es),
                         a.cross_stats.at(static_cast<std::size_t>(n)),
                         int(r),
                         int(sk),
                         int(N),
                         retro_neighbour_offset(attn_offset, std::uint64_t(n))};
    auto [d_query, d_kv] = cross_attn_backward(ex, call, dx, pre, g);
    const DTensor d_chunked_output = ex.grad_sum(d_query, dout);
    ex.ops->retro_scatter_rows(ex.dt, d_chunked_output.get(), d_lnc.get(), split, k * rows, int(d), ex.st());
    d_chunked = d_chunked ? ex.grad_sum(*d_chunked, d_kv) : d_kv;
  }
  return {d_lnc, view(*d_chunked, {sk, N, d})};
}

}  // namespace twin::opt::retro
