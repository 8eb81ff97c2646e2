#include "reference/retro/decoder_layer_spec.h"

#include "reference/retro/decoder_attention.h"
#include "reference/retro/decoder_spec.h"
#include "reference/transformer_config.h"

namespace twin::reference::retro {

namespace {

RetroLayerSpec retro_decoder_layer_spec(SpecFamily family, const NormBuilder& norm,
                                        std::optional<TransformerBlockSubmodules> encoder_block_spec) {
  ModuleSpec spec = get_gpt_layer_local_spec();
  spec.submodules.pre_cross_attn_layernorm = norm;
  spec.submodules.cross_attention = [encoder_block_spec](const TransformerConfig& c, int layer_number,
                                                         Precision p) -> std::unique_ptr<AttentionModule> {
    std::unique_ptr<TransformerBlock> encoder;
    if (encoder_block_spec)
      encoder = std::make_unique<TransformerBlock>(c, *encoder_block_spec, p, /*post_layer_norm=*/true,
                                                   /*pre_process=*/true, /*post_process=*/false);
    return std::make_unique<RetroDecoderCrossAttention>(c, layer_number, AttnMaskType::padding, p, std::move(encoder));
  };
  spec.submodules.cross_attn_bda = retro_decoder_bias_dropout_add_builder();
  return {family, spec};
}

}  // namespace

RetroLayerSpec get_retro_decoder_layer_te_spec(std::optional<TransformerBlockSubmodules> encoder_block_spec) {
  return retro_decoder_layer_spec(SpecFamily::TransformerEngine, te_norm_builder(), std::move(encoder_block_spec));
}
RetroLayerSpec get_retro_decoder_layer_local_spec(std::optional<TransformerBlockSubmodules> encoder_block_spec) {
  return retro_decoder_layer_spec(SpecFamily::Local, fused_layer_norm_builder(), std::move(encoder_block_spec));
}

TransformerBlockSubmodules get_retro_decoder_block_spec(const TransformerConfig& config, bool use_transformer_engine) {
  // Layout: asserts no pipeline / virtual pipeline parallelism; Retro layers every third layer
  // from 6 (<= 15 layers) or 9.
  const std::vector<RetroLayerKind> layout = get_retro_decoder_block_layout(config);
  validate_retro_config(config);

  const ModuleSpec gpt_layer_spec = get_gpt_layer_local_spec();
  auto get_retro_decoder_layer_spec =
      use_transformer_engine ? get_retro_decoder_layer_te_spec : get_retro_decoder_layer_local_spec;
  const ModuleSpec retro_layer_spec = get_retro_decoder_layer_spec(std::nullopt).spec;
  const ModuleSpec retro_layer_spec_with_retriever =
      get_retro_decoder_layer_spec(get_retro_encoder_block_spec(config, use_transformer_engine)).spec;

  TransformerBlockSubmodules block_spec;
  for (RetroLayerKind kind : layout) {
    switch (kind) {
      case RetroLayerKind::RetroWithEncoder:
        block_spec.layer_specs.push_back(retro_layer_spec_with_retriever);
        break;
      case RetroLayerKind::Retro:
        block_spec.layer_specs.push_back(retro_layer_spec);
        break;
      case RetroLayerKind::Gpt:
        block_spec.layer_specs.push_back(gpt_layer_spec);
        break;
    }
  }
  return block_spec;  // layer_norm None: no final layernorm
}

}  // namespace twin::reference::retro
