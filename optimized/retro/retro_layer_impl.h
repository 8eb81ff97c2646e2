// The optimized Retro decoder's host side (private to optimized/retro/), compiled once: the
// layers and block of retro_layer.h as ops launched one at a time on a rank (layer/rank_context.h)
// through the backend's launchers (layer/kernels.h). Megatron's modules by file:
//   retro_layer.cpp        the layer (self attention, cross attention's slot, MLP) and the block
//   decoder_attention.cpp  RetroDecoderCrossAttention + RetroDecoderBiasDropoutAdd
//   encoder_attention.cpp  RetroEncoderCrossAttention + RetroEncoderBiasDropoutAdd
//   decoder_spec.cpp       RetroConfig's checks, each kind's parameters, the built layers
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "optimized/layer/attention_half.h"  // AttentionScaling
#include "optimized/layer/rank_context.h"
#include "optimized/retro/retro_layer.h"

namespace twin::opt::retro {

// ConfigError("optimized Retro decoder: " + what) when `bad`.
void reject(bool bad, const std::string& what);

// The Retro sizes of the config (RetroConfig.__post_init__'s checks).
struct RetroSizes {
  std::int64_t m = 0, k = 0, r = 0;
  int encoder_layers = 0;
  double encoder_hidden_dropout = 0.0, encoder_attention_dropout = 0.0;
};
RetroSizes retro_sizes(const TransformerConfig& c);
// ConfigError for a config the decoder cannot run (bad input or unsupported), before anything runs.
void validate(const TransformerConfig& c);

// A layer's cross attention: none (GPT layer), the decoder's, or the retriever encoder's.
enum class Cross { None, Decoder, Encoder };
Cross cross_of(RetroLayerKind k);

struct Layer;
struct Block {
  std::vector<std::unique_ptr<Layer>> layers;
  // Runs the layers in order, layer i at block_layer_offset(offset, i); taps "<prefix>layers.i.0" / ".1".
  std::pair<DTensor, std::optional<DTensor>> forward(const RankContext& ex, DTensor x, std::optional<DTensor> context,
                                                     const DTensor* mask, std::uint64_t offset,
                                                     const std::string& prefix) const;
};

// One layer's numbers and weights.
struct Layer {
  TransformerConfig c;
  RetroSizes rs;
  Cross cross = Cross::None;
  bool encoder_layer = false;  // in the retriever encoder: padding self-attention, the encoder's dropouts
  int layer_number = 1;
  int h = 0, np = 0, ng = 0, hn = 0, ffn = 0;
  AttentionScaling scaling;
  double hidden_dropout = 0.0, self_attention_dropout = 0.0, cross_attention_dropout = 0.0;
  std::map<std::string, Tensor> host;               // this layer's params by key (relative)
  std::vector<std::map<std::string, DTensor>> dev;  // per tensor-parallel rank: its shards
  std::unique_ptr<Block> encoder;                   // Cross::Decoder of the first Retro layer

  // x [s, b, h] -> (output [s, b, h], the context handed on); taps under `pre`.
  std::pair<DTensor, std::optional<DTensor>> forward(const RankContext& ex, const DTensor& x,
                                                     std::optional<DTensor> context, const DTensor* mask,
                                                     std::uint64_t offset, const std::string& pre) const;

  // ---- the ops of a layer on one rank (retro_layer.cpp) ----
  const void* w(const RankContext& ex, const std::string& key) const;
  const Tensor* host_param(const std::string& key) const;
  int np_l(const RankContext& ex) const { return np / ex.tp; }
  DTensor norm(const RankContext& ex, const DTensor& x, const std::string& key) const;
  DTensor linear(const RankContext& ex, const DTensor& x, const std::string& key, bool bias_in_epilogue,
                 std::int64_t out_features) const;
  DTensor row_parallel_linear(const RankContext& ex, const DTensor& x, const std::string& key) const;
  AttnParams attn_params(const RankContext& ex, int sq, int sk, int b, double dropout, std::uint64_t drop_offset) const;
  DropoutArgs hidden_dropout_args(const RankContext& ex, std::uint64_t drop_offset) const;
  void proj_taps(const RankContext& ex, const DTensor& y, const std::string& pre, const std::string& module,
                 const std::string& linear) const;

 private:
  DTensor self_attention(const RankContext& ex, const DTensor& x, const DTensor* mask, std::uint64_t offset,
                         const std::string& pre) const;
  DTensor mlp(const RankContext& ex, const DTensor& h2, std::uint64_t offset, const std::string& pre) const;
  // decoder_attention.cpp
  DTensor decoder_cross_attention(const RankContext& ex, const DTensor& ln, const DTensor& residual,
                                  std::optional<DTensor>& context, const DTensor* mask, std::uint64_t offset,
                                  const std::string& pre) const;
  // encoder_attention.cpp
  DTensor encoder_cross_attention(const RankContext& ex, const DTensor& ln, const DTensor& chunked,
                                  std::uint64_t offset, const std::string& pre) const;
};

// ---- decoder_spec.cpp ----
// The layer's parameter keys of a layer with `cross` (relative to the layer).
std::vector<std::string> layer_keys(const TransformerConfig& c, Cross cross);
// One layer built from params under `prefix` with each rank's shards on `ex`'s device; `used`
// collects the keys it took.
std::unique_ptr<Layer> build_layer(const TransformerConfig& c, const std::map<std::string, Tensor>& params,
                                   const std::string& prefix, Cross cross, bool encoder_layer, bool owns_encoder,
                                   int layer_number, const RankContext& ex, std::set<std::string>& used);
// ShapeError for a parameter no built layer took.
void check_all_used(const std::map<std::string, Tensor>& params, const std::set<std::string>& used);

}  // namespace twin::opt::retro
