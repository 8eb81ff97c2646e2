/* The optimized Retro decoder's layers and block (retro_layer.h) as one kernel sequence per
 * backend: compiled for the simulator (retro_layer_sim.cpp) and by nvcc for the GPU
 * (retro_layer_cuda.cu), like the dense layer's transformer_layer.cuh. Host orchestration
 * (weights, shards, ranks, taps) and device work (retro_kernels.cuh, the dense twin's norm,
 * GEMM, attention, activation and bias-dropout-add kernels) on the rank's stream. */
#pragma once

#include <cmath>
#include <cstring>
#include <functional>
#include <set>

#include "core/dropout_site.h"
#include "optimized/layer/attention_half.h"  // attention_scaling
#include "optimized/layer/features.h"
#include "optimized/layer/rank_runner.h"
#include "optimized/layer/sharding.h"
#include "optimized/retro/retro_kernels.cuh"
#include "optimized/retro/retro_runner.h"
#include "optimized/runtime/collectives.h"
#include "optimized/transformer_layer.cuh"  // linear_forward, norm / attention / bda / activation kernels

namespace twin::opt::TWIN_BACKEND::retro_impl {

using retro::RetroForwardOptions;
using retro::RetroLayerKind;
using retro::RetroOutput;

namespace {

void reject(bool bad, const std::string& what) {
  if (bad) throw ConfigError("optimized Retro decoder: " + what);
}

// The Retro sizes of the config (RetroConfig.__post_init__'s checks).
struct RetroSizes {
  std::int64_t m = 0, k = 0, r = 0;
  int encoder_layers = 0;
  double encoder_hidden_dropout = 0.0, encoder_attention_dropout = 0.0;
};

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
std::string unsupported_of(const TransformerConfig& c) { return layer_unsupported(LayerKind::Retro, c); }

void validate(const TransformerConfig& c) {
  reject(c.normalization != "LayerNorm",
         "normalization '" + c.normalization + "': the local Retro spec's FusedLayerNorm supports LayerNorm only");
  if (const std::string why = unsupported_of(c); !why.empty()) reject(true, "unsupported: " + why);
  const int tp = c.tensor_model_parallel_size;
  reject(tp < 1, "tensor_model_parallel_size must be >= 1");
  reject(c.num_attention_heads % tp != 0 || c.query_groups() % tp != 0,
         "tensor_model_parallel_size " + std::to_string(tp) + " must divide num_attention_heads " +
             std::to_string(c.num_attention_heads) + " and num_query_groups " + std::to_string(c.query_groups()));
  reject(c.ffn() % tp != 0, "tensor_model_parallel_size " + std::to_string(tp) + " must divide ffn_hidden_size " +
                                std::to_string(c.ffn()));
  reject(c.hidden_size <= 0 || c.num_attention_heads <= 0 || c.head_dim() <= 0 || c.ffn() <= 0,
         "hidden_size, heads, kv_channels and ffn must be > 0");
  reject(c.num_attention_heads % c.query_groups() != 0, "num_attention_heads not divisible by num_query_groups");
  retro_sizes(c);
}

// A device tensor: a shared buffer and its logical shape (several names may share one buffer).
struct DTensor {
  std::shared_ptr<rt::DeviceBuffer> buf;
  Shape shape;
  void* get() const { return buf ? buf->get() : nullptr; }
  std::int64_t numel() const { return shape_numel(shape); }
};

// The activations of a forward captured into a graph: the warm-up allocates them in order, the
// capture takes the same buffers in the same order (no allocation while the stream captures), and
// they live as long as the graph that reads and writes them.
struct Arena {
  std::vector<DTensor> bufs;
  std::size_t next = 0;
  bool capturing = false;  // hand out `bufs` in order instead of allocating
};

// What one rank's forward runs on: device, stream, dtype, taps, its rank and communicator.
struct RankContext {
  rt::Device* dev = nullptr;
  rt::Stream* stream = nullptr;
  DType dt = DType::F32;
  Record* rec = nullptr;  // null: no taps
  bool training = false;
  std::uint64_t seed = 0;
  int rank = 0, tp = 1;
  rt::Communicator* comm = nullptr;  // tp > 1
  Arena* arena = nullptr;            // a graph's warm-up or capture
  cudaStream_t st() const { return stream->handle(); }

