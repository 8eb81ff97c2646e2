// Which layers a pipeline stage owns: get_transformer_layer_offset from
// megatron/core/transformer/transformer_layer.py and get_num_layers_to_build from
// megatron/core/transformer/transformer_block.py (Megatron-LM 93ddc247), step by step.
//
// Both functions read the config as given; they do not validate it (Megatron's neither: run them
// after validate_transformer_config). Where Megatron's Python raises (an assert, an integer
// division by zero), these throw LayerOffsetError naming the Python exception. Integer division
// and modulo follow Python (floor) semantics, as Megatron's do on negative layer counts.
// pipeline_model_parallel_layout is not modelled (TransformerConfig has no such field).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "core/config.h"

namespace twin::reference {

// Megatron raises here. python_type is the exception Megatron raises: "AssertionError" or
// "ZeroDivisionError".
struct LayerOffsetError : ConfigError {
  LayerOffsetError(std::string python_type, const std::string& message);
  std::string python_type;
};

// Python's a // b and a % b (floor division); b == 0 throws LayerOffsetError("ZeroDivisionError")
// with `what` naming the divisor.
std::int64_t py_floordiv(std::int64_t a, std::int64_t b, const char* what);
std::int64_t py_mod(std::int64_t a, std::int64_t b, const char* what);

// megatron.core.pipeline_parallel.utils.is_vp_first_stage / is_vp_last_stage.
bool is_vp_first_stage(std::optional<int> vp_stage, std::optional<int> vp_size);
bool is_vp_last_stage(std::optional<int> vp_stage, std::optional<int> vp_size);

// Index of the first layer of (pp_rank, vp_stage) among all num_layers. pp_rank = nullopt means
// parallel_state's rank, which is 0 in the twins (world size 1).
std::int64_t get_transformer_layer_offset(const TransformerConfig& config, std::optional<int> vp_stage = std::nullopt,
                                          std::optional<int> pp_rank = std::nullopt);

// Number of transformer layers (pp_rank, vp_stage) builds.
std::int64_t get_num_layers_to_build(const TransformerConfig& config, std::optional<int> vp_stage = std::nullopt,
                                     std::optional<int> pp_rank = std::nullopt);

}  // namespace twin::reference
