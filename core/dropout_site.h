// The dropout streams of a layer, named once for both twins. A stream is the Philox offset of one
// dropout call (reference/philox.h): two calls never share an offset, so their masks are
// independent, and the reference and the optimized twin draw the same mask for the same site.
//
//   layer base offset o (a block gives layer i the base o + kLayerStride * i):
//     o + SelfAttention   self_attention.core_attention's attention-probability dropout
//     o + SelfAttnBda     self_attn_bda
//     o + CrossAttention  cross_attention.core_attention's dropout (Retro's encoder block and
//                         neighbours derive their streams from this one, below)
//     o + CrossAttnBda    cross_attn_bda
//     o + MlpBda          mlp_bda
//
//   Retro: the decoder's cross attention runs the encoder block at its own stream
//   + kRetroEncoderBlock; the encoder's cross attention gives neighbour n the stream
//   + (n + 1) * kRetroNeighbourStride.
#pragma once

#include <cstdint>

namespace twin {

enum class DropoutSite : std::uint64_t {
  SelfAttention = 0,
  SelfAttnBda = 1,
  CrossAttention = 2,
  CrossAttnBda = 3,
  MlpBda = 4,
};

// Offsets between consecutive layers of a block; more than the sites of one layer.
constexpr std::uint64_t kLayerStride = 8;
static_assert(static_cast<std::uint64_t>(DropoutSite::MlpBda) < kLayerStride, "a layer's sites fit its stride");
constexpr std::uint64_t kRetroEncoderBlock = std::uint64_t{1} << 40;
constexpr std::uint64_t kRetroNeighbourStride = std::uint64_t{1} << 32;

// The offset of `site` in the layer whose base offset is `layer_offset`.
constexpr std::uint64_t dropout_offset(std::uint64_t layer_offset, DropoutSite site) {
  return layer_offset + static_cast<std::uint64_t>(site);
}
// The base offset of layer `i` (0-based) of a block whose base offset is `block_offset`.
constexpr std::uint64_t block_layer_offset(std::uint64_t block_offset, std::uint64_t i) {
  return block_offset + kLayerStride * i;
}
// The stream of Retro's encoder neighbour n under the encoder's cross-attention stream.
constexpr std::uint64_t retro_neighbour_offset(std::uint64_t cross_attention_offset, std::uint64_t n) {
  return cross_attention_offset + (n + 1) * kRetroNeighbourStride;
}

}  // namespace twin