  DTensor alloc(Shape shape) const {
    if (arena && arena->capturing) {
      // The capture runs the warm-up's code on the same shapes: the same allocations in order.
      if (arena->next >= arena->bufs.size() || arena->bufs[arena->next].shape != shape)
        throw std::logic_error("optimized Retro decoder: the captured forward's allocation " +
                               std::to_string(arena->next) + " " + shape_str(shape) + " differs from its warm-up's");
      return arena->bufs[arena->next++];
    }
    const std::size_t bytes = std::max<std::size_t>(std::size_t(shape_numel(shape)) * dtype_size(dt), 1);
    DTensor d{std::make_shared<rt::DeviceBuffer>(*dev, bytes), std::move(shape)};
    if (arena) arena->bufs.push_back(d);
    return d;
  }
  DTensor upload(const Tensor& t) const {
    DTensor d{std::make_shared<rt::DeviceBuffer>(*dev, std::max<std::size_t>(t.nbytes(), 1)), t.shape()};
    d.buf->upload(t.raw(), t.nbytes(), st());
    return d;
  }
  Tensor download(const DTensor& d, DType as) const {
    Tensor t = Tensor::empty(as, d.shape);
    dev->copy(t.raw_mut(), d.get(), t.nbytes(), rt::CopyKind::DeviceToHost, st());
    stream->synchronize();
    return t;
  }
  Tensor download(const DTensor& d) const { return download(d, dt); }
  // The tensor under `name`, with the rounding points counted so far (TP = 1: the full tensor).
  void tap(const std::string& name, const DTensor& d) const {
    if (rec) rec->add(Role::Tap, name, download(d));
  }
  void tap_param(const std::string& name, const Tensor* t) const {
    if (rec && t) rec->add_exact(Role::Tap, name, t->clone());
  }
};

DTensor view(const DTensor& d, Shape shape) { return DTensor{d.buf, std::move(shape)}; }

// One layer's numbers and weights.
enum class Cross { None, Decoder, Encoder };

// Cross-attention read in place: queries q [sq, N, q_tok / N] with this rank's heads (D = np_l * hn
// columns) starting at column 0 of q's pointer, keys and values interleaved per head in the
// linear_kv output kv [sk, N, np_l * 2hn]. One head per group (no GQA in Retro's cross-attention).
AttnOperands cross_attention_operands(const void* q, std::int64_t q_tok, const void* kv, std::int64_t N, std::int64_t D,
                                      int hn, DType dt) {
  AttnOperands ops;
  ops.q = q;
  ops.q_tok = q_tok;
  ops.q_batch = q_tok / N;
  ops.q_group = hn;
  ops.q_head = hn;
  ops.hpg = 1;
  ops.k = kv;
  ops.v = static_cast<const char*>(kv) + std::size_t(hn) * dtype_size(dt);
  ops.kv_tok = N * 2 * D;
  ops.kv_batch = 2 * D;
  ops.kv_group = 2 * hn;
  return ops;
}

struct Layer;
struct Block {
  std::vector<std::unique_ptr<Layer>> layers;
  // Runs the layers in order, layer i at block_layer_offset(offset, i); taps "<prefix>layers.i.0" / ".1".
  std::pair<DTensor, std::optional<DTensor>> forward(const RankContext& ex, DTensor x, std::optional<DTensor> context,
                                                     const DTensor* mask, const Shape& mask_shape, std::uint64_t offset,
                                                     const std::string& prefix) const;
};

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

  const void* w(const RankContext& ex, const std::string& key) const {
    const auto& m = dev.at(static_cast<std::size_t>(ex.rank));
    auto it = m.find(key);
    return it == m.end() ? nullptr : it->second.get();
  }
  int np_l(const RankContext& ex) const { return np / ex.tp; }
  const Tensor* host_param(const std::string& key) const {
    auto it = host.find(key);
    return it == host.end() ? nullptr : &it->second;
  }

  std::pair<DTensor, std::optional<DTensor>> forward(const RankContext& ex, const DTensor& x,
                                                     std::optional<DTensor> context, const DTensor* mask,
                                                     const Shape& mask_shape, std::uint64_t offset,
                                                     const std::string& pre) const;

