// Shared pieces of the Retro reference tests: the weights of the first-layer fixture (a Retro
// decoder layer with its 2-layer encoder; hidden 64, 4 heads), a config whose Retro sizes (chunk
// length, neighbours, retrieved chunks) a test may change (no weight depends on them), seeded
// random inputs, and layer construction through the spec functions.
#pragma once

#include <cstdlib>
#include <memory>
#include <random>
#include <string>

#include "fixtures/fixture.h"
#include "reference/retro/decoder_layer_spec.h"
#include "reference/retro/encoder_spec.h"
#include "reference/transformer_layer.h"

namespace twin::test {

inline std::string fixture_dir() { return golden_dir() + "/"; }

inline const Fixture& first_layer_fixture() {
  static const Fixture f = load_fixture(fixture_dir() + "retro_first_layer_divisible.safetensors");
  return f;
}

// param.* of the first-layer fixture; with_encoder = false drops the encoder's keys (a later layer).
// dtype: the parameters converted to it (bf16 / fp16 as Megatron's Float16Module holds them).
inline reference::StateDict retro_layer_params(bool with_encoder, DType dtype = DType::F32) {
  reference::StateDict sd;
  for (const auto& name : first_layer_fixture().names_with_prefix("param.")) {
    const std::string key = name.substr(6);
    if (!with_encoder && key.rfind("cross_attention.encoder.", 0) == 0) continue;
    const Tensor& t = first_layer_fixture().tensor(name);
    sd.set(key, dtype == DType::F32 ? t : t.to(dtype));
  }
  return sd;
}

// The Float16Module flags and params_dtype of a stored dtype (fp32, bf16, fp16).
inline void set_params_dtype(TransformerConfig& c, DType dtype) {
  c.bf16 = dtype == DType::BF16;
  c.fp16 = dtype == DType::F16;
  c.params_dtype = dtype == DType::BF16 ? "bfloat16" : dtype == DType::F16 ? "float16" : "float32";
}

inline TransformerConfig retro_config(int chunk_length, int neighbors, int retrieved_chunks) {
  TransformerConfig c = first_layer_fixture().config;
  c.retro_chunk_length = chunk_length;
  c.retro_num_neighbors = neighbors;
  c.retro_num_retrieved_chunks = retrieved_chunks;
  c.retro_retrieved_length = chunk_length * retrieved_chunks;
  return c;
}

inline Tensor random_tensor(Shape shape, std::uint32_t seed, double scale = 1.0) {
  std::mt19937 gen(seed);
  std::normal_distribution<double> dist(0.0, scale);
  std::vector<double> v(static_cast<std::size_t>(shape_numel(shape)));
  for (auto& x : v) x = dist(gen);
  return Tensor::from_doubles(DType::F32, std::move(shape), v);
}

// A Retro decoder layer (local spec) with the fixture's weights; the first Retro layer owns the encoder.
inline std::unique_ptr<reference::TransformerLayer> retro_decoder_layer(const TransformerConfig& c, bool with_encoder,
                                                                        bool te = false, int layer_number = 6) {
  using namespace reference::retro;
  std::optional<reference::TransformerBlockSubmodules> enc;
  if (with_encoder) enc = get_retro_encoder_block_spec(c, te);
  const RetroLayerSpec spec = te ? get_retro_decoder_layer_te_spec(enc) : get_retro_decoder_layer_local_spec(enc);
  std::unique_ptr<reference::BaseTransformerLayer> built =
      spec.spec.build(c, layer_number, reference::Precision::from_config(c));
  std::unique_ptr<reference::TransformerLayer> layer(dynamic_cast<reference::TransformerLayer*>(built.release()));
  layer->load_state_dict(retro_layer_params(with_encoder, reference::Precision::from_config(c).params_dtype));
  return layer;
}

}  // namespace twin::test
