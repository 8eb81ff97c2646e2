#include "reference/retro/chunking.h"

#include <cstring>
#include <stdexcept>
#include <string>

namespace twin::reference::retro {
namespace {

void expect_rank3(const Tensor& t, const std::string& what) {
  if (!t.defined() || t.dim() != 3)
    throw ShapeError(what + ": expected a rank-3 tensor [s, b, d], got " +
                     (t.defined() ? shape_str(t.shape()) : std::string("no tensor")));
}

void expect_chunk_length(std::int64_t m) {
  if (m <= 0) throw ShapeError("retro_chunk_length must be positive, got " + std::to_string(m));
}

}  // namespace

Tensor gather_rows(const Tensor& x, const RowMap& map, Shape out_shape) {
  const std::int64_t d = x.dim() == 0 ? 1 : x.size(-1);
  const std::int64_t rows = d == 0 ? 0 : x.numel() / d;
  if (out_shape.empty() || out_shape.back() != d || shape_numel(out_shape) != static_cast<std::int64_t>(map.size()) * d)
    throw ShapeError("gather_rows: output shape " + shape_str(out_shape) + " does not hold " +
                     std::to_string(map.size()) + " rows of " + std::to_string(d));
  const std::size_t row_bytes = static_cast<std::size_t>(d) * dtype_size(x.dtype());
  Tensor out = Tensor::zeros(x.dtype(), std::move(out_shape));
  std::byte* o = out.raw_mut();
  for (std::size_t i = 0; i < map.size(); ++i) {
    if (map[i] < 0) continue;
    if (map[i] >= rows)
      throw ShapeError("gather_rows: row " + std::to_string(map[i]) + " out of " + std::to_string(rows));
    std::memcpy(o + i * row_bytes, x.raw() + static_cast<std::size_t>(map[i]) * row_bytes, row_bytes);
  }
  return out;
}

Mat gather_rows(const Mat& x, const RowMap& map) {
  Mat out = Mat::Zero(static_cast<Eigen::Index>(map.size()), x.cols());
  for (std::size_t i = 0; i < map.size(); ++i) {
    if (map[i] < 0) continue;
    if (map[i] >= x.rows())
      throw ShapeError("gather_rows: row " + std::to_string(map[i]) + " out of " + std::to_string(x.rows()));
    out.row(static_cast<Eigen::Index>(i)) = x.row(static_cast<Eigen::Index>(map[i]));
  }
  return out;
}

Mat scatter_rows(const Mat& dy, const RowMap& map, Eigen::Index rows) {
  if (dy.rows() != static_cast<Eigen::Index>(map.size()))
    throw ShapeError("scatter_rows: " + std::to_string(dy.rows()) + " gradient rows for a map of " +
                     std::to_string(map.size()));
  Mat out = Mat::Zero(rows, dy.cols());
  std::vector<bool> hit(static_cast<std::size_t>(rows), false);
  for (std::size_t i = 0; i < map.size(); ++i) {
    if (map[i] < 0) continue;
    if (map[i] >= rows)
      throw ShapeError("scatter_rows: row " + std::to_string(map[i]) + " out of " + std::to_string(rows));
    if (hit[static_cast<std::size_t>(map[i])])
      throw std::logic_error("scatter_rows: row " + std::to_string(map[i]) + " is read twice by the map");
    hit[static_cast<std::size_t>(map[i])] = true;
    out.row(map[i]) = dy.row(static_cast<Eigen::Index>(i));
  }
  return out;
}

std::int64_t num_chunks(std::int64_t ns, std::int64_t m) {
  expect_chunk_length(m);
  return (ns + m - 1) / m;
}

std::int64_t attending_pad(std::int64_t ns, std::int64_t m) {
  expect_chunk_length(m);
  if (ns <= 0) throw ShapeError("Retro decoder: sequence length must be positive, got " + std::to_string(ns));
  return (ns - 1) % m;
}

// cat(pad(h[:first_ns], m), h[first_ns:]) when first_ns = ns % m > 0, else h itself, as [l*m]
// sequence positions; then reshape(l, m, bs, d).permute(1, 2, 0, 3): row (i, b*l + chunk)
// takes position chunk*m + i of sample b.
RowMap chunk_encoder_context_map(std::int64_t ns, std::int64_t bs, std::int64_t m) {
  const std::int64_t l = num_chunks(ns, m);
  const std::int64_t first_ns = ns % m;  // sequence length remainder
  RowMap map(static_cast<std::size_t>(m * bs * l), -1);
  for (std::int64_t t = 0; t < l * m; ++t) {
    std::int64_t src;  // source sequence position; -1 = padding
    if (first_ns == 0)
      src = t;
    else if (t < m)
      src = t < first_ns ? t : -1;
    else
      src = first_ns + (t - m);
    if (src < 0) continue;
    const std::int64_t chunk = t / m, i = t % m;
    for (std::int64_t b = 0; b < bs; ++b) map[static_cast<std::size_t>(i * bs * l + b * l + chunk)] = src * bs + b;
  }
  return map;
}

// padded_chunks = pad(h[pad:], m - 1 zeros behind) has l*m positions (ns - pad + m - 1 == l*m);
// then the same permutation as above.
RowMap pad_attending_chunks_map(std::int64_t ns, std::int64_t bs, std::int64_t m) {
  const std::int64_t l = num_chunks(ns, m);
  const std::int64_t pad = attending_pad(ns, m);
  RowMap map(static_cast<std::size_t>(m * bs * l), -1);
  for (std::int64_t t = 0; t < l * m && pad + t < ns; ++t) {
    const std::int64_t chunk = t / m, i = t % m;
    for (std::int64_t b = 0; b < bs; ++b)
      map[static_cast<std::size_t>(i * bs * l + b * l + chunk)] = (pad + t) * bs + b;
  }
  return map;
}

// x.reshape(m, bs, l, d).permute(2, 0, 1, 3).reshape(m*l, bs, d), pad zeros prepended, [:ns]:
// sequence position pad + chunk*m + i of sample b takes x[i, b*l + chunk].
RowMap unchunk_decoder_output_map(std::int64_t m, std::int64_t ns, std::int64_t bs, std::int64_t l, std::int64_t pad) {
  RowMap map(static_cast<std::size_t>(ns * bs), -1);
  for (std::int64_t chunk = 0; chunk < l; ++chunk)
    for (std::int64_t i = 0; i < m; ++i) {
      const std::int64_t s = pad + chunk * m + i;
      if (s >= ns) continue;
      for (std::int64_t b = 0; b < bs; ++b) map[static_cast<std::size_t>(s * bs + b)] = i * bs * l + b * l + chunk;
    }
  return map;
}

// hidden_states.reshape(r, -1, k, d)[:, :, n]: row (t, j) takes (t, j*k + n).
RowMap split_neighbors_map(std::int64_t r, std::int64_t N, std::int64_t k, std::int64_t n) {
  RowMap map(static_cast<std::size_t>(r * N));
  for (std::int64_t t = 0; t < r; ++t)
    for (std::int64_t j = 0; j < N; ++j) map[static_cast<std::size_t>(t * N + j)] = t * N * k + j * k + n;
  return map;
}

// torch.stack(outputs, dim=1).reshape(r, -1, d) over the k parts laid one after another:
// row (t, n*N + j) takes row t*N + j of part n.
RowMap stack_neighbors_map(std::int64_t r, std::int64_t N, std::int64_t k) {
  RowMap map(static_cast<std::size_t>(r * k * N));
  for (std::int64_t t = 0; t < r; ++t)
    for (std::int64_t n = 0; n < k; ++n)
      for (std::int64_t j = 0; j < N; ++j) map[static_cast<std::size_t>(t * k * N + n * N + j)] = n * r * N + t * N + j;
  return map;
}

Tensor chunk_encoder_context(const Tensor& hidden_states, std::int64_t m) {
  expect_rank3(hidden_states, "RetroDecoderCrossAttention hidden_states");
  const std::int64_t ns = hidden_states.size(0), bs = hidden_states.size(1), d = hidden_states.size(2);
  const std::int64_t l = num_chunks(ns, m);
  return gather_rows(hidden_states, chunk_encoder_context_map(ns, bs, m), {m, bs * l, d});  // [m, bs*l, d]
}

Tensor pad_attending_chunks(const Tensor& hidden_states, std::int64_t m) {
  expect_rank3(hidden_states, "RetroDecoderCrossAttention hidden_states");
  const std::int64_t ns = hidden_states.size(0), bs = hidden_states.size(1), d = hidden_states.size(2);
  const std::int64_t l = num_chunks(ns, m);
  return gather_rows(hidden_states, pad_attending_chunks_map(ns, bs, m), {m, bs * l, d});  // [m, bs*l, d]
}

Tensor unchunk_decoder_output(const Tensor& x, std::int64_t ns, std::int64_t bs, std::int64_t l, std::int64_t pad) {
  expect_rank3(x, "RetroDecoderBiasDropoutAdd attention_output");
  const std::int64_t m = x.size(0), d = x.size(2);
  if (x.size(1) != bs * l)
    throw ShapeError("RetroDecoderBiasDropoutAdd: attention_output " + shape_str(x.shape()) +
                     " does not have bs * l = " + std::to_string(bs) + " * " + std::to_string(l) + " columns");
  if (pad < 0 || pad >= m || pad + l * m < ns)
    throw ShapeError("RetroDecoderBiasDropoutAdd: pad " + std::to_string(pad) + " does not fit ns " +
                     std::to_string(ns) + " with " + std::to_string(l) + " chunks of " + std::to_string(m));
  return gather_rows(x, unchunk_decoder_output_map(m, ns, bs, l, pad), {ns, bs, d});  // [ns, bs, d]
}

std::vector<Tensor> split_neighbors(const Tensor& hidden_states, std::int64_t r, std::int64_t k) {
  expect_rank3(hidden_states, "RetroEncoderCrossAttention hidden_states");
  const std::int64_t R = hidden_states.size(0), K = hidden_states.size(1), d = hidden_states.size(2);
  if (k <= 0) throw ShapeError("retro_num_neighbors must be positive, got " + std::to_string(k));
  if (R != r || K % k != 0)
    throw ShapeError("RetroEncoderCrossAttention: neighbour embeddings " + shape_str(hidden_states.shape()) +
                     " do not fit [r, bs*l*k, d] with r = " + std::to_string(r) + ", k = " + std::to_string(k));
  const std::int64_t N = K / k;  // bs * l
  std::vector<Tensor> chunked;
  for (std::int64_t n = 0; n < k; ++n)
    chunked.push_back(gather_rows(hidden_states, split_neighbors_map(r, N, k, n), {r, N, d}));  // [r, bs*l, d]
  return chunked;
}

Tensor stack_neighbors(const std::vector<Tensor>& outputs) {
  if (outputs.empty()) throw ShapeError("stack_neighbors: no tensors");
  expect_rank3(outputs[0], "stack_neighbors input 0");
  const Shape& s0 = outputs[0].shape();
  const std::int64_t r = s0[0], N = s0[1], d = s0[2], k = static_cast<std::int64_t>(outputs.size());
  const std::size_t part_bytes = outputs[0].nbytes();
  Tensor parts = Tensor::empty(outputs[0].dtype(), {k * r * N, d});
  for (std::size_t n = 0; n < outputs.size(); ++n) {
    outputs[n].expect(s0, outputs[0].dtype(), "stack_neighbors input " + std::to_string(n));
    std::memcpy(parts.raw_mut() + n * part_bytes, outputs[n].raw(), part_bytes);
  }
  return gather_rows(parts, stack_neighbors_map(r, N, k), {r, k * N, d});  // [r, k*N, d]
}

std::vector<Tensor> split_columns(const Tensor& input, std::int64_t k) {
  expect_rank3(input, "RetroEncoderLayerNorm input");
  const std::int64_t r = input.size(0), K = input.size(1), d = input.size(2);
  if (k <= 0 || K % k != 0)
    throw ShapeError("RetroEncoderLayerNorm: input " + shape_str(input.shape()) + " cannot be split into " +
                     std::to_string(k) + " neighbours of equal size");
  const std::int64_t N = K / k;
  std::vector<Tensor> parts;
  for (std::int64_t n = 0; n < k; ++n) {
    RowMap map(static_cast<std::size_t>(r * N));
    for (std::int64_t t = 0; t < r; ++t)
      for (std::int64_t j = 0; j < N; ++j) map[static_cast<std::size_t>(t * N + j)] = t * K + n * N + j;
    parts.push_back(gather_rows(input, map, {r, N, d}));  // [r, K/k, d]
  }
  return parts;
}

}  // namespace twin::reference::retro