 private:
  DTensor norm(const RankContext& ex, const DTensor& x, const std::string& key) const {
    DTensor y = ex.alloc(x.shape);
    norm_forward(false, ex.dt, x.get(), y.get(), w(ex, key + ".weight"), w(ex, key + ".bias"),
                 NormRows::dense(x.numel() / h, h), c.layernorm_epsilon, c.layernorm_zero_centered_gamma, ex.st());
    return y;
  }
  DTensor linear(const RankContext& ex, const DTensor& x, const std::string& key, bool bias_in_epilogue,
                 std::int64_t out_features) const {
    const std::int64_t in = x.shape.back(), rows = x.numel() / in;
    Shape shape = x.shape;
    shape.back() = out_features;
    DTensor y = ex.alloc(shape);
    linear_forward(ex.dt, x.get(), w(ex, key + ".weight"), bias_in_epilogue ? w(ex, key + ".bias") : nullptr, y.get(),
                   rows, in, out_features, ex.st());
    return y;
  }
  // A row-parallel linear (linear_proj, fc2): each rank's product summed over the ranks
  // (all-reduce); the bias is left to the bias-dropout-add, as in Megatron.
  DTensor row_parallel_linear(const RankContext& ex, const DTensor& x, const std::string& key) const {
    DTensor y = linear(ex, x, key, false, h);
    if (ex.tp == 1) return y;
    rounding_store(ex.dt);  // counts: the sum over ranks, stored in T
    DTensor sum = ex.alloc(y.shape);
    ex.comm->all_reduce(y.get(), sum.get(), std::size_t(y.numel()), ex.dt, ex.st());
    return sum;
  }
  AttnParams attn_params(const RankContext& ex, int sq, int sk, int b, double dropout,
                         std::uint64_t drop_offset) const {
    const bool training = ex.training;
    const std::uint64_t seed = ex.seed;
    AttnParams ap;
    ap.sq = sq;
    ap.sk = sk;
    ap.b = b;
    ap.np_local = np_l(ex);
    ap.np_total = np;
    ap.head_offset = ex.rank * np_l(ex);
    ap.hn = hn;
    ap.alpha = scaling.alpha;
    ap.coeff = scaling.coeff;
    ap.softmax_fp32 = scaling.softmax_fp32;
    ap.drop = DropoutArgs::make(dropout, training, seed, drop_offset);
    return ap;
  }
  // Row-parallel linear output and its bias as taps: <module>.<linear>.0/.1 and <module>.0/.1.
  // `module`: the layer-relative module path (its bias key), `pre`: the tap prefix.
  void proj_taps(const RankContext& ex, const DTensor& y, const std::string& pre, const std::string& module,
                 const std::string& linear) const {
    if (!ex.rec) return;
    const Tensor* bias = host_param(module + "." + linear + ".bias");
    const std::string m = pre + module + ".";
    ex.tap(m + linear + ".0", y);
    ex.tap_param(m + linear + ".1", bias);
    ex.tap(m + "0", y);
    ex.tap_param(m + "1", bias);
  }
  DTensor decoder_cross_attention(const RankContext& ex, const DTensor& ln, const DTensor& residual,
                                  std::optional<DTensor>& context, const DTensor* mask, const Shape& mask_shape,
                                  std::uint64_t offset, const std::string& pre) const;
  DTensor encoder_cross_attention(const RankContext& ex, const DTensor& ln, const DTensor& chunked,
                                  std::uint64_t offset, const std::string& pre) const;
};

std::pair<DTensor, std::optional<DTensor>> Layer::forward(const RankContext& ex, const DTensor& x,
                                                          std::optional<DTensor> context, const DTensor* mask,
                                                          const Shape& mask_shape, std::uint64_t offset,
                                                          const std::string& pre) const {
  const int s = static_cast<int>(x.shape[0]), b = static_cast<int>(x.shape[1]);
  const std::int64_t n = std::int64_t(s) * b;
  // ---- input_layernorm, self_attention (linear_qkv with its bias in the epilogue)  // [s, b, h]
  const DTensor ln1 = norm(ex, x, "input_layernorm");
  ex.tap(pre + "input_layernorm", ln1);
  const std::int64_t hpg = np / ng, qkv_w = std::int64_t(ng / ex.tp) * (hpg + 2) * hn;
  const DTensor qkv = linear(ex, ln1, "self_attention.linear_qkv", true, qkv_w);  // [s, b, ng (hpg + 2) hn]
  ex.tap(pre + "self_attention.linear_qkv.0", qkv);
  // The decoder's self attention is causal (the GPT spec); the encoder's is padding: the
  // context_mask when given, else none.
  AttnParams ap = attn_params(ex, s, s, b, self_attention_dropout, dropout_offset(offset, DropoutSite::SelfAttention));
  if (encoder_layer && mask) {
    ap.mask = MaskMode::Explicit;
    ap.mask_ptr = static_cast<const std::uint8_t*>(mask->get());
    ap.mask_b = static_cast<int>(mask_shape[0]);
    ap.mask_h = static_cast<int>(mask_shape[1]);
  } else {
    ap.mask = self_attention_mask_mode(false, encoder_layer ? "padding" : "causal", s);
  }
  const DTensor core = ex.alloc({s, b, std::int64_t(np_l(ex)) * hn});
  dot_product_attention_forward(ex.dt, qkv.get(), QkvLayout{qkv_w, (hpg + 2) * hn, int(hpg)}, core.get(), ap, ex.st());
  ex.tap(pre + "self_attention.core_attention", core);
  const DTensor proj = row_parallel_linear(ex, core, "self_attention.linear_proj");
  proj_taps(ex, proj, pre, "self_attention", "linear_proj");
  // ---- self_attn_bda                                   // [s, b, h]
  DTensor h1 = ex.alloc(x.shape);
  bias_dropout_add_forward(
      ex.dt, proj.get(), w(ex, "self_attention.linear_proj.bias"), x.get(), h1.get(), n, h,
      DropoutArgs::make(hidden_dropout, ex.training, ex.seed, dropout_offset(offset, DropoutSite::SelfAttnBda)), 0,
      ex.st());

  // ---- pre_cross_attn_layernorm, cross_attention, cross_attn_bda (IdentityOps in a GPT layer)
  DTensor h2 = h1;
  if (cross != Cross::None) {
    const DTensor lnc = norm(ex, h1, "pre_cross_attn_layernorm");
    ex.tap(pre + "pre_cross_attn_layernorm", lnc);
    if (cross == Cross::Decoder) {
      h2 = decoder_cross_attention(ex, lnc, h1, context, mask, mask_shape, offset, pre + "cross_attention.");
    } else {
      if (!context) throw std::invalid_argument("RetroEncoderCrossAttention: key_value_states cannot be None");
      h2 = encoder_cross_attention(ex, lnc, *context, offset, pre + "cross_attention.");
    }
  }

  // ---- pre_mlp_layernorm (the encoder's RetroEncoderLayerNorm norms every row), mlp, mlp_bda
  const std::string ln2_key = cross == Cross::Encoder ? "pre_mlp_layernorm.norm" : "pre_mlp_layernorm";
  const DTensor ln2 = norm(ex, h2, ln2_key);
  ex.tap(pre + "pre_mlp_layernorm", ln2);
  const bool glu = c.gated_linear_unit;
  const int f_l = ffn / ex.tp;
  const DTensor fc1 = linear(ex, ln2, "mlp.linear_fc1", false, (glu ? 2 : 1) * std::int64_t(f_l));
  ex.tap(pre + "mlp.linear_fc1.0", fc1);
  ex.tap_param(pre + "mlp.linear_fc1.1", host_param("mlp.linear_fc1.bias"));
  Shape act_shape = x.shape;
  act_shape.back() = f_l;
  const DTensor act = ex.alloc(act_shape);
  bias_activation_forward(ex.dt, fc1.get(), w(ex, "mlp.linear_fc1.bias"), act.get(), n, f_l,
                          act_from_name(c.activation_func), glu, ex.st());
  const DTensor fc2 = row_parallel_linear(ex, act, "mlp.linear_fc2");
  proj_taps(ex, fc2, pre, "mlp", "linear_fc2");
  DTensor out = ex.alloc(x.shape);
  bias_dropout_add_forward(
      ex.dt, fc2.get(), w(ex, "mlp.linear_fc2.bias"), h2.get(), out.get(), n, h,
      DropoutArgs::make(hidden_dropout, ex.training, ex.seed, dropout_offset(offset, DropoutSite::MlpBda)), 0, ex.st());
  return {out, context};
}

// RetroDecoderCrossAttention + RetroDecoderBiasDropoutAdd. ln: the pre_cross_attn_layernorm
// output [ns, bs, d]; residual: the self_attn_bda output. `context` in: the neighbour embeddings
// (with the encoder) or the encoder output; out: the encoder output [r*k, bs*l, d].
DTensor Layer::decoder_cross_attention(const RankContext& ex, const DTensor& ln, const DTensor& residual,
                                       std::optional<DTensor>& context, const DTensor* mask, const Shape& mask_shape,
                                       std::uint64_t offset, const std::string& pre) const {
  const std::int64_t m = rs.m, k = rs.k, r = rs.r, ns = ln.shape[0], bs = ln.shape[1], d = h;
  const std::int64_t l = (ns + m - 1) / m, N = bs * l, pad = (ns - 1) % m;
  const std::string sizes = " (r = retro_retrieved_length = " + std::to_string(r) +
                            ", k = retro_num_neighbors = " + std::to_string(k) + ", bs = " + std::to_string(bs) +
                            ", l = ceil(ns / m) = ceil(" + std::to_string(ns) + " / " + std::to_string(m) +
                            ") = " + std::to_string(l) + ")";
  if (!context)
    throw std::invalid_argument(std::string("RetroDecoderCrossAttention: key_value_states (") +
                                (encoder ? "the neighbour embeddings" : "the encoder output") + ") cannot be None");
  const std::uint64_t attn_offset = dropout_offset(offset, DropoutSite::CrossAttention);
  DTensor kv_in;  // [r*k, N, d]
  if (encoder) {
    const Shape want{r, k * N, d};
    if (context->shape != want)
      throw ShapeError(
          "RetroDecoderCrossAttention: neighbour embeddings (context) expected shape [r, k * bs * l, d] = " +
          shape_str(want) + sizes + ", got " + shape_str(context->shape));
    // Chunk the decoder states for the encoder: first ns % m tokens right-padded into chunk 0.
    RetroMapArgs chunk;
    chunk.map = RetroMap::ChunkEncoderContext;
    chunk.ns = ns;
    chunk.bs = bs;
    chunk.m = m;
    chunk.l = l;
    DTensor chunked = ex.alloc({m, N, d});  // [m, bs*l, d]
    retro_gather_rows(ex.dt, ln.get(), chunked.get(), chunk, ns * bs, int(d), ex.st());
    const RoundingCount hidden_rounding = rounding_now();
    auto [encoded, enc_context] =
        encoder->forward(ex, *context, chunked, mask, mask_shape, attn_offset + kRetroEncoderBlock, pre + "encoder.");
    ex.tap(pre + "encoder", encoded);  // [r, k*bs*l, d]
    rounding_join(hidden_rounding);
    kv_in = view(encoded, {r * k, N, d});
  } else {
    const Shape want{r * k, N, d};
    if (context->shape != want)
      throw ShapeError("RetroDecoderCrossAttention: encoder output (context) expected shape [r * k, bs * l, d] = " +
                       shape_str(want) + sizes + ", got " + shape_str(context->shape));
    kv_in = *context;
  }
  // Attending chunks: from the last token of the first chunk, right-padded to l*m. [m, N, d]
  RetroMapArgs attending;
  attending.map = RetroMap::PadAttendingChunks;
  attending.ns = ns;
  attending.bs = bs;
  attending.m = m;
  attending.l = l;
  attending.pad = pad;
  const DTensor padded = ex.alloc({m, N, d});
  retro_gather_rows(ex.dt, ln.get(), padded.get(), attending, ns * bs, int(d), ex.st());

  // attn: linear_kv on the neighbours, linear_q on the chunks, core attention (no mask), linear_proj.
  const std::int64_t D = std::int64_t(np_l(ex)) * hn;                                   // this rank's heads
  const DTensor kv = linear(ex, kv_in, "cross_attention.attn.linear_kv", true, 2 * D);  // [r*k, N, np_l * 2hn]
  ex.tap(pre + "attn.linear_kv.0", kv);
  const DTensor q = linear(ex, padded, "cross_attention.attn.linear_q", true, D);  // [m, N, np_l * hn]
  ex.tap(pre + "attn.linear_q.0", q);
  const AttnOperands ops = cross_attention_operands(q.get(), N * D, kv.get(), N, D, int(hn), ex.dt);
  const DTensor core = ex.alloc({m, N, D});
  dot_product_attention_forward(ex.dt, ops, core.get(),
                                attn_params(ex, int(m), int(r * k), int(N), cross_attention_dropout, attn_offset),
                                ex.st());
  ex.tap(pre + "attn.core_attention", core);
  const DTensor proj = row_parallel_linear(ex, core, "cross_attention.attn.linear_proj");  // [m, N, d]
  proj_taps(ex, proj, pre.substr(0, pre.size() - std::string("cross_attention.").size()), "cross_attention.attn",
            "linear_proj");
  ex.tap(pre + "attention_output", proj);
  ex.tap_param(pre + "attention_bias", host_param("cross_attention.attn.linear_proj.bias"));
  ex.tap(pre + "context", kv_in);
  context = kv_in;

  // RetroDecoderBiasDropoutAdd: zero-residual bda on the chunks, unchunked, + residual. [ns, bs, d]
  RetroMapArgs unchunk;
  unchunk.map = RetroMap::UnchunkDecoderOutput;
  unchunk.ns = ns;
  unchunk.bs = bs;
  unchunk.m = m;
  unchunk.l = l;
  unchunk.pad = pad;
  DTensor out = ex.alloc(residual.shape);
  retro_decoder_bias_dropout_add(
      ex.dt, proj.get(), w(ex, "cross_attention.attn.linear_proj.bias"), residual.get(), out.get(), unchunk, int(d),
      DropoutArgs::make(hidden_dropout, ex.training, ex.seed, dropout_offset(offset, DropoutSite::CrossAttnBda)),
      ex.st());
  return out;
}

// RetroEncoderCrossAttention + RetroEncoderBiasDropoutAdd. ln: the pre_cross_attn_layernorm
// output [r, N*k, d] (column j*k + n); chunked: the decoder chunks [m, N, d]. Returns [r, k*N, d]
// neighbour-major.
DTensor Layer::encoder_cross_attention(const RankContext& ex, const DTensor& ln, const DTensor& chunked,
                                       std::uint64_t offset, const std::string& pre) const {
  const std::int64_t k = rs.k, r = rs.r, d = h;
  if (chunked.shape.size() != 3 || chunked.shape[2] != d)
    throw ShapeError("RetroEncoderCrossAttention: key_value_states expected shape [m, bs*l, " + std::to_string(d) +
                     "], got " + shape_str(chunked.shape));
  const std::int64_t sk = chunked.shape[0], N = chunked.shape[1];
  if (ln.shape[0] != r || ln.shape[1] != k * N)
    throw ShapeError("RetroEncoderCrossAttention: neighbour hidden states " + shape_str(ln.shape) +
                     " do not fit [r, k * bs*l, d] = [" + std::to_string(r) + ", " + std::to_string(k * N) + ", " +
                     std::to_string(d) + "]");
  const std::uint64_t attn_offset = dropout_offset(offset, DropoutSite::CrossAttention);
  const std::int64_t D = std::int64_t(np_l(ex)) * hn;  // this rank's heads
  // Each neighbour is a branch from the input: all have the same count, joined after the loop.
  const RoundingCount at_input = rounding_now();
  const DTensor kv = linear(ex, chunked, "cross_attention.attn.linear_kv", true, 2 * D);  // [m, N, np * 2hn]
  const DTensor q = linear(ex, ln, "cross_attention.attn.linear_q", true, D);             // [r, N*k, np * hn]
  const RoundingCount after_q = rounding_now();
  const DTensor core = ex.alloc({k * r, N, D});  // neighbour n's context at rows [n*r, (n+1)*r)
  for (std::int64_t n = 0; n < k; ++n) {
    rounding_set(after_q);
    // Neighbour n's queries are column j*k + n of every retrieved position: read in place.
    const AttnOperands ops =
        cross_attention_operands(static_cast<const char*>(q.get()) + std::size_t(n * D) * dtype_size(ex.dt), N * k * D,
                                 kv.get(), N, D, int(hn), ex.dt);
    const std::uint64_t neighbour_offset = retro_neighbour_offset(attn_offset, std::uint64_t(n));
    dot_product_attention_forward(
        ex.dt, ops, static_cast<char*>(core.get()) + std::size_t(n * r * N * D) * dtype_size(ex.dt),
        attn_params(ex, int(r), int(sk), int(N), cross_attention_dropout, neighbour_offset), ex.st());
  }
  const DTensor proj = row_parallel_linear(ex, core, "cross_attention.attn.linear_proj");  // [k*r, N, d]
  const RoundingCount neighbours_end = rounding_now();
  if (ex.rec) {
    const Tensor all = ex.download(proj);
    const Tensor lnh = ex.download(ln);
    const Tensor* bias = host_param("cross_attention.attn.linear_proj.bias");
    const std::size_t es = dtype_size(ex.dt), row = std::size_t(d) * es;
    for (std::int64_t n = 0; n < k; ++n) {
      const std::string i = std::to_string(n);
      Tensor out = Tensor::empty(ex.dt, {r, N, d});
      std::memcpy(out.raw_mut(), all.raw() + std::size_t(n * r * N) * row, std::size_t(r * N) * row);
      rounding_set(neighbours_end);
      ex.rec->add(Role::Tap, pre + i + ".0", out);
      ex.tap_param(pre + i + ".1", bias);
      Tensor res = Tensor::empty(ex.dt, {r, N, d});  // chunked_output = hidden_states.reshape(r, -1, k, d)[:, :, n]
      for (std::int64_t t = 0; t < r; ++t)
        for (std::int64_t j = 0; j < N; ++j)
          std::memcpy(res.raw_mut() + std::size_t(t * N + j) * row, lnh.raw() + std::size_t((t * N + j) * k + n) * row,
                      row);
      rounding_set(at_input);
      ex.rec->add(Role::Tap, pre + i + ".2", res);
    }
  }
  rounding_set(neighbours_end);
  DTensor out = ex.alloc({r, k * N, d});
  retro_encoder_bias_dropout_add(
      ex.dt, proj.get(), w(ex, "cross_attention.attn.linear_proj.bias"), ln.get(), out.get(), r, N, k, int(d),
      DropoutArgs::make(hidden_dropout, ex.training, ex.seed, dropout_offset(offset, DropoutSite::CrossAttnBda)),
      ex.st());
  return out;
}

std::pair<DTensor, std::optional<DTensor>> Block::forward(const RankContext& ex, DTensor x,
                                                          std::optional<DTensor> context, const DTensor* mask,
                                                          const Shape& mask_shape, std::uint64_t offset,
                                                          const std::string& prefix) const {
  const RoundingCount inputs_rounding = rounding_now();
  for (std::size_t i = 0; i < layers.size(); ++i) {
    rounding_join(inputs_rounding);
    const std::string l = prefix + "layers." + std::to_string(i) + ".";
    auto [h, c] = layers[i]->forward(ex, x, context, mask, mask_shape, block_layer_offset(offset, i), l);
    x = h;
    ex.tap(prefix + "layers." + std::to_string(i) + ".0", x);
    context = c;
    if (context) ex.tap(prefix + "layers." + std::to_string(i) + ".1", *context);
  }
  return {x, context};
}

// ---- building layers ------------------------------------------------------------------------------

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

// Builds one layer from params under `prefix`; `used` collects the keys it took.
std::unique_ptr<Layer> build_layer(const TransformerConfig& c, const std::map<std::string, Tensor>& params,
                                   const std::string& prefix, Cross cross, bool encoder_layer, bool owns_encoder,
                                   int layer_number, const RankContext& ex, std::set<std::string>& used);

std::unique_ptr<Block> build_encoder(const TransformerConfig& c, const std::map<std::string, Tensor>& params,
                                     const std::string& prefix, const RankContext& ex, std::set<std::string>& used) {
  auto block = std::make_unique<Block>();
  const RetroSizes rs = retro_sizes(c);
  for (int i = 0; i < rs.encoder_layers; ++i)
    block->layers.push_back(build_layer(c, params, prefix + "layers." + std::to_string(i) + ".",
                                        i == 0 ? Cross::Encoder : Cross::None, true, false, i + 1, ex, used));
  return block;
}

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

Cross cross_of(RetroLayerKind k) { return k == RetroLayerKind::Gpt ? Cross::None : Cross::Decoder; }

void check_all_used(const std::map<std::string, Tensor>& params, const std::set<std::string>& used) {
  for (const auto& [key, t] : params)
    if (!used.count(key)) throw ShapeError("optimized Retro decoder: parameter '" + key + "' is not one it owns");
}

// The tensor-parallel ranks of a built layer or block (device, a stream and a communicator each)
// and the steps of a forward the layer and the block share: inputs checked and uploaded, the ranks
// run, the output and record put together.
struct RankGroup {
  TransformerConfig config;
  DType dt = DType::F32;
  rt::Device* dev = nullptr;
  int tp = 1;
  std::vector<std::unique_ptr<rt::Stream>> streams;      // per rank
  std::vector<std::unique_ptr<rt::Communicator>> comms;  // tp > 1

