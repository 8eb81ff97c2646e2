// Mirrors get_transformer_layer_offset (transformer_layer.py) and get_num_layers_to_build
// (transformer_block.py) at Megatron-LM 93ddc247, branch by branch, under the same names.
#include "reference/transformer_layer_offset.h"

#include <utility>

namespace twin::reference {

namespace {

std::string opt_str(std::optional<int> v) { return v ? std::to_string(*v) : "None"; }

[[noreturn]] void raise_assertion(const std::string& message) { throw LayerOffsetError("AssertionError", message); }

}  // namespace

LayerOffsetError::LayerOffsetError(std::string type, const std::string& message)
    : ConfigError(type + ": " + message), python_type(std::move(type)) {}

std::int64_t py_floordiv(std::int64_t a, std::int64_t b, const char* what) {
  if (b == 0) throw LayerOffsetError("ZeroDivisionError", std::string("integer division by zero (") + what + " is 0)");
  std::int64_t q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) --q;  // C++ truncates, Python floors
  return q;
}

std::int64_t py_mod(std::int64_t a, std::int64_t b, const char* what) { return a - b * py_floordiv(a, b, what); }

bool is_vp_first_stage(std::optional<int> vp_stage, std::optional<int> vp_size) {
  if (!vp_size || *vp_size <= 1) {
    if (vp_stage && *vp_stage != 0)
      raise_assertion("Expected vp_stage to be 0 or None when vp_size is <= 1 or None, but got vp_stage=" +
                      opt_str(vp_stage) + " and vp_size=" + opt_str(vp_size));
    return true;
  }
  return vp_stage == 0;
}

bool is_vp_last_stage(std::optional<int> vp_stage, std::optional<int> vp_size) {
  if (!vp_size || *vp_size <= 1) {
    if (vp_stage && *vp_stage != 0)
      raise_assertion("Expected vp_stage to be 0 or None when vp_size is <= 1 or None, but got vp_stage=" +
                      opt_str(vp_stage) + " and vp_size=" + opt_str(vp_size));
    return true;
  }
  return vp_stage == *vp_size - 1;
}

