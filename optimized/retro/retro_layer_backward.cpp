// The optimized Retro decoder's backward on one rank (retro_layer_impl.h; the reference's
// TransformerLayer::backward with a cross-attention slot, reference/transformer_layer.h): a layer
// runs mlp_bda .. pre_mlp_layernorm (the dense layer's MLP half), then cross_attn_bda,
// cross_attention and pre_cross_attn_layernorm (decoder_attention.cpp / encoder_attention.cpp,
// through cross_attn_backward here), then self_attn_bda .. input_layernorm (the dense layer's
// attention half); a block runs its layers in reverse. Parameter gradients are leaves of the
// rounding count (ex.leaves): the data path goes on from where each branched off.
#include <map>

#include "core/dropout_site.h"
#include "optimized/layer/grad_magnitudes.h"
#include "core/attention_bound.h"
#include "optimized/retro/retro_layer_impl.h"

namespace twin::opt::retro {

namespace {

// |t| of device tensors, each downloaded once (the magnitudes read a tensor several times).
class AbsCache {
 public:
  explicit AbsCache(const RankContext& ex) : ex_(ex) {}
  const std::vector<double>& operator()(const DTensor& d) {
    auto [it, fresh] = abs_.try_emplace(d.get());
    if (fresh) it->second = abs_values(ex_.download(d));
    return it->second;
  }

