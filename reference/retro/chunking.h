// The pure tensor reshuffles of Retro's cross attention (no arithmetic), shared by
// decoder_attention.cpp and encoder_attention.cpp, each named after the Python step it mirrors.
// They move whole hidden vectors (rows of d elements) and work for every dtype.
//
// Notation (megatron/core/models/retro/decoder_attention.py):
//   ns: sequence length, bs: batch size, d: hidden size, m: chunk length,
//   l = ceil(ns / m): chunks per sample, k: neighbours, r: retrieved tokens per neighbour.
// A chunked tensor [m, bs*l, d] has batch column b * l + chunk; the neighbour tensor
// [r, k*bs*l, d] has batch column (b * l + chunk) * k + neighbour.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "reference/precision.h"

namespace twin::reference::retro {

// Each reshuffle is a row map: output row o (of the output's [S*B] rows) takes input row map[o],
// or zeros when map[o] < 0. gather_rows applies a map to a tensor or a matrix.
using RowMap = std::vector<std::int64_t>;
Tensor gather_rows(const Tensor& x, const RowMap& map, Shape out_shape);  // rows of d = x.shape.back()
Mat gather_rows(const Mat& x, const RowMap& map);                         // [rows, d] -> [map.size(), d]

// gather_rows' backward: out [rows, d] with out.row(map[o]) = dy.row(o), zero rows where no o
// maps. Every Retro reshuffle reads each source row at most once (std::logic_error otherwise), so
// no two gradients meet in a row: nothing is summed, nothing rounds.
Mat scatter_rows(const Mat& dy, const RowMap& map, Eigen::Index rows);  // [map.size(), d] -> [rows, d]

RowMap chunk_encoder_context_map(std::int64_t ns, std::int64_t bs, std::int64_t m);
RowMap pad_attending_chunks_map(std::int64_t ns, std::int64_t bs, std::int64_t m);
RowMap unchunk_decoder_output_map(std::int64_t m, std::int64_t ns, std::int64_t bs, std::int64_t l, std::int64_t pad);
RowMap split_neighbors_map(std::int64_t r, std::int64_t N, std::int64_t k, std::int64_t n);  // neighbour n
RowMap stack_neighbors_map(std::int64_t r, std::int64_t N, std::int64_t k);  // from the k parts concatenated row-wise

// l = ceil(ns / m). Throws ShapeError when m <= 0.
std::int64_t num_chunks(std::int64_t ns, std::int64_t m);

// Decoder, first Retro layer: the encoder's context. The first ns % m tokens are right-padded
// with zeros into chunk 0, the rest fill chunks 1..l-1; then [l*m, bs, d] -> [m, bs*l, d].
Tensor chunk_encoder_context(const Tensor& hidden_states, std::int64_t m);  // [ns, bs, d] -> [m, bs*l, d]

// Decoder, every Retro layer: the attending chunks. Tokens before pad = (ns - 1) % m are dropped,
// the rest right-padded with m - 1 zeros to l*m tokens, then [l*m, bs, d] -> [m, bs*l, d].
Tensor pad_attending_chunks(const Tensor& hidden_states, std::int64_t m);  // [ns, bs, d] -> [m, bs*l, d]
std::int64_t attending_pad(std::int64_t ns, std::int64_t m);               // (ns - 1) % m

// RetroDecoderBiasDropoutAdd's reshuffle: [m, bs*l, d] -> [m, bs, l, d] -> [l, m, bs, d] ->
// [l*m, bs, d], pad zeros prepended, cut to ns tokens. No residual.
Tensor unchunk_decoder_output(const Tensor& x, std::int64_t ns, std::int64_t bs, std::int64_t l,
                              std::int64_t pad);  // [m, bs*l, d] -> [ns, bs, d]

// RetroEncoderCrossAttention: hidden_states.reshape(r, -1, k, d)[:, :, n]  for n in 0..k-1.
std::vector<Tensor> split_neighbors(const Tensor& hidden_states, std::int64_t r,
                                    std::int64_t k);  // [r, bs*l*k, d] -> k x [r, bs*l, d]

// torch.stack(outputs, dim=1).reshape(r, -1, d): neighbour n lands in columns n*N .. n*N+N-1
// (neighbour-major, unlike the input's (b*l + chunk)*k + n).
Tensor stack_neighbors(const std::vector<Tensor>& outputs);  // k x [r, N, d] -> [r, k*N, d]

// torch.split(input, input.shape[1] // k, dim=1): k contiguous column blocks.
std::vector<Tensor> split_columns(const Tensor& input, std::int64_t k);  // [r, K, d] -> k x [r, K/k, d]

}  // namespace twin::reference::retro
