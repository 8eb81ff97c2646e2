// The optimized twin of Megatron-Core's Retro decoder (megatron/core/models/retro/): the layers of
// get_retro_decoder_block_spec (plain GPT layers, Retro decoder layers with chunked cross
// attention, the first Retro layer owning the retriever encoder) and the whole decoder block, on
// the CUDA simulator (Backend::Sim), at the config's tensor_model_parallel_size (1, 2, 4, ...:
// ranks simulated in one process, one thread each, the threaded collectives; no sequence
// parallelism). It loads the FULL state dict and shards it as Megatron does.
//
// Mirrors reference/retro/: the decoder sequence is chunked on the device (retro_kernels.cuh),
// linear_q / linear_kv / linear_proj run through the GEMM interface, and the dense twin's
// attention kernel reads every chunk's neighbours and every neighbour's rows by index (separate
// query and key/value layouts; no K/V copy per chunk or neighbour). The retriever encoder is a
// block of its own layers (layer 1 the Retro encoder layer, its cross attention to the decoder
// chunks and context_mask as its self-attention mask; the rest GPT layers), owned by the first
// Retro layer; the later Retro layers take its output as their context.
//
// Dropout streams as the reference's (core/dropout_site.h): a layer's calls at their DropoutSite,
// block layer i at block_layer_offset, the encoder block at the cross attention's stream +
// kRetroEncoderBlock, encoder neighbour n at retro_neighbour_offset.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/config.h"
#include "core/record.h"
#include "core/tensor.h"
#include "optimized/runtime/device.h"
#include "optimized/transformer_layer.h"  // ParamGradient

namespace twin::opt::retro {

// The kinds of reference/retro/decoder_spec.h (the layout comes from the shared spec code).
enum class RetroLayerKind { Gpt, Retro, RetroWithEncoder };

struct RetroForwardOptions {
  bool training = false;
  std::uint64_t seed = 0;    // Philox key of every dropout call
  std::uint64_t offset = 0;  // base Philox offset of the layer / block
  bool record_taps = false;  // submodule outputs under the reference's tap names (TP = 1 only)
  // Capture the forward into a CUDA graph once, then replay it (the dense layer's use_graph). A
  // graph holds the input and activation buffers it was captured with and bakes in the shapes
  // and the dropout arguments (training, seed, offset): a call with other shapes or dropout
  // arguments captures anew, one with the same replays on the new input values. The first call
  // runs the forward eagerly once before capturing it (a warm-up that allocates every buffer, as
  // nothing may be allocated while a stream captures). No taps (they copy to the host mid-
  // forward). On the simulator at any tp (its collectives are stream work, captured and replayed
  // like kernels); on the GPU at tp = 1 (its ranks' threaded collectives are host work that a
  // CUDA graph cannot capture).
  bool use_graph = false;
  // Keep every activation backward() reads (each rank's, until the next forward). Not with
  // use_graph (a replay overwrites the captured buffers the activations live in).
  bool keep_for_backward = false;
};

// The gradients of a layer's or block's last forward (run with keep_for_backward).
struct RetroGradients {
  Tensor hidden_states;               // d hidden_states [ns, bs, d]
  std::optional<Tensor> context;      // d context (the input's shape), when the forward was given one
  std::vector<ParamGradient> params;  // every parameter, unsharded, under its state-dict key
};

struct RetroOutput {
  Tensor hidden_states;           // [ns, bs, d]
  std::optional<Tensor> context;  // the context the layer / block hands on (encoder output [r*k, bs*l, d])
  Record record;                  // taps, when record_taps
};

// Why the optimized Retro decoder cannot run `config` although Megatron-Core can (a feature it
// does not implement), or "" when it can. The constructors reject the same with a ConfigError;
// a caller that must tell "not implemented" from bad input (the golden runner) asks first.
std::string retro_decoder_unsupported(const TransformerConfig& config);

// Megatron's state-dict keys of one decoder layer of `kind` (encoder keys under
// "cross_attention.encoder.layers.N.") for `config`.
std::vector<std::string> retro_layer_param_keys(const TransformerConfig& config, RetroLayerKind kind);
// The same keys with their shapes (in the params dtype).
std::vector<std::pair<std::string, Shape>> retro_layer_param_shapes(const TransformerConfig& config,
                                                                    RetroLayerKind kind);

class RetroDecoderLayer {
 public:
  // params: the layer's full state dict (every key of retro_layer_param_keys, no other).
  // ConfigError / ShapeError naming what is not supported or does not fit, before anything runs.
  RetroDecoderLayer(const TransformerConfig& config, const std::map<std::string, Tensor>& params, RetroLayerKind kind,
                    int layer_number, rt::Backend backend = rt::Backend::Sim);
  ~RetroDecoderLayer();
  RetroDecoderLayer(const RetroDecoderLayer&) = delete;
  RetroDecoderLayer& operator=(const RetroDecoderLayer&) = delete;

  // hidden_states [ns, bs, d]; context: the neighbour embeddings [r, k*bs*l, d] (kind
  // RetroWithEncoder) or the encoder output [r*k, bs*l, d] (kind Retro); context_mask BOOL
  // [k*bs*l or 1, 1 or np, r, r] (the encoder's self-attention mask) or null.
  RetroOutput forward(const Tensor& hidden_states, const Tensor* context, const Tensor* context_mask,
                      const RetroForwardOptions& options = {});
  // Megatron's backward of the last forward for grad_output [ns, bs, d] and grad_context, the
  // gradient of the context forward returned (null: not in the loss). with_magnitudes: each
  // parameter gradient's ParamGradient::magnitude (the bound's scale; host work). logic_error
  // when the last forward did not keep_for_backward; ShapeError for gradients of other shapes.
  RetroGradients backward(const Tensor& grad_output, const Tensor* grad_context = nullptr,
                          bool with_magnitudes = false);

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

class RetroDecoderBlock {
 public:
  // params under "layers.N." for layer N + 1 of `layout` (no final layernorm: the decoder spec has none).
  RetroDecoderBlock(const TransformerConfig& config, const std::map<std::string, Tensor>& params,
                    const std::vector<RetroLayerKind>& layout, rt::Backend backend = rt::Backend::Sim);
  ~RetroDecoderBlock();
  RetroDecoderBlock(const RetroDecoderBlock&) = delete;
  RetroDecoderBlock& operator=(const RetroDecoderBlock&) = delete;

  RetroOutput forward(const Tensor& hidden_states, const Tensor* context, const Tensor* context_mask,
                      const RetroForwardOptions& options = {});
  // As RetroDecoderLayer::backward; a block hands back its hidden states only (no grad_context).
  RetroGradients backward(const Tensor& grad_output, bool with_magnitudes = false);

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace twin::opt::retro