std::int64_t get_transformer_layer_offset(const TransformerConfig& config, std::optional<int> vp_stage,
                                          std::optional<int> pp_rank_opt) {
  // pp_rank None -> parallel_state.get_pipeline_model_parallel_rank(): 0 at world size 1.
  const std::int64_t pp_rank = pp_rank_opt.value_or(0);
  const bool is_first_pp_stage = pp_rank == 0;
  const std::optional<int> first = config.num_layers_in_first_pipeline_stage;
  const std::optional<int> last = config.num_layers_in_last_pipeline_stage;

  std::int64_t offset = 0;
  if (config.pipeline_model_parallel_size > 1) {
    if (first || last) {
      // Pipeline stages left for the remaining layers after the first / last stages.
      std::int64_t middle_pipeline_stages = config.pipeline_model_parallel_size;
      middle_pipeline_stages -= (first ? 1 : 0) + (last ? 1 : 0);

      // Unset first / last counts are 0: all layers are then middle layers.
      const std::int64_t num_layers_in_first_pipeline_stage = first.value_or(0);
      const std::int64_t num_layers_in_last_pipeline_stage = last.value_or(0);

      const std::int64_t middle_num_layers =
          config.num_layers - num_layers_in_first_pipeline_stage - num_layers_in_last_pipeline_stage;

      const std::int64_t middle_pipeline_rank = !first ? pp_rank : pp_rank - 1;

      if (const std::optional<int> vp_size = config.virtual_pipeline_model_parallel_size) {
        if (!vp_stage) raise_assertion("vp_stage must be provided if virtual pipeline model parallel size is set");

        // Layers in each virtual model chunk of the first / middle / last stages.
        const std::int64_t num_layers_per_virtual_model_chunk_in_first_pipeline_stage =
            !first ? 0 : py_floordiv(*first, *vp_size, "virtual_pipeline_model_parallel_size");
        const std::int64_t num_layers_per_virtual_model_chunk_in_last_pipeline_stage =
            !last ? 0 : py_floordiv(*last, *vp_size, "virtual_pipeline_model_parallel_size");
        const std::int64_t num_layers_per_virtual_model_chunk_in_middle_pipeline_stage =
            py_floordiv(middle_num_layers, *vp_size, "virtual_pipeline_model_parallel_size");

        // First stage + middle stage + last stage.
        const std::int64_t total_virtual_chunks = num_layers_per_virtual_model_chunk_in_first_pipeline_stage +
                                                  num_layers_per_virtual_model_chunk_in_middle_pipeline_stage +
                                                  num_layers_per_virtual_model_chunk_in_last_pipeline_stage;

        if (pp_rank == 0) {
          offset = *vp_stage * total_virtual_chunks;
        } else {
          // Megatron divides by middle_pipeline_stages even when there are none (pp = 2 with both
          // first and last set): ZeroDivisionError, reproduced.
          offset = *vp_stage * total_virtual_chunks + num_layers_per_virtual_model_chunk_in_first_pipeline_stage +
                   middle_pipeline_rank * py_floordiv(num_layers_per_virtual_model_chunk_in_middle_pipeline_stage,
                                                      middle_pipeline_stages, "middle_pipeline_stages");
        }
      } else {
        std::int64_t num_layers_per_pipeline_rank = 0;
        if (middle_pipeline_stages > 0)
          num_layers_per_pipeline_rank =
              py_floordiv(middle_num_layers, middle_pipeline_stages, "middle_pipeline_stages");

        if (pp_rank == 0)
          offset = 0;
        else
          offset = middle_pipeline_rank * num_layers_per_pipeline_rank + num_layers_in_first_pipeline_stage;
      }
    } else {
      std::int64_t num_layers = config.num_layers;

      // One more "layer" each for the embedding / loss when they take part in the split.
      if (config.account_for_embedding_in_pipeline_split) num_layers += 1;
      if (config.account_for_loss_in_pipeline_split) num_layers += 1;

      const std::int64_t num_layers_per_pipeline_rank =
          py_floordiv(num_layers, config.pipeline_model_parallel_size, "pipeline_model_parallel_size");

      const std::optional<int> vp_size = config.virtual_pipeline_model_parallel_size;
      if (vp_size) {
        if (!vp_stage) raise_assertion("vp_stage must be provided if virtual pipeline model parallel size is set");

        const std::int64_t num_layers_per_virtual_rank =
            py_floordiv(num_layers_per_pipeline_rank, *vp_size, "virtual_pipeline_model_parallel_size");
        const std::int64_t total_virtual_chunks =
            py_floordiv(num_layers, *vp_size, "virtual_pipeline_model_parallel_size");
        offset = *vp_stage * total_virtual_chunks + pp_rank * num_layers_per_virtual_rank;
      } else {
        offset = pp_rank * num_layers_per_pipeline_rank;
      }

      // The embedding occupies the first slot of the first stage: later stages shift down by one.
      // (Python's `and` short-circuits: is_vp_first_stage runs only when the flag is set.)
      if (config.account_for_embedding_in_pipeline_split &&
          !(is_vp_first_stage(vp_stage, vp_size) && is_first_pp_stage))
        offset -= 1;
    }
  } else {
    offset = 0;
  }
  return offset;
}

