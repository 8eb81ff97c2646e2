#include "reference/retro/encoder_spec.h"

#include "reference/retro/encoder_attention.h"
#include "reference/transformer_config.h"

namespace twin::reference::retro {

const char* spec_family_name(SpecFamily f) {
  return f == SpecFamily::TransformerEngine ? "transformer_engine" : "local";
}

NormBuilder fused_layer_norm_builder() {
  return [](const TransformerConfig& c, int hidden, double eps, Precision p) -> std::unique_ptr<Norm> {
    if (c.normalization != "LayerNorm")
      throw ConfigError("FusedLayerNorm (Retro local spec): normalization must be LayerNorm, got " + c.normalization);
    return std::make_unique<LayerNorm>(hidden, eps, c.layernorm_zero_centered_gamma, p);
  };
}

NormBuilder te_norm_builder() {
  return [](const TransformerConfig& c, int hidden, double eps, Precision p) -> std::unique_ptr<Norm> {
    if (c.normalization == "LayerNorm")
      return std::make_unique<LayerNorm>(hidden, eps, c.layernorm_zero_centered_gamma, p);
    if (c.normalization == "RMSNorm") return std::make_unique<RMSNorm>(hidden, eps, c.layernorm_zero_centered_gamma, p);
    throw ConfigError("TENorm: normalization must be LayerNorm or RMSNorm, got " + c.normalization);
  };
}

namespace {

// spec.submodules.* of get_retro_encoder_layer_{te,local}_spec on top of the GPT layer spec.
RetroLayerSpec retro_encoder_layer_spec(SpecFamily family, const NormBuilder& norm) {
  ModuleSpec spec = get_gpt_layer_local_spec();
  spec.submodules.pre_cross_attn_layernorm = norm;
  spec.submodules.cross_attention = [](const TransformerConfig& c, int layer_number,
                                       Precision p) -> std::unique_ptr<AttentionModule> {
    return std::make_unique<RetroEncoderCrossAttention>(c, layer_number, AttnMaskType::padding, p);
  };
  spec.submodules.cross_attn_bda = retro_encoder_bias_dropout_add_builder();
  spec.submodules.pre_mlp_layernorm = [norm](const TransformerConfig& c, int hidden, double eps,
                                             Precision p) -> std::unique_ptr<Norm> {
    return std::make_unique<RetroEncoderLayerNorm>(validate_retro_config(c).retro_num_neighbors,
                                                   norm(c, hidden, eps, p));
  };
  spec.submodules.mlp = mlp_builder();
  return {family, spec};
}

}  // namespace

RetroLayerSpec get_retro_encoder_layer_te_spec() {
  return retro_encoder_layer_spec(SpecFamily::TransformerEngine, te_norm_builder());
}
RetroLayerSpec get_retro_encoder_layer_local_spec() {
  return retro_encoder_layer_spec(SpecFamily::Local, fused_layer_norm_builder());
}

TransformerBlockSubmodules get_retro_encoder_block_spec(const TransformerConfig& config, bool use_transformer_engine) {
  const RetroConfig retro = validate_retro_config(config);
  // Num layers.
  const int num_layers = retro.retro_encoder_num_layers;
  const int retro_layer_number = 1;

  // Layer specs.
  ModuleSpec gpt_layer_spec = get_gpt_layer_local_spec();
  ModuleSpec retro_layer_spec =
      (use_transformer_engine ? get_retro_encoder_layer_te_spec() : get_retro_encoder_layer_local_spec()).spec;
  for (ModuleSpec* spec : {&gpt_layer_spec, &retro_layer_spec}) {
    // spec.params["hidden_dropout"] = config.retro_encoder_hidden_dropout
    const double hidden_dropout = retro.retro_encoder_hidden_dropout;
    spec->module = [hidden_dropout](const TransformerConfig& c, const TransformerLayerSubmodules& s, int layer_number,
                                    Precision p) -> std::unique_ptr<BaseTransformerLayer> {
      return std::make_unique<TransformerLayer>(c, s, layer_number, hidden_dropout, p);
    };
    // self_attention.params["attn_mask_type"] = padding; core_attention = DotProductAttention with
    // attention_dropout = config.retro_encoder_attention_dropout. (The GPT spec's self-attention
    // has no q/k layernorm: the default get_gpt_layer_*_spec().)
    const double attention_dropout = retro.retro_encoder_attention_dropout;
    spec->submodules.self_attention = [attention_dropout](const TransformerConfig& c, int layer_number,
                                                          Precision p) -> std::unique_ptr<AttentionModule> {
      auto attention =
          std::make_unique<SelfAttention>(c, SelfAttentionSubmodules{}, layer_number, AttnMaskType::padding, p);
      attention->core_attention.attention_dropout = attention_dropout;
      return attention;
    };
  }

  TransformerBlockSubmodules block_spec;
  for (int layer_number = 1; layer_number <= num_layers; ++layer_number)
    block_spec.layer_specs.push_back(layer_number == retro_layer_number ? retro_layer_spec : gpt_layer_spec);
  return block_spec;  // layer_norm None: no final layernorm
}

}  // namespace twin::reference::retro
