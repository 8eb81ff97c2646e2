// What get_retro_decoder_block_spec builds, on the optimized twin: RetroConfig's checks, each
// layer kind's parameter keys and shapes, and the layers built from a state dict with every
// rank's shards (megatron/core/models/retro/config.py, decoder_spec.py, encoder_spec.py).
#include <set>

#include "optimized/layer/features.h"
#include "optimized/layer/sharding.h"
#include "optimized/retro/retro_layer_impl.h"

namespace twin::opt::retro {

void reject(bool bad, const std::string& what) {
  if (bad) throw ConfigError("optimized Retro decoder: " + what);
}

// Unset fields take RetroConfig's defaults (2 neighbours, 2 retrieved chunks, 2 encoder layers,
// encoder dropouts 0.1), as the reference's validate_retro_config.
RetroSizes retro_sizes(const TransformerConfig& c) {
  reject(!c.retro_chunk_length || *c.retro_chunk_length < 1, "retro_chunk_length must be set and >= 1");
  RetroSizes s;
  s.m = *c.retro_chunk_length;
  s.k = c.retro_num_neighbors.value_or(2);
  const int chunks = c.retro_num_retrieved_chunks.value_or(2);
  reject(s.k < 1, "retro_num_neighbors must be >= 1, got " + std::to_string(s.k));
  reject(chunks < 1, "retro_num_retrieved_chunks must be >= 1, got " + std::to_string(chunks));
  s.r = std::int64_t(chunks) * s.m;
  reject(c.retro_retrieved_length && *c.retro_retrieved_length != s.r,
         "retro_retrieved_length " + std::to_string(*c.retro_retrieved_length) +
             " != retro_num_retrieved_chunks * retro_chunk_length = " + std::to_string(s.r));
  s.encoder_layers = c.retro_encoder_num_layers.value_or(2);
  reject(s.encoder_layers < 1, "retro_encoder_num_layers must be >= 1");
  s.encoder_hidden_dropout = c.retro_encoder_hidden_dropout.value_or(0.1);
  s.encoder_attention_dropout = c.retro_encoder_attention_dropout.value_or(0.1);
  return s;
}

// What Megatron-Core runs but this twin does not implement ("" when nothing): reported as
// unsupported (retro_decoder_unsupported), not as bad input.
std::string retro_decoder_unsupported(const TransformerConfig& c) { return layer_unsupported(LayerKind::Retro, c); }

void validate(const TransformerConfig& c) {
  reject(c.normalization != "LayerNorm",
         "normalization '" + c.normalization + "': the local Retro spec's FusedLayerNorm supports LayerNorm only");
  if (const std::string why = retro_decoder_unsupported(c); !why.empty()) reject(true, "unsupported: " + why);
  check_tensor_parallel_sizes("optimized Retro decoder", c, c.tensor_model_parallel_size, "tensor_model_parallel_size");
  retro_sizes(c);
}

Cross cross_of(RetroLayerKind k) { return k == RetroLayerKind::Gpt ? Cross::None : Cross::Decoder; }

std::vector<std::string> layer_keys(const TransformerConfig& c, Cross cross) {
  const bool bias = c.add_bias_linear;
  std::vector<std::string> k = {"input_layernorm.weight", "input_layernorm.bias", "self_attention.linear_qkv.weight"};
  if (bias || c.add_qkv_bias) k.push_back("self_attention.linear_qkv.bias");
  k.push_back("self_attention.linear_proj.weight");
  if (bias) k.push_back("self_attention.linear_proj.bias");
  if (cross != Cross::None) {
    k.insert(k.end(), {"pre_cross_attn_layernorm.weight", "pre_cross_attn_layernorm.bias"});
    for (const char* lin : {"linear_q", "linear_kv", "linear_proj"}) {
      k.push_back(std::string("cross_attention.attn.") + lin + ".weight");
      if (bias) k.push_back(std::string("cross_attention.attn.") + lin + ".bias");
    }
  }
  const std::string ln2 = cross == Cross::Encoder ? "pre_mlp_layernorm.norm." : "pre_mlp_layernorm.";
  k.insert(k.end(), {ln2 + "weight", ln2 + "bias", "mlp.linear_fc1.weight"});
  if (bias) k.push_back("mlp.linear_fc1.bias");
  k.push_back("mlp.linear_fc2.weight");
  if (bias) k.push_back("mlp.linear_fc2.bias");
  return k;
}

namespace {

// Every parameter's shape by its layer-relative key (the union over the kinds).
std::map<std::string, Shape> param_shapes(const TransformerConfig& c) {
  const std::int64_t h = c.hidden_size, np = c.num_attention_heads, ng = c.query_groups(), hn = c.head_dim();
  const std::int64_t qkv = (np + 2 * ng) * hn, fc1 = (c.gated_linear_unit ? 2 : 1) * std::int64_t(c.ffn());
  return {{"input_layernorm.weight", {h}},
          {"input_layernorm.bias", {h}},
          {"self_attention.linear_qkv.weight", {qkv, h}},
          {"self_attention.linear_qkv.bias", {qkv}},
          {"self_attention.linear_proj.weight", {h, np * hn}},
          {"self_attention.linear_proj.bias", {h}},
          {"pre_cross_attn_layernorm.weight", {h}},
          {"pre_cross_attn_layernorm.bias", {h}},
          {"cross_attention.attn.linear_q.weight", {np * hn, h}},
          {"cross_attention.attn.linear_q.bias", {np * hn}},
          {"cross_attention.attn.linear_kv.weight", {2 * np * hn, h}},
          {"cross_attention.attn.linear_kv.bias", {2 * np * hn}},
          {"cross_attention.attn.linear_proj.weight", {h, np * hn}},
          {"cross_attention.attn.linear_proj.bias", {h}},
          {"pre_mlp_layernorm.weight", {h}},
          {"pre_mlp_layernorm.bias", {h}},
          {"pre_mlp_layernorm.norm.weight", {h}},
          {"pre_mlp_layernorm.norm.bias", {h}},
          {"mlp.linear_fc1.weight", {fc1, h}},
          {"mlp.linear_fc1.bias", {fc1}},
          {"mlp.linear_fc2.weight", {h, c.ffn()}},
          {"mlp.linear_fc2.bias", {h}}};
}

std::unique_ptr<Block> build_encoder(const TransformerConfig& c, const std::map<std::string, Tensor>& params,
                                     const std::string& prefix, const RankContext& ex, std::set<std::string>& used) {
  auto block = std::make_unique<Block>();
  const RetroSizes rs = retro_sizes(c);
  for (int i = 0; i < rs.encoder_layers; ++i)
    block->layers.push_back(build_layer(c, params, prefix + "layers." + std::to_string(i) + ".",
                                        i == 0 ? Cross::Encoder : Cross::None, true, false, i + 1, ex, used));
  return block;
}

}  // namespace

std::unique_ptr<Layer> build_layer(const TransformerConfig& c, const std::map<std::string, Tensor>& params,
                                   const std::string& prefix, Cross cross, bool encoder_layer, bool owns_encoder,
                                   int layer_number, const RankContext& ex, std::set<std::string>& used) {
  auto L = std::make_unique<Layer>();
  L->c = c;
  L->rs = retro_sizes(c);
  L->cross = cross;
  L->encoder_layer = encoder_layer;
  L->layer_number = layer_number;
  L->h = c.hidden_size;
  L->np = c.num_attention_heads;
  L->ng = c.query_groups();
  L->hn = c.head_dim();
  L->ffn = c.ffn();
  if (cross != Cross::None)
    reject(L->ng != L->np, "Group query attention is not currently supported in cross attention (num_query_groups " +
                               std::to_string(L->ng) + " != num_attention_heads " + std::to_string(L->np) + ")");
  L->scaling = attention_scaling(c, layer_number);
  L->hidden_dropout = encoder_layer ? L->rs.encoder_hidden_dropout : c.hidden_dropout;
  L->self_attention_dropout = encoder_layer ? L->rs.encoder_attention_dropout : c.attention_dropout;
  L->cross_attention_dropout = c.attention_dropout;
  const DType dt = params_dtype(c);
  const auto shapes = param_shapes(c);
  for (const auto& key : layer_keys(c, cross)) {
    auto it = params.find(prefix + key);
    if (it == params.end()) throw ShapeError("optimized Retro decoder: missing parameter '" + prefix + key + "'");
    it->second.expect(shapes.at(key), dt, "optimized Retro decoder: parameter '" + prefix + key + "'");
    used.insert(prefix + key);
    L->host[key] = it->second;
  }
  // Each rank's shards, as Megatron's tensor-parallel layers hold them.
  const int tp = c.tensor_model_parallel_size;
  L->dev.resize(static_cast<std::size_t>(tp));
  for (int r = 0; r < tp; ++r)
    for (const auto& [key, t] : L->host) L->dev[r][key] = ex.upload(tensor_parallel_shard(c, key, t, r, tp));
  if (owns_encoder) L->encoder = build_encoder(c, params, prefix + "cross_attention.encoder.", ex, used);
  return L;
}

void check_all_used(const std::map<std::string, Tensor>& params, const std::set<std::string>& used) {
  for (const auto& [key, t] : params)
    if (!used.count(key)) throw ShapeError("optimized Retro decoder: parameter '" + key + "' is not one it owns");
}

std::vector<std::string> retro_layer_param_keys(const TransformerConfig& c, RetroLayerKind kind) {
  std::vector<std::string> keys = layer_keys(c, cross_of(kind));
  if (kind == RetroLayerKind::RetroWithEncoder) {
    const RetroSizes rs = retro_sizes(c);
    for (int i = 0; i < rs.encoder_layers; ++i)
      for (const auto& k : layer_keys(c, i == 0 ? Cross::Encoder : Cross::None))
        keys.push_back("cross_attention.encoder.layers." + std::to_string(i) + "." + k);
  }
  return keys;
}

std::vector<std::pair<std::string, Shape>> retro_layer_param_shapes(const TransformerConfig& c, RetroLayerKind kind) {
  const auto shapes = param_shapes(c);
  std::vector<std::pair<std::string, Shape>> out;
  const std::string enc = "cross_attention.encoder.layers.";
  for (const auto& key : retro_layer_param_keys(c, kind)) {
    std::string rel = key;
    if (key.rfind(enc, 0) == 0) rel = key.substr(key.find('.', enc.size()) + 1);  // past "layers.N."
    out.emplace_back(key, shapes.at(rel));
  }
  return out;
}

}  // namespace twin::opt::retro