std::int64_t get_num_layers_to_build(const TransformerConfig& config, std::optional<int> vp_stage,
                                     std::optional<int> pp_rank_opt) {
  // pp_rank None -> parallel_state's rank: 0 at world size 1.
  const std::int64_t pp_rank = pp_rank_opt.value_or(0);
  const bool is_first_pp_stage = pp_rank == 0;
  const bool is_last_pp_stage = pp_rank == config.pipeline_model_parallel_size - 1;
  const std::optional<int> first = config.num_layers_in_first_pipeline_stage;
  const std::optional<int> last = config.num_layers_in_last_pipeline_stage;

  std::int64_t num_layers_per_pipeline_rank = 0;
  if (first || last) {
    if (config.account_for_embedding_in_pipeline_split || config.account_for_loss_in_pipeline_split)
      raise_assertion("Does not support standalone embedding stage and standalone loss stage with uneven pp");
    // Layers and stages left after the uneven first / last stages.
    std::int64_t layers_to_distribute = config.num_layers;
    std::int64_t pipeline_stages_left = config.pipeline_model_parallel_size;

    if (first) {
      layers_to_distribute -= *first;
      pipeline_stages_left -= 1;
    }
    if (last) {
      layers_to_distribute -= *last;
      pipeline_stages_left -= 1;
    }

    // pp <= 2: no middle stages, nothing to check.
    if (pipeline_stages_left > 0) {
      if (py_mod(layers_to_distribute, pipeline_stages_left, "pipeline_stages_left") != 0)
        raise_assertion("With uneven pipelineing the left over layers must be divisible by left over stages");
      num_layers_per_pipeline_rank = py_floordiv(layers_to_distribute, pipeline_stages_left, "pipeline_stages_left");
    } else {
      num_layers_per_pipeline_rank = 0;
    }

    // The uneven first (last) stage builds its given count, over all its virtual stages.
    if (is_first_pp_stage && first) num_layers_per_pipeline_rank = *first;
    if (is_last_pp_stage && last) num_layers_per_pipeline_rank = *last;
  } else {
    // The embedding and loss layers take part in the split.
    std::int64_t num_layers = config.num_layers;
    if (config.account_for_embedding_in_pipeline_split) num_layers += 1;
    if (config.account_for_loss_in_pipeline_split) num_layers += 1;

    if (py_mod(num_layers, config.pipeline_model_parallel_size, "pipeline_model_parallel_size") != 0)
      raise_assertion("num_layers should be divisible by pipeline_model_parallel_size");
    num_layers_per_pipeline_rank =
        py_floordiv(num_layers, config.pipeline_model_parallel_size, "pipeline_model_parallel_size");
  }

  std::int64_t num_layers_to_build = 0;
  const std::optional<int> vp_size = config.virtual_pipeline_model_parallel_size;
  if (vp_size && config.pipeline_model_parallel_size > 1) {
    // Interleaved pipeline: each stage's layers split evenly over its model chunks.
    if (py_mod(num_layers_per_pipeline_rank, *vp_size, "virtual_pipeline_model_parallel_size") != 0)
      raise_assertion("num_layers_per_pipeline_rank " + std::to_string(num_layers_per_pipeline_rank) +
                      " should be divisible by vp_size " + std::to_string(*vp_size));
    const std::int64_t num_layers_per_virtual_stage =
        py_floordiv(num_layers_per_pipeline_rank, *vp_size, "virtual_pipeline_model_parallel_size");
    num_layers_to_build = num_layers_per_virtual_stage;
  } else {
    // Non-interleaved: each stage gets a contiguous set of layers.
    num_layers_to_build = num_layers_per_pipeline_rank;
  }

  // The embedding (loss) slot is not a transformer layer: one fewer on the first (last) stage.
  if (config.account_for_embedding_in_pipeline_split) {
    if (is_vp_first_stage(vp_stage, vp_size) && is_first_pp_stage) {
      num_layers_to_build -= 1;
      if (num_layers_to_build < 0) raise_assertion("Not enough layers in the first virtual pipeline stage");
    }
  }
  if (config.account_for_loss_in_pipeline_split) {
    if (is_vp_last_stage(vp_stage, vp_size) && is_last_pp_stage) {
      num_layers_to_build -= 1;
      if (num_layers_to_build < 0) raise_assertion("Not enough layers in the last virtual pipeline stage");
    }
  }
  return num_layers_to_build;
}

}  // namespace twin::reference
