// The optimized Retro decoder's host side (private to optimized/retro/), compiled once: the
// layers and block of retro_layer.h as ops launched one at a time on a rank (layer/rank_context.h)
// through the backend's launchers (layer/kernels.h). Megatron's modules by file:
//   retro_layer.cpp        the layer (self attention, cross attention's slot, MLP) and the block
//   decoder_attention.cpp  RetroDecoderCrossAttention + RetroDecoderBiasDropoutAdd
//   encoder_attention.cpp  RetroEncoderCrossAttention + RetroEncoderBiasDropoutAdd
//   decoder_spec.cpp       RetroConfig's checks, each kind's parameters, the built layers
#pragma once

#include <cstdint>
#include <functional>
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

// ---- what a backward reads -----------------------------------------------------------------

struct BlockActs;
// Every activation a layer's backward reads, saved by its forward on one rank (llm.c's table);
// a step the layer does not have leaves its entries null. [s, b] are the layer's rows (the
// decoder's [ns, bs], an encoder layer's [r, k*bs*l]); D = this rank's heads * hn.
struct LayerActs {
  // input_layernorm, self_attention
  DTensor x, ln1, qkv, core, stats;  // [s, b, h] x2, [s, b, qkv width], [s, b, D], fp32 softmax stats
  std::optional<DTensor> mask;       // an encoder layer's context_mask
  // pre_cross_attn_layernorm, cross_attention: query_in attends to kv_in (decoder: the padded
  // attending chunks [m, N, h] and the neighbours [r*k, N, h]; encoder: the neighbours' normed
  // states [r, N*k, h] and the decoder chunks [m, N, h]); q, kv the linears' outputs, cross_core
  // the core attention's (encoder: the k neighbours' one after another), cross_stats its stats
  // (encoder: one per neighbour).
  DTensor h1, lnc;
  DTensor query_in, kv_in, q, kv, cross_core;
  std::vector<DTensor> cross_stats;
  std::unique_ptr<BlockActs> encoder;  // the first Retro layer's retriever encoder
  // pre_mlp_layernorm, mlp
  DTensor h2, ln2, fc1, act;  // [s, b, h] x2, [s, b, fc1 width] (before its bias), [s, b, ffn / tp]
};
struct BlockActs {
  std::vector<LayerActs> layers;
};

// One rank's parameter gradients while its backward runs: this rank's shard of each under the
// full key, its layer-relative key (the sharding rule's), and its magnitude (with_magnitudes).
struct RankParamGrads {
  bool with_magnitudes = false;
  struct Entry {
    std::string relative;
    DTensor value;
    double magnitude = -1.0;
  };
  std::map<std::string, Entry> grads;
  // The gradient of parameter `key` (relative) under prefix `pre`: stored, or, for a parameter
  // used again (the retriever encoder's attention, once per neighbour), summed into the one there
  // (autograd accumulates .grad, stored in dt) with the magnitudes added. `magnitude` is only
  // called with_magnitudes.
  void add(const RankContext& ex, const std::string& pre, const std::string& key, const DTensor& g,
           const std::function<double()>& magnitude);
};

struct Layer;
struct Block {
  std::vector<std::unique_ptr<Layer>> layers;
  // Runs the layers in order, layer i at block_layer_offset(offset, i); taps "<prefix>layers.i.0" / ".1".
  // acts: null, or filled with every layer's activations for backward.
  std::pair<DTensor, std::optional<DTensor>> forward(const RankContext& ex, DTensor x, std::optional<DTensor> context,
                                                     const DTensor* mask, std::uint64_t offset,
                                                     const std::string& prefix, BlockActs* acts = nullptr) const;
  // The layers' backward in reverse from d of the block's output and of the context it handed on
  // (nullopt: none): (d x, d of the context it was given, nullopt when it was given none).
  std::pair<DTensor, std::optional<DTensor>> backward(const RankContext& ex, const BlockActs& acts, DTensor d_out,
                                                      std::optional<DTensor> d_context, std::uint64_t offset,
                                                      const std::string& prefix, RankParamGrads& grads) const;
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

  // x [s, b, h] -> (output [s, b, h], the context handed on); taps under `pre`; acts: null, or
  // filled for backward.
  std::pair<DTensor, std::optional<DTensor>> forward(const RankContext& ex, const DTensor& x,
                                                     std::optional<DTensor> context, const DTensor* mask,
                                                     std::uint64_t offset, const std::string& pre,
                                                     LayerActs* acts = nullptr) const;
  // Megatron's backward of that forward (mlp_bda .. input_layernorm in reverse): d out [s, b, h]
  // and d of the context handed on (nullopt: none) -> (d x, d of the context given, nullopt when
  // none was given or none reaches it); parameter gradients into `grads` under `pre`.
  std::pair<DTensor, std::optional<DTensor>> backward(const RankContext& ex, const LayerActs& a, const DTensor& d_out,
                                                      std::optional<DTensor> d_context, std::uint64_t offset,
                                                      const std::string& pre, RankParamGrads& grads) const;

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
  // The self attention's core attention: causal (the GPT spec's decoder), or an encoder layer's
  // padding mask (context_mask when given, else none).
  AttnParams self_attn_params(const RankContext& ex, int s, int b, const DTensor* mask, std::uint64_t offset) const;
  // A parameter's gradient buffer on this rank (its shard's shape), or null when the layer has no such parameter.
  std::optional<DTensor> grad_buffer(const RankContext& ex, const std::string& key) const;
  void proj_taps(const RankContext& ex, const DTensor& y, const std::string& pre, const std::string& module,
                 const std::string& linear) const;

