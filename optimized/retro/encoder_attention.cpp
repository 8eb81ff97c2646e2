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
                                       std::uint64_t offset, const std::string& pre) const {
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
  for (std::int64_t n = 0; n < k; ++n) {
    rounding_set(after_q);
    // Neighbour n's queries are column j*k + n of every retrieved position: read in place.
    const AttnOperands ops =
        AttnOperands::from_q_kv(static_cast<const char*>(q.get()) + std::size_t(n * D) * dtype_size(ex.dt), N * k * D,
                                kv.get(), N, D, int(hn), dtype_size(ex.dt));
    const std::uint64_t neighbour_offset = retro_neighbour_offset(attn_offset, std::uint64_t(n));
    ex.ops->dot_product_attention_forward(
        ex.dt, ops, static_cast<char*>(core.get()) + std::size_t(n * r * N * D) * dtype_size(ex.dt),
        attn_params(ex, int(r), int(sk), int(N), cross_attention_dropout, neighbour_offset), ex.st());
  }
  const DTensor proj = row_parallel_linear(ex, core, "cross_attention.attn.linear_proj");  // [k*r, N, d]
  const RoundingCount neighbours_end = rounding_now();
  if (ex.rec) {
    const Tensor all = ex.download(proj);
    const Tensor lnh = ex.download(ln);
    const Tensor* bias = host_param("cross_attention.attn.linear_proj.bias");
    const std::size_t es = dtype_size(ex.dt), row = std::size_t(d) * es;
    for (std::int64_t n = 0; n < k; ++n) {
      const std::string i = std::to_string(n);
      Tensor out = Tensor::empty(ex.dt, {r, N, d});
      std::memcpy(out.raw_mut(), all.raw() + std::size_t(n * r * N) * row, std::size_t(r * N) * row);
      rounding_set(neighbours_end);
      ex.rec->add(Role::Tap, pre + i + ".0", out);
      ex.tap_param(pre + i + ".1", bias);
      Tensor res = Tensor::empty(ex.dt, {r, N, d});  // chunked_output = hidden_states.reshape(r, -1, k, d)[:, :, n]
      for (std::int64_t t = 0; t < r; ++t)
        for (std::int64_t j = 0; j < N; ++j)
          std::memcpy(res.raw_mut() + std::size_t(t * N + j) * row, lnh.raw() + std::size_t((t * N + j) * k + n) * row,
                      row);
      rounding_set(at_input);
      ex.rec->add(Role::Tap, pre + i + ".2", res);
    }
  }
  rounding_set(neighbours_end);
  DTensor out = ex.alloc({r, k * N, d});
  ex.ops->retro_encoder_bias_dropout_add(
      ex.dt, proj.get(), w(ex, "cross_attention.attn.linear_proj.bias"), ln.get(), out.get(), r, N, k, int(d),
      hidden_dropout_args(ex, dropout_offset(offset, DropoutSite::CrossAttnBda)), ex.st());
  return out;
}

}  // namespace twin::opt::retro
