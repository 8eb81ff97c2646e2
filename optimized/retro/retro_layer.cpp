// The optimized Retro decoder's layer and block (retro_layer.h), host side compiled once: a layer
// runs Megatron's TransformerLayer steps (input_layernorm, self_attention, self_attn_bda,
// pre_cross_attn_layernorm, cross_attention, cross_attn_bda, pre_mlp_layernorm, mlp, mlp_bda) on
// each rank, launching the backend's ops one at a time; a RankGroup runs it on every rank, eagerly
// or from each rank's captured graph (layer/rank_context.h).
#include "optimized/retro/retro_layer.h"

#include <algorithm>
#include <functional>

#include "core/dropout_site.h"
#include "optimized/layer/sharding.h"
#include "optimized/retro/retro_layer_impl.h"

namespace twin::opt::retro {

// ---- a layer's ops on one rank --------------------------------------------------------------

const void* Layer::w(const RankContext& ex, const std::string& key) const {
  const auto& m = dev.at(static_cast<std::size_t>(ex.rank));
  auto it = m.find(key);
  return it == m.end() ? nullptr : it->second.get();
}

const Tensor* Layer::host_param(const std::string& key) const {
  auto it = host.find(key);
  return it == host.end() ? nullptr : &it->second;
}

DTensor Layer::norm(const RankContext& ex, const DTensor& x, const std::string& key) const {
  return ex.layer_norm(x, w(ex, key + ".weight"), w(ex, key + ".bias"), c.layernorm_epsilon,
                       c.layernorm_zero_centered_gamma);
}

DTensor Layer::linear(const RankContext& ex, const DTensor& x, const std::string& key, bool bias_in_epilogue,
                      std::int64_t out_features) const {
  return ex.linear(x, w(ex, key + ".weight"), bias_in_epilogue ? w(ex, key + ".bias") : nullptr, out_features);
}

DTensor Layer::row_parallel_linear(const RankContext& ex, const DTensor& x, const std::string& key) const {
  return ex.row_parallel_linear(x, w(ex, key + ".weight"), h);
}

AttnParams Layer::attn_params(const RankContext& ex, int sq, int sk, int b, double dropout,
                              std::uint64_t drop_offset) const {
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
  ap.drop = DropoutArgs::make(dropout, ex.training, ex.seed, drop_offset);
  return ap;
}

DropoutArgs Layer::hidden_dropout_args(const RankContext& ex, std::uint64_t drop_offset) const {
  return DropoutArgs::make(hidden_dropout, ex.training, ex.seed, drop_offset);
}

AttnParams Layer::self_attn_params(const RankContext& ex, int s, int b, const DTensor* mask,
                                   std::uint64_t offset) const {
  AttnParams ap = attn_params(ex, s, s, b, self_attention_dropout, dropout_offset(offset, DropoutSite::SelfAttention));
  if (encoder_layer && mask) {
    ap.mask = MaskMode::Explicit;
    ap.mask_ptr = static_cast<const std::uint8_t*>(mask->get());
    ap.mask_b = static_cast<int>(mask->shape[0]);
    ap.mask_h = static_cast<int>(mask->shape[1]);
  } else {
    ap.mask = self_attention_mask_mode(false, encoder_layer ? "padding" : "causal", s);
  }
  return ap;
}

// Row-parallel linear output and its bias as taps: <module>.<linear>.0/.1 and <module>.0/.1.
// `module`: the layer-relative module path (its bias key), `pre`: the tap prefix.
void Layer::proj_taps(const RankContext& ex, const DTensor& y, const std::string& pre, const std::string& module,
                      const std::string& linear) const {
  if (!ex.recording()) return;
  const Tensor* bias = host_param(module + "." + linear + ".bias");
  const std::string m = pre + module + ".";
  ex.tap(m + linear + ".0", y);
  ex.tap_param(m + linear + ".1", bias);
  ex.tap(m + "0", y);
  ex.tap_param(m + "1", bias);
}

// ---- the layer's forward ---------------------------------------------------------------------

// input_layernorm, self_attention (linear_qkv with its bias in the epilogue), self_attn_bda.
// x [s, b, h] -> [s, b, h].
DTensor Layer::self_attention(const RankContext& ex, const DTensor& x, const DTensor* mask, std::uint64_t offset,
                              const std::string& pre, LayerActs* a) const {
  const int s = static_cast<int>(x.shape[0]), b = static_cast<int>(x.shape[1]);
  const DTensor ln1 = norm(ex, x, "input_layernorm");
  ex.tap(pre + "input_layernorm", ln1);
  const std::int64_t hpg = np / ng, qkv_w = std::int64_t(ng / ex.tp) * (hpg + 2) * hn;
  const DTensor qkv = linear(ex, ln1, "self_attention.linear_qkv", true, qkv_w);  // [s, b, ng (hpg + 2) hn]
  ex.tap(pre + "self_attention.linear_qkv.0", qkv, {2, 1});                       // this rank's query groups
  AttnParams ap = self_attn_params(ex, s, b, mask, offset);
  const DTensor core = ex.alloc({s, b, std::int64_t(np_l(ex)) * hn});
  const std::optional<DTensor> stats =
      a || ex.recording() ? std::optional<DTensor>(save_softmax_stats(ex, ap)) : std::nullopt;
  if (a) {
    a->x = x;
    a->ln1 = ln1;
    a->qkv = qkv;
    a->core = core;
    a->stats = *stats;
    if (encoder_layer && mask) a->mask = *mask;
  }
  const QkvLayout layout{qkv_w, (hpg + 2) * hn, int(hpg)};
  ex.ops->dot_product_attention_forward(ex.dt, AttnOperands::from_qkv(qkv.get(), layout, b, hn, dtype_size(ex.dt)),
                                        core.get(), ap, ex.st());
  if (ex.recording())  // v: the last hn columns of each query group [q heads | k | v]
    ex.tap(pre + "self_attention.core_attention", core, {2, 1},
           core_attention_magnitudes(ex, *stats, ap, view(qkv, {s, b, ng / ex.tp, (hpg + 2) * hn}), (hpg + 1) * hn));
  const DTensor proj = row_parallel_linear(ex, core, "self_attention.linear_proj");
  proj_taps(ex, proj, pre, "self_attention", "linear_proj");
  DTensor out = ex.alloc(x.shape);
  ex.ops->bias_dropout_add_forward(
      ex.dt, proj.get(), w(ex, "self_attention.linear_proj.bias"), x.get(), out.get(), x.numel() / h, h,
      hidden_dropout_args(ex, dropout_offset(offset, DropoutSite::SelfAttnBda)), 0, ex.st());
  return out;
}

// pre_mlp_layernorm (the encoder's RetroEncoderLayerNorm norms every row), mlp, mlp_bda.
// h2 [s, b, h] -> [s, b, h].
DTensor Layer::mlp(const RankContext& ex, const DTensor& h2, std::uint64_t offset, const std::string& pre,
                   LayerActs* a) const {
  const std::int64_t n = h2.numel() / h;
  const std::string ln2_key = cross == Cross::Encoder ? "pre_mlp_layernorm.norm" : "pre_mlp_layernorm";
  const DTensor ln2 = norm(ex, h2, ln2_key);
  ex.tap(pre + "pre_mlp_layernorm", ln2);
  const bool glu = c.gated_linear_unit;
  const int f_l = ffn / ex.tp;
  const DTensor fc1 = linear(ex, ln2, "mlp.linear_fc1", false, (glu ? 2 : 1) * std::int64_t(f_l));
  ex.tap(pre + "mlp.linear_fc1.0", fc1, {2, glu ? 2 : 1});  // [gate | linear] columns
  ex.tap_param(pre + "mlp.linear_fc1.1", host_param("mlp.linear_fc1.bias"));
  Shape act_shape = h2.shape;
  act_shape.back() = f_l;
  const DTensor act = ex.alloc(act_shape);
  ex.ops->bias_activation_forward(ex.dt, fc1.get(), w(ex, "mlp.linear_fc1.bias"), act.get(), n, f_l,
                                  act_from_name(c.activation_func), glu, ex.st());
  if (a) {
    a->h2 = h2;
    a->ln2 = ln2;
    a->fc1 = fc1;
    a->act = act;
  }
  const DTensor fc2 = row_parallel_linear(ex, act, "mlp.linear_fc2");
  proj_taps(ex, fc2, pre, "mlp", "linear_fc2");
  DTensor out = ex.alloc(h2.shape);
  ex.ops->bias_dropout_add_forward(ex.dt, fc2.get(), w(ex, "mlp.linear_fc2.bias"), h2.get(), out.get(), n, h,
                                   hidden_dropout_args(ex, dropout_offset(offset, DropoutSite::MlpBda)), 0, ex.st());
  return out;
}

std::pair<DTensor, std::optional<DTensor>> Layer::forward(const RankContext& ex, const DTensor& x,
                                                          std::optional<DTensor> context, const DTensor* mask,
                                                          std::uint64_t offset, const std::string& pre,
                                                          LayerActs* a) const {
  const DTensor h1 = self_attention(ex, x, mask, offset, pre, a);
  // pre_cross_attn_layernorm, cross_attention, cross_attn_bda (IdentityOps in a GPT layer)
  DTensor h2 = h1;
  if (cross != Cross::None) {
    const DTensor lnc = norm(ex, h1, "pre_cross_attn_layernorm");
    ex.tap(pre + "pre_cross_attn_layernorm", lnc);
    if (a) {
      a->h1 = h1;
      a->lnc = lnc;
    }
    if (cross == Cross::Decoder) {
      h2 = decoder_cross_attention(ex, lnc, h1, context, mask, offset, pre + "cross_attention.", a);
    } else {
      if (!context) throw std::invalid_argument("RetroEncoderCrossAttention: key_value_states cannot be None");
      h2 = encoder_cross_attention(ex, lnc, *context, offset, pre + "cross_attention.", a);
    }
  }
  return {mlp(ex, h2, offset, pre, a), context};
}

std::pair<DTensor, std::optional<DTensor>> Block::forward(const RankContext& ex, DTensor x,
                                                          std::optional<DTensor> context, const DTensor* mask,
                                                          std::uint64_t offset, const std::string& prefix,
                                                          BlockActs* acts) const {
  const RoundingCount inputs_rounding = rounding_now();
  if (acts) acts->layers = std::vector<LayerActs>(layers.size());
  for (std::size_t i = 0; i < layers.size(); ++i) {
    rounding_join(inputs_rounding);
    const std::string l = prefix + "layers." + std::to_string(i) + ".";
    auto [h, c] =
        layers[i]->forward(ex, x, context, mask, block_layer_offset(offset, i), l, acts ? &acts->layers[i] : nullptr);
    x = h;
    ex.tap(prefix + "layers." + std::to_string(i) + ".0", x);
    context = c;
    if (context) ex.tap(prefix + "layers." + std::to_string(i) + ".1", *context);
  }
  return {x, context};
}

// ---- a forward of a built layer or block on its ranks ----------------------------------------

namespace {

// hidden_states [ns, bs, d] in dt, context rank 3 in dt, context_mask BOOL rank 4.
void check_inputs(const TransformerConfig& config, const Tensor& hidden_states, const Tensor* context,
                  const Tensor* context_mask) {
  const std::int64_t d = config.hidden_size;
  const DType dt = params_dtype(config);
  if (hidden_states.dim() != 3 || hidden_states.size(2) != d || hidden_states.size(0) <= 0 ||
      hidden_states.size(1) <= 0)
    throw ShapeError("optimized Retro decoder: hidden_states expected [ns, bs, " + std::to_string(d) + "], got " +
                     shape_str(hidden_states.shape()));
  if (hidden_states.dtype() != dt)
    throw ShapeError(std::string("optimized Retro decoder: hidden_states dtype ") + dtype_name(hidden_states.dtype()) +
                     " differs from the params dtype " + dtype_name(dt));
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

RankGroup make_ranks(const TransformerConfig& c, rt::Backend backend) {
  validate(c);
  return RankGroup("optimized Retro decoder", params_dtype(c), c.tensor_model_parallel_size, backend);
}

// A layer's or block's forward (hidden states, context, mask -> hidden states, context).
using RetroForward = std::function<std::pair<DTensor, std::optional<DTensor>>(
    const RankContext&, const DTensor& x, std::optional<DTensor> context, const DTensor* mask)>;

RetroOutput run_forward(RankGroup& ranks, const TransformerConfig& c, const RetroForwardOptions& o,
                        const Tensor& hidden_states, const Tensor* context, const Tensor* context_mask,
                        const RetroForward& forward, SavedForward& saved) {
  const GroupRun run{o.training, o.seed, o.offset, o.record_taps, o.use_graph};
  ranks.check_run(run);
  if (o.use_graph && o.keep_for_backward)
    throw std::invalid_argument(
        "optimized Retro decoder: keep_for_backward with use_graph (a replay overwrites the captured activations)");
  check_inputs(c, hidden_states, context, context_mask);
  saved = SavedForward{};  // a failed forward leaves nothing to run backward on
  RetroOutput out;
  auto outputs = ranks.forward(
      {&hidden_states, context, context_mask}, run,
      [&](const RankContext& ex, const DeviceTensors& in) {
        auto [x, ctx] = forward(ex, *in[0], in[1], in[2] ? &*in[2] : nullptr);
        return DeviceTensors{x, ctx};
      },
      &out.record);
  out.hidden_states = std::move(*outputs.at(0));
  out.context = std::move(outputs.at(1));
  if (o.keep_for_backward) {
    saved.kept = true;
    saved.run = run;
    saved.output = out.hidden_states.shape();
    if (context) saved.context_in = context->shape();
    if (out.context) saved.context_out = out.context->shape();
  }
  return out;
}

// One rank's backward: (d x, d of the context given) from d out and d of the context handed on.
using RetroBackward = std::function<std::pair<DTensor, std::optional<DTensor>>(
    const RankContext&, const DTensor& d_out, std::optional<DTensor> d_context, RankParamGrads& grads)>;

RetroGradients run_backward(RankGroup& ranks, const TransformerConfig& c, const SavedForward& saved,
                            const Tensor& grad_output, const Tensor* grad_context, bool with_magnitudes,
                            const RetroBackward& backward) {
  if (!saved.kept)
    throw std::logic_error("optimized Retro decoder: backward() needs a forward run with keep_for_backward");
  if (grad_output.shape() != saved.output || grad_output.dtype() != params_dtype(c))
    throw ShapeError("optimized Retro decoder: grad_output expected " + std::string(dtype_name(params_dtype(c))) + " " +
                     shape_str(saved.output) + " (the forward's output), got " + grad_output.describe());
  if (grad_context &&
      (!saved.context_out || grad_context->shape() != *saved.context_out || grad_context->dtype() != params_dtype(c)))
    throw ShapeError("optimized Retro decoder: grad_context expected " +
                     (saved.context_out ? std::string(dtype_name(params_dtype(c))) + " " + shape_str(*saved.context_out)
                                        : std::string("none (the forward returned no context)")) +
                     ", got " + grad_context->describe());
  const int tp = c.tensor_model_parallel_size;
  std::vector<RankParamGrads> grads(static_cast<std::size_t>(tp));
  std::vector<std::map<std::string, Tensor>> host(static_cast<std::size_t>(tp));
  RetroGradients out;
  ranks.run_each(saved.run, [&](const RankContext& rank_ex) {
    RankContext ex = rank_ex;
    GradLeaves leaves(rounding_now());
    ex.leaves = &leaves;
    RankParamGrads& g = grads[static_cast<std::size_t>(ex.rank)];
    g.with_magnitudes = with_magnitudes;
    const std::optional<DTensor> d_context =
        grad_context ? std::optional<DTensor>(ex.upload(*grad_context)) : std::nullopt;
    auto [dx, dc] = backward(ex, ex.upload(grad_output), d_context, g);
    leaves.join_all();
    for (const auto& [key, e] : g.grads) host[static_cast<std::size_t>(ex.rank)][key] = ex.download(e.value);
    if (ex.rank != 0) return;
    out.hidden_states = ex.download(dx);
    if (saved.context_in)  // zeros where no gradient reached the context (a GPT layer's, unused)
      out.context = dc ? ex.download(view(*dc, *saved.context_in)) : Tensor::zeros(params_dtype(c), *saved.context_in);
  });
  // Every rank's shard of each parameter put back together, its magnitude the largest rank's.
  for (const auto& [key, e] : grads[0].grads) {
    std::vector<const Tensor*> shards;
    double magnitude = e.magnitude;
    for (int r = 0; r < tp; ++r) {
      shards.push_back(&host[static_cast<std::size_t>(r)].at(key));
      magnitude = std::max(magnitude, grads[static_cast<std::size_t>(r)].grads.at(key).magnitude);
    }
    out.params.push_back({key, gather_shards(shards, tensor_parallel_layout(c, e.relative)), magnitude});
  }
  return out;
}

}  // namespace

// ---- the public classes ---------------------------------------------------------------------

struct RetroDecoderLayer::Impl {
  TransformerConfig config;
  RankGroup ranks;
  std::unique_ptr<Layer> layer;
  SavedForward saved;
  std::vector<LayerActs> acts;  // per rank, with keep_for_backward
};

RetroDecoderLayer::RetroDecoderLayer(const TransformerConfig& c, const std::map<std::string, Tensor>& params,
                                     RetroLayerKind kind, int layer_number, rt::Backend backend)
    : impl_(std::make_unique<Impl>(Impl{c, make_ranks(c, backend), nullptr, {}, {}})) {
  std::set<std::string> used;
  impl_->layer = build_layer(c, params, "", cross_of(kind), false, kind == RetroLayerKind::RetroWithEncoder,
                             layer_number, impl_->ranks.context(0), used);
  check_all_used(params, used);
}
RetroDecoderLayer::~RetroDecoderLayer() = default;

RetroOutput RetroDecoderLayer::forward(const Tensor& hidden_states, const Tensor* context, const Tensor* context_mask,
                                       const RetroForwardOptions& o) {
  Impl& I = *impl_;
  I.acts = std::vector<LayerActs>(o.keep_for_backward ? I.config.tensor_model_parallel_size : 0);
  return run_forward(
      I.ranks, I.config, o, hidden_states, context, context_mask,
      [&](const RankContext& ex, const DTensor& x, std::optional<DTensor> ctx, const DTensor* mask) {
        return I.layer->forward(ex, x, std::move(ctx), mask, o.offset, "",
                                o.keep_for_backward ? &I.acts[static_cast<std::size_t>(ex.rank)] : nullptr);
      },
      I.saved);
}

RetroGradients RetroDecoderLayer::backward(const Tensor& grad_output, const Tensor* grad_context,
                                           bool with_magnitudes) {
  Impl& I = *impl_;
  return run_backward(I.ranks, I.config, I.saved, grad_output, grad_context, with_magnitudes,
                      [&](const RankContext& ex, const DTensor& d, std::optional<DTensor> dc, RankParamGrads& g) {
                        return I.layer->backward(ex, I.acts.at(static_cast<std::size_t>(ex.rank)), d, std::move(dc),
                                                 I.saved.run.offset, "", g);
                      });
}

struct RetroDecoderBlock::Impl {
  TransformerConfig config;
  RankGroup ranks;
  Block block;
  SavedForward saved;
  std::vector<BlockActs> acts;  // per rank, with keep_for_backward
};

RetroDecoderBlock::RetroDecoderBlock(const TransformerConfig& c, const std::map<std::string, Tensor>& params,
                                     const std::vector<RetroLayerKind>& layout, rt::Backend backend)
    : impl_(std::make_unique<Impl>(Impl{c, make_ranks(c, backend), {}, {}, {}})) {
  reject(layout.empty(), "an empty block layout");
  std::set<std::string> used;
  for (std::size_t i = 0; i < layout.size(); ++i)
    impl_->block.layers.push_back(build_layer(c, params, "layers." + std::to_string(i) + ".", cross_of(layout[i]),
                                              false, layout[i] == RetroLayerKind::RetroWithEncoder, int(i) + 1,
                                              impl_->ranks.context(0), used));
  check_all_used(params, used);
}
RetroDecoderBlock::~RetroDecoderBlock() = default;

RetroOutput RetroDecoderBlock::forward(const Tensor& hidden_states, const Tensor* context, const Tensor* context_mask,
                                       const RetroForwardOptions& o) {
  Impl& I = *impl_;
  I.acts = std::vector<BlockActs>(o.keep_for_backward ? I.config.tensor_model_parallel_size : 0);
  RetroOutput out = run_forward(
      I.ranks, I.config, o, hidden_states, context, context_mask,
      [&](const RankContext& ex, const DTensor& x, std::optional<DTensor> ctx, const DTensor* mask) {
        return I.block.forward(ex, x, std::move(ctx), mask, o.offset, "",
                               o.keep_for_backward ? &I.acts[static_cast<std::size_t>(ex.rank)] : nullptr);
      },
      I.saved);
  I.saved.context_out.reset();  // a block hands back its hidden states only
  return out;
}

RetroGradients RetroDecoderBlock::backward(const Tensor& grad_output, bool with_magnitudes) {
  Impl& I = *impl_;
  return run_backward(I.ranks, I.config, I.saved, grad_output, nullptr, with_magnitudes,
                      [&](const RankContext& ex, const DTensor& d, std::optional<DTensor>, RankParamGrads& g) {
                        return I.block.backward(ex, I.acts.at(static_cast<std::size_t>(ex.rank)), d, std::nullopt,
                                                I.saved.run.offset, "", g);
                      });
}

}  // namespace twin::opt::retro
