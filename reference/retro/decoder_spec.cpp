// Mirrors the layout steps of get_retro_decoder_block_spec (decoder_spec.py, Megatron-LM
// 93ddc247); the module specs themselves are built from this layout by the block.
#include "reference/retro/decoder_spec.h"

#include <algorithm>
#include <nlohmann/json.hpp>

#include "reference/transformer_layer_offset.h"

namespace twin::reference::retro {

const char* retro_layer_kind_name(RetroLayerKind kind) {
  switch (kind) {
    case RetroLayerKind::Gpt:
      return "gpt";
    case RetroLayerKind::Retro:
      return "retro";
    case RetroLayerKind::RetroWithEncoder:
      return "retro_with_encoder";
  }
  return "?";
}

std::vector<RetroLayerKind> get_retro_decoder_block_layout(const TransformerConfig& config, std::optional<int> vp_stage,
                                                           std::optional<int> pp_rank) {
  if (config.pipeline_model_parallel_size != 1)
    throw ConfigError(
        "get_retro_decoder_block_spec: retro does not currently support pipeline parallelism "
        "(pipeline_model_parallel_size=" +
        std::to_string(config.pipeline_model_parallel_size) + ", must be 1)");
  if (config.virtual_pipeline_model_parallel_size)
    throw ConfigError(
        "get_retro_decoder_block_spec: retro does not currently support virtual pipeline "
        "parallelism (virtual_pipeline_model_parallel_size=" +
        std::to_string(*config.virtual_pipeline_model_parallel_size) + ", must be None)");

  // Num layers.
  const std::int64_t num_layers = get_num_layers_to_build(config, vp_stage, pp_rank);

  // Retro layer numbers: every third layer from 6 (<= 15 layers) or 9.
  const std::int64_t retro_layer_start = num_layers <= 15 ? 6 : 9;
  std::vector<std::int64_t> retro_layer_numbers;
  for (std::int64_t n = retro_layer_start; n <= num_layers; n += 3) retro_layer_numbers.push_back(n);
  if (retro_layer_numbers.empty())
    // Megatron indexes retro_layer_numbers[0] here and fails with IndexError.
    throw ConfigError(
        "get_retro_decoder_block_spec: a Retro decoder block needs num_layers >= 6 (the first Retro "
        "layer is layer 6), got num_layers=" +
        std::to_string(num_layers) + " (Megatron: IndexError: list index out of range)");

  // Layer specs: the first Retro layer owns the encoder.
  std::vector<RetroLayerKind> layer_specs;
  for (std::int64_t layer_number = 1; layer_number <= num_layers; ++layer_number) {
    if (layer_number == retro_layer_numbers[0])
      layer_specs.push_back(RetroLayerKind::RetroWithEncoder);
    else if (std::find(retro_layer_numbers.begin(), retro_layer_numbers.end(), layer_number) !=
             retro_layer_numbers.end())
      layer_specs.push_back(RetroLayerKind::Retro);
    else
      layer_specs.push_back(RetroLayerKind::Gpt);
  }
  return layer_specs;
}

std::vector<RetroLayerKind> get_retro_decoder_block_layout(int num_layers) {
  TransformerConfig config;
  config.num_layers = num_layers;
  return get_retro_decoder_block_layout(config);
}

std::string format_retro_layout(const std::vector<RetroLayerKind>& layout, bool json) {
  if (json) {
    nlohmann::ordered_json j;  // keys in the table's order
    j["num_layers"] = layout.size();
    j["layers"] = nlohmann::ordered_json::array();
    for (RetroLayerKind k : layout) j["layers"].push_back(retro_layer_kind_name(k));
    return j.dump() + "\n";
  }
  std::string out;
  for (std::size_t i = 0; i < layout.size(); ++i)
    out += "layer " + std::to_string(i + 1) + ": " + retro_layer_kind_name(layout[i]) + "\n";
  return out;
}

}  // namespace twin::reference::retro