  void init(const TransformerConfig& c) {
    validate(c);
    config = c;
    dt = params_dtype(c);
    dev = &rt::device(this_backend());
    tp = c.tensor_model_parallel_size;
    for (int r = 0; r < tp; ++r) streams.push_back(std::make_unique<rt::Stream>(*dev));
    if (tp > 1) comms = rt::make_threaded_group(tp);
  }
  RankContext exec(Record* rec, const RetroForwardOptions& o, int rank = 0) const {
    RankContext ex;
    ex.dev = dev;
    ex.stream = streams.at(static_cast<std::size_t>(rank)).get();
    ex.dt = dt;
    ex.rec = rec;
    ex.training = o.training;
    ex.seed = o.seed;
    ex.rank = rank;
    ex.tp = tp;
    ex.comm = tp > 1 ? comms[static_cast<std::size_t>(rank)].get() : nullptr;
    return ex;
  }
  // Runs `f(exec of the rank)` on every rank (layer/rank_runner.h: the rounding counts joined as
  // every layer kind joins them) and returns rank 0's output.
  RetroOutput run(const RetroForwardOptions& o, const std::function<RetroOutput(const RankContext&)>& f) const {
    if (o.record_taps && tp != 1)
      throw std::invalid_argument("optimized Retro decoder: taps are recorded at tensor_model_parallel_size 1 only");
    RetroOutput out;
    run_ranks_counted(tp, [&](int r) {
      RetroOutput mine = f(exec(nullptr, o, r));
      if (r == 0) out = std::move(mine);
    });
    return out;
  }
  // Inputs on the device, checked: hidden_states [ns, bs, d] in dt, context rank 3 in dt, mask BOOL rank 4.
  struct Inputs {
    DTensor x;
    std::optional<DTensor> context;
    std::optional<DTensor> mask;
    Shape mask_shape;
  };
  void check(const Tensor& hidden_states, const Tensor* context, const Tensor* context_mask) const {
    const std::int64_t d = config.hidden_size;
    if (hidden_states.dim() != 3 || hidden_states.size(2) != d || hidden_states.size(0) <= 0 ||
        hidden_states.size(1) <= 0)
      throw ShapeError("optimized Retro decoder: hidden_states expected [ns, bs, " + std::to_string(d) + "], got " +
                       shape_str(hidden_states.shape()));
    if (hidden_states.dtype() != dt)
      throw ShapeError(std::string("optimized Retro decoder: hidden_states dtype ") +
                       dtype_name(hidden_states.dtype()) + " differs from the params dtype " + dtype_name(dt));
    if (context && (context->dim() != 3 || context->size(2) != d || context->dtype() != dt))
      throw ShapeError("optimized Retro decoder: context expected " + std::string(dtype_name(dt)) + " [*, *, " +
                       std::to_string(d) + "], got " + context->describe());
    if (context_mask) {
      const Shape& ms = context_mask->shape();
      const RetroSizes rs = retro_sizes(config);
      if (context_mask->dtype() != DType::BOOL || ms.size() != 4 || ms[2] != rs.r || ms[3] != rs.r ||
          (ms[1] != 1 && ms[1] != config.num_attention_heads))
        throw ShapeError("optimized Retro decoder: context_mask expected BOOL [k*bs*l or 1, 1 or np, r, r] with r = " +
                         std::to_string(rs.r) + ", got " + context_mask->describe());
      if (context && ms[0] != 1 && ms[0] != context->size(1))
        throw ShapeError("optimized Retro decoder: context_mask batch " + std::to_string(ms[0]) +
                         " is neither 1 nor the neighbour batch k*bs*l = " + std::to_string(context->size(1)));
    }
  }
  Inputs upload(const RankContext& ex, const Tensor& hidden_states, const Tensor* context,
                const Tensor* context_mask) const {
    check(hidden_states, context, context_mask);
    Inputs in;
    in.x = ex.upload(hidden_states);
    if (context) in.context = ex.upload(*context);
    if (context_mask) {
      in.mask = DTensor{std::make_shared<rt::DeviceBuffer>(*ex.dev, context_mask->nbytes()), context_mask->shape()};
      in.mask->buf->upload(context_mask->raw(), context_mask->nbytes(), ex.st());  // BOOL: one byte per element
      in.mask_shape = context_mask->shape();
    }
    return in;
  }
  RetroOutput finish(const RankContext& ex, const DTensor& x, const std::optional<DTensor>& context, Record rec) const {
    RetroOutput out;
    out.hidden_states = ex.download(x);
    if (context) out.context = ex.download(*context);
    out.record = std::move(rec);
    return out;
  }