 private:
  const RankContext& ex_;
  std::map<const void*, std::vector<double>> abs_;
};

TensorParallel tensor_parallel(const RankContext& ex) { return TensorParallel{ex.tp, ex.rank, false, ex.comm}; }

void* ptr(const std::optional<DTensor>& d) { return d ? d->get() : nullptr; }

}  // namespace

void RankParamGrads::add(const RankContext& ex, const std::string& pre, const std::string& key, const DTensor& g,
                         const std::function<double()>& magnitude) {
  const double mag = with_magnitudes ? magnitude() : -1.0;
  auto [it, fresh] = grads.try_emplace(pre + key, Entry{key, g, mag});
  if (fresh) return;
  // The parameter used again: autograd's accumulation of .grad, a leaf of its own.
  const RoundingCount branch = rounding_now();
  ex.ops->grad_sum(ex.dt, it->second.value.get(), g.get(), it->second.value.get(), g.numel(), ex.st());
  ex.leaves->done(branch);
  // max over elements of the summed |terms| <= the sum of each use's maximum
  if (with_magnitudes) it->second.magnitude += mag;
}

DTensor save_softmax_stats(const RankContext& ex, AttnParams& ap) {
  DTensor stats = ex.alloc({std::int64_t(ap.b) * ap.np_local * ap.sq * 2}, DType::F32);
  ap.softmax_stats = static_cast<float*>(stats.get());
  return stats;
}

Tensor core_attention_magnitudes(const RankContext& ex, const DTensor& stats, const AttnParams& ap,
                                 const DTensor& values, std::int64_t v0) {
  return core_attention_error_magnitudes(ex.download(view(stats, {ap.b, ap.np_local, ap.sq, 2}), DType::F32), ap.sk,
                                         ex.download(values), v0,
                                         ap.drop.active && ap.drop.scale > 0.0 ? 1.0 - 1.0 / ap.drop.scale : 0.0);
}

std::optional<DTensor> Layer::grad_buffer(const RankContext& ex, const std::string& key) const {
  const auto& m = dev.at(static_cast<std::size_t>(ex.rank));
  auto it = m.find(key);
  if (it == m.end()) return std::nullopt;
  return ex.alloc(it->second.shape);
}

// ---- the MLP and attention halves: the dense layer's kernels ---------------------------------

// pre_mlp_layernorm (RetroEncoderLayerNorm's norm in the encoder's first layer), mlp, mlp_bda.
DTensor Layer::mlp_backward(const RankContext& ex, const LayerActs& a, const DTensor& d_out, std::uint64_t offset,
                            const std::string& pre, RankParamGrads& g) const {
  const std::string ln2 = cross == Cross::Encoder ? "pre_mlp_layernorm.norm" : "pre_mlp_layernorm";
  const std::int64_t n = a.h2.numel() / h;
  const int f_l = ffn / ex.tp, width = (c.gated_linear_unit ? 2 : 1) * f_l;
  MlpHalfBackward b;
  b.dt = ex.dt;
  b.n = n;
  b.h = h;
  b.ffn = f_l;
  b.glu = c.gated_linear_unit;
  b.zero_centered_gamma = c.layernorm_zero_centered_gamma;
  b.act = act_from_name(c.activation_func);
  b.eps = c.layernorm_epsilon;
  b.drop = hidden_dropout_args(ex, dropout_offset(offset, DropoutSite::MlpBda));
  b.tp = tensor_parallel(ex);
  b.hidden = a.h2.get();
  b.ln2 = a.ln2.get();
  b.fc1 = a.fc1.get();
  b.act_out = a.act.get();
  b.ln2_w = w(ex, ln2 + ".weight");
  b.fc1_w = w(ex, "mlp.linear_fc1.weight");
  b.fc1_b = w(ex, "mlp.linear_fc1.bias");
  b.fc2_w = w(ex, "mlp.linear_fc2.weight");
  b.fc2_bias = host_param("mlp.linear_fc2.bias") != nullptr;
  b.dout = d_out.get();
  const DTensor dhidden = ex.alloc(a.h2.shape);
  b.dhidden = dhidden.get();
  const auto d_ln2_w = grad_buffer(ex, ln2 + ".weight"), d_ln2_b = grad_buffer(ex, ln2 + ".bias");
  const auto d_fc1_w = grad_buffer(ex, "mlp.linear_fc1.weight"), d_fc1_b = grad_buffer(ex, "mlp.linear_fc1.bias");
  const auto d_fc2_w = grad_buffer(ex, "mlp.linear_fc2.weight"), d_fc2_b = grad_buffer(ex, "mlp.linear_fc2.bias");
  b.d_ln2_w = ptr(d_ln2_w);
  b.d_ln2_b = ptr(d_ln2_b);
  b.d_fc1_w = ptr(d_fc1_w);
  b.d_fc1_b = ptr(d_fc1_b);
  b.d_fc2_w = ptr(d_fc2_w);
  b.d_fc2_b = ptr(d_fc2_b);
  const DTensor d_mlp = ex.alloc({n, h}), d_act = ex.alloc({n, f_l}), d_fc1 = ex.alloc({n, width}),
                d_ln2 = ex.alloc({n, h});
  const std::optional<DTensor> d_ln2_partial = ex.tp > 1 ? std::optional<DTensor>(ex.alloc({n, h})) : std::nullopt;
  b.d_mlp = d_mlp.get();
  b.d_act = d_act.get();
  b.d_fc1 = d_fc1.get();
  b.d_ln2 = d_ln2.get();
  b.d_ln2_partial = ptr(d_ln2_partial);
  const auto ws = ex.workspace(ex.ops->mlp_half_backward_workspace_bytes(false, n, h, f_l, b.glu));
  b.workspace = ws->get();
  b.workspace_bytes = ws->bytes();
  ex.ops->mlp_half_backward(b, ex.st());

  AbsCache abs(ex);
  g.add(ex, pre, ln2 + ".weight", *d_ln2_w,
        [&] { return norm_weight_magnitude(abs(d_ln2), ex.download(a.h2), n, h, false, c.layernorm_epsilon); });
  if (d_ln2_b) g.add(ex, pre, ln2 + ".bias", *d_ln2_b, [&] { return column_magnitude(abs(d_ln2), n, h); });
  g.add(ex, pre, "mlp.linear_fc1.weight", *d_fc1_w,
        [&] { return weight_magnitude(abs(d_fc1), abs(a.ln2), n, width, h); });
  if (d_fc1_b) g.add(ex, pre, "mlp.linear_fc1.bias", *d_fc1_b, [&] { return column_magnitude(abs(d_fc1), n, width); });
  g.add(ex, pre, "mlp.linear_fc2.weight", *d_fc2_w,
        [&] { return weight_magnitude(abs(d_mlp), abs(a.act), n, h, f_l); });
  if (d_fc2_b) g.add(ex, pre, "mlp.linear_fc2.bias", *d_fc2_b, [&] { return column_magnitude(abs(d_mlp), n, h); });
  return dhidden;
}

// input_layernorm, self_attention, self_attn_bda.
DTensor Layer::self_attention_backward(const RankContext& ex, const LayerActs& a, const DTensor& dh1,
                                       std::uint64_t offset, const std::string& pre, RankParamGrads& g) const {
  const int s = static_cast<int>(a.x.shape[0]), bt = static_cast<int>(a.x.shape[1]);
  const std::int64_t n = std::int64_t(s) * bt, D = std::int64_t(np_l(ex)) * hn;
  AttentionHalfBackward b;
  b.dt = ex.dt;
  b.s = s;
  b.b = bt;
  b.h = h;
  b.np = np_l(ex);
  b.ng = ng / ex.tp;
  b.hn = hn;
  b.zero_centered_gamma = c.layernorm_zero_centered_gamma;
  b.eps = c.layernorm_epsilon;
  b.attn = self_attn_params(ex, s, bt, a.mask ? &*a.mask : nullptr, offset);
  b.drop = hidden_dropout_args(ex, dropout_offset(offset, DropoutSite::SelfAttnBda));
  b.tp = tensor_parallel(ex);
  b.x = a.x.get();
  b.ln1 = a.ln1.get();
  b.qkv = a.qkv.get();
  b.ctx = a.core.get();
  b.softmax_stats = static_cast<const float*>(a.stats.get());
  b.ln1_w = w(ex, "input_layernorm.weight");
  b.qkv_w = w(ex, "self_attention.linear_qkv.weight");
  b.qkv_b = w(ex, "self_attention.linear_qkv.bias");
  b.proj_w = w(ex, "self_attention.linear_proj.weight");
  b.proj_bias = host_param("self_attention.linear_proj.bias") != nullptr;
  b.dh1 = dh1.get();
  const DTensor dx = ex.alloc(a.x.shape);
  b.dx = dx.get();
  const auto d_ln1_w = grad_buffer(ex, "input_layernorm.weight"), d_ln1_b = grad_buffer(ex, "input_layernorm.bias");
  const auto d_qkv_w = grad_buffer(ex, "self_attention.linear_qkv.weight"),
             d_qkv_b = grad_buffer(ex, "self_attention.linear_qkv.bias");
  const auto d_proj_w = grad_buffer(ex, "self_attention.linear_proj.weight"),
             d_proj_b = grad_buffer(ex, "self_attention.linear_proj.bias");
  b.d_ln1_w = ptr(d_ln1_w);
  b.d_ln1_b = ptr(d_ln1_b);
  b.d_qkv_w = ptr(d_qkv_w);
  b.d_qkv_b = ptr(d_qkv_b);
  b.d_proj_w = ptr(d_proj_w);
  b.d_proj_b = ptr(d_proj_b);
  const std::int64_t qw = b.qkv_width();
  const DTensor d_proj = ex.alloc({n, h}), d_ctx = ex.alloc({n, D}), d_qkv = ex.alloc({n, qw}),
                d_ln1 = ex.alloc({n, h});
  const std::optional<DTensor> d_ln1_partial = ex.tp > 1 ? std::optional<DTensor>(ex.alloc({n, h})) : std::nullopt;
  b.d_proj = d_proj.get();
  b.d_ctx = d_ctx.get();
  b.d_qkv = d_qkv.get();
  b.d_ln1 = d_ln1.get();
  b.d_ln1_partial = ptr(d_ln1_partial);
  const auto ws = ex.workspace(ex.ops->attention_half_backward_workspace_bytes(b));
  b.workspace = ws->get();
  b.workspace_bytes = ws->bytes();
  ex.ops->attention_half_backward(b, ex.st());

  AbsCache abs(ex);
  g.add(ex, pre, "input_layernorm.weight", *d_ln1_w,
        [&] { return norm_weight_magnitude(abs(d_ln1), ex.download(a.x), n, h, false, c.layernorm_epsilon); });
  if (d_ln1_b) g.add(ex, pre, "input_layernorm.bias", *d_ln1_b, [&] { return column_magnitude(abs(d_ln1), n, h); });
  g.add(ex, pre, "self_attention.linear_qkv.weight", *d_qkv_w,
        [&] { return weight_magnitude(abs(d_qkv), abs(a.ln1), n, qw, h); });
  if (d_qkv_b)
    g.add(ex, pre, "self_attention.linear_qkv.bias", *d_qkv_b, [&] { return column_magnitude(abs(d_qkv), n, qw); });
  g.add(ex, pre, "self_attention.linear_proj.weight", *d_proj_w,
        [&] { return weight_magnitude(abs(d_proj), abs(a.core), n, h, D); });
  if (d_proj_b)
    g.add(ex, pre, "self_attention.linear_proj.bias", *d_proj_b, [&] { return column_magnitude(abs(d_proj), n, h); });
  return dx;
}

// ---- the cross-attention slot ----------------------------------------------------------------

DTensor Layer::pre_cross_attn_layernorm_backward(const RankContext& ex, const LayerActs& a, const DTensor& d_lnc,
                                                 const DTensor* d_residual, const std::string& pre,
                                                 RankParamGrads& g) const {
  const std::int64_t n = a.h1.numel() / h;
  const DTensor d_h1 = ex.alloc(a.h1.shape);
  const DTensor dw = *grad_buffer(ex, "pre_cross_attn_layernorm.weight");
  const auto db = grad_buffer(ex, "pre_cross_attn_layernorm.bias");
  const auto ws = ex.workspace(ex.ops->norm_backward_workspace_bytes(false, n, h));
  ex.ops->norm_backward(false, ex.dt, d_lnc.get(), a.h1.get(), d_h1.get(), w(ex, "pre_cross_attn_layernorm.weight"),
                        dw.get(), ptr(db), NormRows::dense(n, h), c.layernorm_epsilon, c.layernorm_zero_centered_gamma,
                        ws->get(), ws->bytes(), ex.st());
  AbsCache abs(ex);
  g.add(ex, pre, "pre_cross_attn_layernorm.weight", dw,
        [&] { return norm_weight_magnitude(abs(d_lnc), ex.download(a.h1), n, h, false, c.layernorm_epsilon); });
  if (db) g.add(ex, pre, "pre_cross_attn_layernorm.bias", *db, [&] { return column_magnitude(abs(d_lnc), n, h); });
  // The residual's gradient joins the norm's input's (autograd's sum, stored).
  return d_residual ? ex.grad_sum(d_h1, *d_residual) : d_h1;
}

namespace {

// A column-parallel linear's backward (linear_q, linear_kv): its bias (the epilogue's: the sum of
// dy's rows) and weight gradients as leaves, then d x, each rank's partial summed over the ranks.
// dy [rows, out], x [rows, in] -> d x [rows, in].
DTensor column_parallel_linear_backward(const RankContext& ex, const Layer& L, const DTensor& dy, const DTensor& x,
                                        const std::string& key, const std::string& pre, RankParamGrads& g,
                                        AbsCache& abs) {
  const std::int64_t out = dy.shape.back(), in = x.shape.back(), rows = dy.numel() / out;
  const RoundingCount branch = rounding_now();
  if (auto db = L.grad_buffer(ex, key + ".bias")) {
    const auto ws = ex.workspace(ex.ops->linear_backward_bias_workspace_bytes(rows, out));
    ex.ops->linear_backward_bias(ex.dt, dy.get(), db->get(), rows, out, ws->get(), ws->bytes(), ex.st());
    ex.leaves->done(branch);
    g.add(ex, pre, key + ".bias", *db, [&] { return column_magnitude(abs(dy), rows, out); });
  }
  const DTensor dw = *L.grad_buffer(ex, key + ".weight");
  ex.ops->linear_backward_wgrad(ex.dt, dy.get(), x.get(), dw.get(), rows, in, out, ex.st());
  ex.leaves->done(branch);
  g.add(ex, pre, key + ".weight", dw, [&] { return weight_magnitude(abs(dy), abs(x), rows, out, in); });
  const DTensor dx = ex.alloc({rows, in});
  ex.ops->linear_backward_dgrad(ex.dt, dy.get(), L.w(ex, key + ".weight"), dx.get(), rows, in, out, ex.st());
  return ex.sum_over_ranks(dx);
}

}  // namespace

std::pair<DTensor, DTensor> Layer::cross_attn_backward(const RankContext& ex, const CrossCall& k, const DTensor& d_proj,
                                                       const std::string& pre, RankParamGrads& g) const {
  const std::string attn = "cross_attention.attn.";
  const std::int64_t rows_q = std::int64_t(k.sq) * k.N, rows_kv = std::int64_t(k.sk) * k.N;
  const std::int64_t D = std::int64_t(np_l(ex)) * hn;
  AbsCache abs(ex);
  // linear_proj (row parallel): d proj is every rank's whole; its bias (the bda's) and weight
  // gradients are leaves, d core this rank's heads.                       // [rows_q, h] -> [rows_q, D]
  const RoundingCount branch = rounding_now();
  if (auto db = grad_buffer(ex, attn + "linear_proj.bias")) {
    const auto ws = ex.workspace(ex.ops->linear_backward_bias_workspace_bytes(rows_q, h));
    ex.ops->linear_backward_bias(ex.dt, d_proj.get(), db->get(), rows_q, h, ws->get(), ws->bytes(), ex.st());
    ex.leaves->done(branch);
    g.add(ex, pre, attn + "linear_proj.bias", *db, [&] { return column_magnitude(abs(d_proj), rows_q, h); });
  }
  const DTensor dwp = *grad_buffer(ex, attn + "linear_proj.weight");
  ex.ops->linear_backward_wgrad(ex.dt, d_proj.get(), k.core.get(), dwp.get(), rows_q, D, h, ex.st());
  ex.leaves->done(branch);
  g.add(ex, pre, attn + "linear_proj.weight", dwp,
        [&] { return weight_magnitude(abs(d_proj), abs(k.core), rows_q, h, D); });
  const DTensor d_core = ex.alloc({rows_q, D});
  ex.ops->linear_backward_dgrad(ex.dt, d_proj.get(), w(ex, attn + "linear_proj.weight"), d_core.get(), rows_q, D, h,
                                ex.st());
  // core_attention (no mask): d q [rows_q, D], d kv [rows_kv, 2D] in linear_kv's interleaved layout.
  const AttnParams ap = attn_params(ex, k.sq, k.sk, k.N, cross_attention_dropout, k.drop_offset);
  const std::size_t es = dtype_size(ex.dt);
  const DTensor dq = ex.alloc({rows_q, D}), dkv = ex.alloc({rows_kv, 2 * D});
  const auto ws = ex.workspace(ex.ops->dot_product_attention_backward_workspace_bytes(ap));
  ex.ops->dot_product_attention_backward(ex.dt, AttnOperands::from_q_kv(k.q.get(), k.N * D, k.kv.get(), k.N, D, hn, es),
                                         d_core.get(), AttnGradOperands::from_q_kv(dq.get(), dkv.get(), hn, es),
                                         static_cast<const float*>(k.stats.get()), ap, ws->get(), ws->bytes(), ex.st());
  // linear_kv, then linear_q (column parallel), in the reference's order.
  const DTensor d_kv_in = column_parallel_linear_backward(ex, *this, dkv, k.kv_in, attn + "linear_kv", pre, g, abs);
  const DTensor d_query_in = column_parallel_linear_backward(ex, *this, dq, k.query_in, attn + "linear_q", pre, g, abs);
  return {d_query_in, d_kv_in};
}

// ---- a layer and a block ---------------------------------------------------------------------

std::pair<DTensor, std::optional<DTensor>> Layer::backward(const RankContext& ex, const LayerActs& a,
                                                           const DTensor& d_out, std::optional<DTensor> d_context,
                                                           std::uint64_t offset, const std::string& pre,
                                                           RankParamGrads& g) const {
  const DTensor d_h2 = mlp_backward(ex, a, d_out, offset, pre, g);
  DTensor d_h1 = d_h2;  // IdentityOps in a GPT layer, which hands its context on unchanged
  if (cross == Cross::Decoder) {
    auto [d_lnc, d_ctx] = decoder_cross_attention_backward(ex, a, d_h2, d_context, offset, pre, g);
    d_h1 = pre_cross_attn_layernorm_backward(ex, a, d_lnc, &d_h2, pre, g);  // the bda's residual is h1
    d_context = d_ctx;
  } else if (cross == Cross::Encoder) {
    auto [d_lnc, d_chunked] = encoder_cross_attention_backward(ex, a, d_h2, offset, pre, g);
    // RetroEncoderBiasDropoutAdd's residual is the normed neighbours (inside d_lnc), not h1.
    d_h1 = pre_cross_attn_layernorm_backward(ex, a, d_lnc, nullptr, pre, g);
    // The context (the decoder chunks) was also handed on unchanged: autograd sums the two uses.
    d_context = d_context ? ex.grad_sum(d_chunked, *d_context) : d_chunked;
  }
  return {self_attention_backward(ex, a, d_h1, offset, pre, g), d_context};
}

std::pair<DTensor, std::optional<DTensor>> Block::backward(const RankContext& ex, const BlockActs& acts, DTensor d_out,
                                                           std::optional<DTensor> d_context, std::uint64_t offset,
                                                           const std::string& prefix, RankParamGrads& grads) const {
  if (acts.layers.size() != layers.size())
    throw std::logic_error("optimized Retro decoder: backward without its forward's activations");
  for (std::size_t i = layers.size(); i-- > 0;) {
    const std::string pre = prefix + "layers." + std::to_string(i) + ".";
    auto [dx, dc] =
        layers[i]->backward(ex, acts.layers[i], d_out, std::move(d_context), block_layer_offset(offset, i), pre, grads);
    d_out = dx;
    d_context = dc;
  }
  return {d_out, d_context};
}

}  // namespace twin::opt::retro