 private:
  DTensor self_attention(const RankContext& ex, const DTensor& x, const DTensor* mask, std::uint64_t offset,
                         const std::string& pre, LayerActs* a) const;
  DTensor mlp(const RankContext& ex, const DTensor& h2, std::uint64_t offset, const std::string& pre,
              LayerActs* a) const;
  // retro_layer_backward.cpp: the halves' backward (the dense layer's kernels), d in -> d out.
  DTensor self_attention_backward(const RankContext& ex, const LayerActs& a, const DTensor& dh1, std::uint64_t offset,
                                  const std::string& pre, RankParamGrads& g) const;
  DTensor mlp_backward(const RankContext& ex, const LayerActs& a, const DTensor& d_out, std::uint64_t offset,
                       const std::string& pre, RankParamGrads& g) const;
  // pre_cross_attn_layernorm's backward: d h1 from d of its output (plus d residual when not null).
  DTensor pre_cross_attn_layernorm_backward(const RankContext& ex, const LayerActs& a, const DTensor& d_lnc,
                                            const DTensor* d_residual, const std::string& pre, RankParamGrads& g) const;
  // One CrossAttention call's backward (linear_proj, core_attention, linear_kv, linear_q) from
  // d_proj, the gradient of linear_proj's output with its bias [sq*N, h] (dropout's backward
  // done): (d query_in [sq*N, h], d kv_in [sk*N, h]). The operands: query_in [sq*N, h], q
  // [sq*N, D], kv_in [sk*N, h], kv [sk*N, 2D], core [sq*N, D], stats and the dropout offset as
  // the forward's call had them.
  struct CrossCall {
    DTensor query_in, q, kv_in, kv, core, stats;
    int sq = 0, sk = 0, N = 0;
    std::uint64_t drop_offset = 0;
  };
  std::pair<DTensor, DTensor> cross_attn_backward(const RankContext& ex, const CrossCall& call, const DTensor& d_proj,
                                                  const std::string& pre, RankParamGrads& g) const;
  // decoder_attention.cpp
  DTensor decoder_cross_attention(const RankContext& ex, const DTensor& ln, const DTensor& residual,
                                  std::optional<DTensor>& context, const DTensor* mask, std::uint64_t offset,
                                  const std::string& pre, LayerActs* a) const;
  // d cross_attn_bda output [ns, bs, h], d of the context handed on -> (d lnc, d context given).
  std::pair<DTensor, DTensor> decoder_cross_attention_backward(const RankContext& ex, const LayerActs& a,
                                                               const DTensor& d_h2, std::optional<DTensor> d_context,
                                                               std::uint64_t offset, const std::string& pre,
                                                               RankParamGrads& g) const;
  // encoder_attention.cpp
  DTensor encoder_cross_attention(const RankContext& ex, const DTensor& ln, const DTensor& chunked,
                                  std::uint64_t offset, const std::string& pre, LayerActs* a) const;
  // d cross_attn_bda output [r, k*N, h] -> (d lnc, d chunked).
  std::pair<DTensor, DTensor> encoder_cross_attention_backward(const RankContext& ex, const LayerActs& a,
                                                               const DTensor& d_h2, std::uint64_t offset,
                                                               const std::string& pre, RankParamGrads& g) const;
};

// What a backward needs of the last forward besides the activations: its dropout arguments and
// the shapes of its output and of the context it was given and handed on.
struct SavedForward {
  bool kept = false;  // the last forward ran with keep_for_backward (and succeeded)
  GroupRun run;
  Shape output;
  std::optional<Shape> context_in, context_out;
};

// The fp32 softmax statistics [b, np_local, sq, 2] a core attention's forward writes for its
// backward: allocated, and set in ap.
DTensor save_softmax_stats(const RankContext& ex, AttnParams& ap);
// The core attention output's error magnitudes [sq, b, heads] (core/attention_bound.h) from the
// forward's softmax statistics and its values [sk, b, groups, width] with v in columns [v0, width).
Tensor core_attention_magnitudes(const RankContext& ex, const DTensor& stats, const AttnParams& ap,
                                 const DTensor& values, std::int64_t v0);

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