  // ---- graph capture and replay (RetroForwardOptions::use_graph)
  using Forward = std::function<std::pair<DTensor, std::optional<DTensor>>(const RankContext&, const Inputs&)>;
  // What a captured graph bakes in: the input shapes (its buffers) and the dropout arguments.
  struct GraphKey {
    Shape x, context, mask;
    bool has_context = false, has_mask = false, training = false;
    std::uint64_t seed = 0, offset = 0;
    bool operator==(const GraphKey& o) const {
      return x == o.x && context == o.context && mask == o.mask && has_context == o.has_context &&
             has_mask == o.has_mask && training == o.training && seed == o.seed && offset == o.offset;
    }
  };
  // One rank's graph with every buffer it reads and writes.
  struct RankGraph {
    GraphKey key;
    Inputs in;    // the input buffers the graph reads: refilled before each replay
    Arena arena;  // its activations
    DTensor x;    // its outputs (in the arena)
    std::optional<DTensor> context;
    std::optional<rt::Graph> graph;
    RoundingCount rounding;  // the rounding points the captured forward executes, counted at capture
  };
  std::vector<std::unique_ptr<RankGraph>> graphs;  // per rank

  static RoundingCount minus(RoundingCount a, const RoundingCount& b) {
    a.bf16 -= b.bf16;
    a.fp16 -= b.fp16;
    a.fp32 -= b.fp32;
    a.reduction -= b.reduction;
    return a;
  }
  static RoundingCount plus(RoundingCount a, const RoundingCount& b) {
    a.bf16 += b.bf16;
    a.fp16 += b.fp16;
    a.fp32 += b.fp32;
    a.reduction += b.reduction;
    return a;
  }

  // Replays the forward captured for these shapes and dropout arguments, capturing it first when
  // there is none: warm-up (eager, allocating the arena), capture (the same code on the same
  // buffers, nothing executed), replay. The rounding count advances by the captured forward's
  // points at each replay, as an eager run advances it (every count in a forward is its input's
  // count plus points, so the forward's points are the same for any input count).
  RetroOutput run_graph(const RetroForwardOptions& o, const Tensor& hidden_states, const Tensor* context,
                        const Tensor* context_mask, const Forward& fwd) {
    if (o.record_taps)
      throw std::invalid_argument(
          "optimized Retro decoder: use_graph records no taps (a tap copies to the host "
          "mid-forward, which a captured stream cannot)");
    if (dev->backend() == rt::Backend::Cuda && tp != 1)
      throw std::invalid_argument(
          "optimized Retro decoder: use_graph on the GPU is for tensor_model_parallel_size 1 (the ranks' threaded "
          "collectives are host work a CUDA graph cannot capture)");
    check(hidden_states, context, context_mask);
    GraphKey key;
    key.x = hidden_states.shape();
    key.has_context = context != nullptr;
    if (context) key.context = context->shape();
    key.has_mask = context_mask != nullptr;
    if (context_mask) key.mask = context_mask->shape();
    key.training = o.training;
    key.seed = o.seed;
    key.offset = o.offset;
    if (graphs.size() != static_cast<std::size_t>(tp)) graphs.resize(static_cast<std::size_t>(tp));
    return run(o, [&](const RankContext& rank_exec) {
      std::unique_ptr<RankGraph>& g = graphs[static_cast<std::size_t>(rank_exec.rank)];
      if (g && g->key == key) {
        g->in.x.buf->upload(hidden_states.raw(), hidden_states.nbytes(), rank_exec.st());
        if (context) g->in.context->buf->upload(context->raw(), context->nbytes(), rank_exec.st());
        if (context_mask) g->in.mask->buf->upload(context_mask->raw(), context_mask->nbytes(), rank_exec.st());
      } else {
        g.reset();  // the old graph and its buffers
        auto fresh = std::make_unique<RankGraph>();
        fresh->key = key;
        fresh->in = upload(rank_exec, hidden_states, context, context_mask);
        RankContext ex = rank_exec;
        ex.arena = &fresh->arena;
        const RoundingCount start = rounding_now();
        fwd(ex, fresh->in);  // warm-up
        ex.stream->synchronize();
        rounding_set(start);
        fresh->arena.capturing = true;
        ex.stream->begin_capture();
        try {
          auto [x, ctx] = fwd(ex, fresh->in);
          fresh->x = x;
          fresh->context = ctx;
        } catch (...) {
          try {
            rt::Graph discarded = ex.stream->end_capture();
          } catch (...) {
          }
          throw;
        }
        fresh->graph.emplace(ex.stream->end_capture());
        if (fresh->arena.next != fresh->arena.bufs.size())
          throw std::logic_error(
              "optimized Retro decoder: the captured forward allocated fewer buffers than its warm-up");
        fresh->rounding = minus(rounding_now(), start);
        rounding_set(start);
        g = std::move(fresh);
      }
      rounding_set(plus(rounding_now(), g->rounding));
      g->graph->launch(*rank_exec.stream);
      return finish(rank_exec, g->x, g->context, Record{});
    });
  }
};

struct LayerRunner : retro::detail::Runner {
  RankGroup sh;
  std::unique_ptr<Layer> layer;
  RetroOutput forward(const Tensor& hidden_states, const Tensor* context, const Tensor* context_mask,
                      const RetroForwardOptions& o) override {
    if (o.use_graph)
      return sh.run_graph(
          o, hidden_states, context, context_mask, [&](const RankContext& ex, const RankGroup::Inputs& in) {
            return layer->forward(ex, in.x, in.context, in.mask ? &*in.mask : nullptr, in.mask_shape, o.offset, "");
          });
    return sh.run(o, [&](const RankContext& rank_exec) {
      Record rec;
      RankContext ex = rank_exec;
      if (o.record_taps) ex.rec = &rec;
      const auto in = sh.upload(ex, hidden_states, context, context_mask);
      auto [x, ctx] = layer->forward(ex, in.x, in.context, in.mask ? &*in.mask : nullptr, in.mask_shape, o.offset, "");
      return sh.finish(ex, x, ctx, std::move(rec));
    });
  }
};

struct BlockRunner : retro::detail::Runner {
  RankGroup sh;
  Block block;
  RetroOutput forward(const Tensor& hidden_states, const Tensor* context, const Tensor* context_mask,
                      const RetroForwardOptions& o) override {
    if (o.use_graph)
      return sh.run_graph(
          o, hidden_states, context, context_mask, [&](const RankContext& ex, const RankGroup::Inputs& in) {
            return block.forward(ex, in.x, in.context, in.mask ? &*in.mask : nullptr, in.mask_shape, o.offset, "");
          });
    return sh.run(o, [&](const RankContext& rank_exec) {
      Record rec;
      RankContext ex = rank_exec;
      if (o.record_taps) ex.rec = &rec;
      const auto in = sh.upload(ex, hidden_states, context, context_mask);
      auto [x, ctx] = block.forward(ex, in.x, in.context, in.mask ? &*in.mask : nullptr, in.mask_shape, o.offset, "");
      return sh.finish(ex, x, ctx, std::move(rec));
    });
  }
};

}  // namespace

inline std::vector<std::string> param_keys(const TransformerConfig& c, RetroLayerKind kind) {
  std::vector<std::string> keys = layer_keys(c, cross_of(kind));
  if (kind == RetroLayerKind::RetroWithEncoder) {
    const RetroSizes rs = retro_sizes(c);
    for (int i = 0; i < rs.encoder_layers; ++i)
      for (const auto& k : layer_keys(c, i == 0 ? Cross::Encoder : Cross::None))
        keys.push_back("cross_attention.encoder.layers." + std::to_string(i) + "." + k);
  }
  return keys;
}

inline std::vector<std::pair<std::string, Shape>> param_shapes_of(const TransformerConfig& c, RetroLayerKind kind) {
  const auto shapes = param_shapes(c);
  std::vector<std::pair<std::string, Shape>> out;
  const std::string enc = "cross_attention.encoder.layers.";
  for (const auto& key : param_keys(c, kind)) {
    std::string rel = key;
    if (key.rfind(enc, 0) == 0) rel = key.substr(key.find('.', enc.size()) + 1);  // past "layers.N."
    out.emplace_back(key, shapes.at(rel));
  }
  return out;
}

inline std::unique_ptr<retro::detail::Runner> make_layer_impl(const TransformerConfig& c,
                                                              const std::map<std::string, Tensor>& params,
                                                              RetroLayerKind kind, int layer_number) {
  auto run = std::make_unique<LayerRunner>();
  run->sh.init(c);
  std::set<std::string> used;
  const RankContext ex = run->sh.exec(nullptr, {});
  run->layer = build_layer(c, params, "", cross_of(kind), false, kind == RetroLayerKind::RetroWithEncoder, layer_number,
                           ex, used);
  check_all_used(params, used);
  return run;
}

inline std::unique_ptr<retro::detail::Runner> make_block_impl(const TransformerConfig& c,
                                                              const std::map<std::string, Tensor>& params,
                                                              const std::vector<RetroLayerKind>& layout) {
  auto run = std::make_unique<BlockRunner>();
  run->sh.init(c);
  reject(layout.empty(), "an empty block layout");
  std::set<std::string> used;
  const RankContext ex = run->sh.exec(nullptr, {});
  for (std::size_t i = 0; i < layout.size(); ++i)
    run->block.layers.push_back(build_layer(c, params, "layers." + std::to_string(i) + ".", cross_of(layout[i]), false,
                                            layout[i] == RetroLayerKind::RetroWithEncoder, int(i) + 1, ex, used));
  check_all_used(params, used);
  return run;
}

}  // namespace twin::opt::TWIN_BACKEND::retro_impl

// The backend's entry points (layer/backend_entries.h), defined once here for both compilations.
namespace twin::opt::TWIN_BACKEND {
std::unique_ptr<retro::detail::Runner> make_retro_layer(const TransformerConfig& config,
                                                        const std::map<std::string, Tensor>& params,
                                                        retro::RetroLayerKind kind, int layer_number) {
  return retro_impl::make_layer_impl(config, params, kind, layer_number);
}
std::unique_ptr<retro::detail::Runner> make_retro_block(const TransformerConfig& config,
                                                        const std::map<std::string, Tensor>& params,
                                                        const std::vector<retro::RetroLayerKind>& layout) {
  return retro_impl::make_block_impl(config, params, layout);
}
std::vector<std::pair<std::string, Shape>> retro_param_shapes(const TransformerConfig& config,
                                                              retro::RetroLayerKind kind) {
  return retro_impl::param_shapes_of(config, kind);
}
std::string retro_unsupported(const TransformerConfig& config) { return retro_impl::unsupported_of(config); }
}  // namespace twin::opt::TWIN_BACKEND
