#include "optimized/layer/attention_half.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/attention_bound.h"
#include "core/dropout_site.h"
#include "core/progress.h"
#include "core/rotary_embedding.h"
#include "optimized/layer/sharding.h"  // take_cols

namespace twin::opt {

namespace {

// MLASelfAttention's parameters (its linears have no bias but linear_proj; its latent norms are
// the spec's q/k layernorms, q_layernorm only with q_lora_rank).
void add_mla_param_keys(const TransformerConfig& c, bool ln, std::vector<std::string>& k) {
  auto norm = [&](const std::string& name) {
    if (!c.qk_layernorm) return;
    k.push_back("self_attention." + name + ".weight");
    if (ln) k.push_back("self_attention." + name + ".bias");
  };
  if (c.q_lora_rank) {
    k.push_back("self_attention.linear_q_down_proj.weight");
    norm("q_layernorm");
    k.push_back("self_attention.linear_q_up_proj.weight");
  } else {
    k.push_back("self_attention.linear_q_proj.weight");
  }
  k.push_back("self_attention.linear_kv_down_proj.weight");
  norm("kv_layernorm");
  k.push_back("self_attention.linear_kv_up_proj.weight");
}

}  // namespace

std::vector<std::string> attention_half_param_keys(const TransformerConfig& c) {
  const bool ln = c.normalization == "LayerNorm";
  std::vector<std::string> k = {"input_layernorm.weight"};
  if (ln) k.push_back("input_layernorm.bias");
  if (c.multi_latent_attention) {
    add_mla_param_keys(c, ln, k);
  } else {
    k.push_back("self_attention.linear_qkv.weight");
    if (c.add_bias_linear || c.add_qkv_bias) k.push_back("self_attention.linear_qkv.bias");
    if (c.qk_layernorm) {
      k.push_back("self_attention.q_layernorm.weight");
      if (ln) k.push_back("self_attention.q_layernorm.bias");
      k.push_back("self_attention.k_layernorm.weight");
      if (ln) k.push_back("self_attention.k_layernorm.bias");
    }
  }
  k.push_back("self_attention.linear_proj.weight");
  if (c.add_bias_linear) k.push_back("self_attention.linear_proj.bias");
  k.push_back("pre_mlp_layernorm.weight");
  if (ln) k.push_back("pre_mlp_layernorm.bias");
  return k;
}

std::map<std::string, Shape> attention_half_param_shapes(const TransformerConfig& c) {
  const std::int64_t h = c.hidden_size, np = c.num_attention_heads, ng = c.query_groups(), hn = c.head_dim();
  if (c.multi_latent_attention) {
    const std::int64_t ql = c.q_lora_rank.value_or(0), kvl = c.kv_lora_rank, qh = c.qk_head_dim + c.qk_pos_emb_head_dim;
    return {{"input_layernorm.weight", {h}},
            {"input_layernorm.bias", {h}},
            {"self_attention.linear_q_down_proj.weight", {ql, h}},
            {"self_attention.q_layernorm.weight", {ql}},
            {"self_attention.q_layernorm.bias", {ql}},
            {"self_attention.linear_q_up_proj.weight", {np * qh, ql}},
            {"self_attention.linear_q_proj.weight", {np * qh, h}},
            {"self_attention.linear_kv_down_proj.weight", {kvl + c.qk_pos_emb_head_dim, h}},
            {"self_attention.kv_layernorm.weight", {kvl}},
            {"self_attention.kv_layernorm.bias", {kvl}},
            {"self_attention.linear_kv_up_proj.weight", {np * (c.qk_head_dim + c.v_head_dim), kvl}},
            {"self_attention.linear_proj.weight", {h, np * c.v_head_dim}},
            {"self_attention.linear_proj.bias", {h}},
            {"pre_mlp_layernorm.weight", {h}},
            {"pre_mlp_layernorm.bias", {h}}};
  }
  const std::int64_t qkv_rows = (np + 2 * ng) * hn;
  return {{"input_layernorm.weight", {h}},
          {"input_layernorm.bias", {h}},
          {"self_attention.linear_qkv.weight", {qkv_rows, h}},
          {"self_attention.linear_qkv.bias", {qkv_rows}},
          {"self_attention.q_layernorm.weight", {hn}},
          {"self_attention.q_layernorm.bias", {hn}},
          {"self_attention.k_layernorm.weight", {hn}},
          {"self_attention.k_layernorm.bias", {hn}},
          {"self_attention.linear_proj.weight", {h, np * hn}},
          {"self_attention.linear_proj.bias", {h}},
          {"pre_mlp_layernorm.weight", {h}},
          {"pre_mlp_layernorm.bias", {h}}};
}

AttentionScaling attention_scaling(const TransformerConfig& c, int layer_number) {
  AttentionScaling a;
  double scale = c.multi_latent_attention ? mla_softmax_scale(c)
                 : c.softmax_scale        ? *c.softmax_scale
                                          : 1.0 / std::sqrt(static_cast<double>(c.head_dim()));
  if (c.apply_query_key_layer_scaling) {
    a.coeff = static_cast<float>(std::max(1, layer_number));
    scale /= std::max(1, layer_number);
  }
  a.alpha = static_cast<float>(scale);
  a.softmax_fp32 = !(c.fp16 || c.bf16) || c.attention_softmax_in_fp32 || c.apply_query_key_layer_scaling;
  return a;
}

void plan_attention_half(RankPlan& p, const TransformerConfig& c, int layer_number) {
  p.h = c.hidden_size;
  p.np = c.num_attention_heads;
  p.ng = c.query_groups();
  p.hn = c.head_dim();
  p.dt = params_dtype(c);
  p.rms = c.normalization != "LayerNorm";
  p.eps = c.layernorm_epsilon;
  p.zero_centered_gamma = c.layernorm_zero_centered_gamma;
  p.qk_layernorm = c.qk_layernorm;
  p.glu = c.gated_linear_unit;
  p.act = act_from_name(c.activation_func);
  // Megatron-Core's TransformerLayer reads neither apply_residual_connection_post_layernorm nor
  // fp32_residual_connection at this commit (reference/transformer_layer.h): the residual is
  // always the layer input, in the params dtype.
  p.post_ln_residual = false;
  const AttentionScaling a = attention_scaling(c, layer_number);
  p.alpha = a.alpha;
  p.coeff = a.coeff;
  p.softmax_fp32 = a.softmax_fp32;
  p.hidden_dropout = c.hidden_dropout;
  p.attention_dropout = c.attention_dropout;
  p.mla = MlaShape{};
  if (c.multi_latent_attention) {
    // the core attention's heads: np key heads (k_pos_emb expanded), of the query's head dim
    p.mla.on = true;
    p.mla.q_lora = c.q_lora_rank.value_or(0);
    p.mla.kv_lora = c.kv_lora_rank;
    p.mla.qk = c.qk_head_dim;
    p.mla.pe = c.qk_pos_emb_head_dim;
    p.mla.v = c.v_head_dim;
    p.mla.rope_mscale = static_cast<float>(mla_rope_mscale(c));
    p.mla.yarn = c.rope_type == "yarn";
    p.ng = p.np;
    p.hn = p.mla.q_head();
  }
}

void add_attention_half_buffers(BufferArena& arena, rt::Device& dev, RankPlan& p) {
  const std::int64_t tok = std::int64_t(p.s) * p.b, tok_l = std::int64_t(p.s_local()) * p.b;
  const bool partial = p.tp > 1;
  p.ln1 = arena.add(dev, "ln1", p.dt, tok_l, p.h);
  p.ln1_full = p.sp ? arena.add(dev, "ln1_full", p.dt, tok, p.h) : p.ln1;
  p.ctx = arena.add(dev, "ctx", p.dt, tok, p.ctx_width());
  p.mla_acts = MlaActivations{};
  if (!p.mla.on) {
    p.qkv = arena.add(dev, "qkv", p.dt, tok, p.qkv_width());
  } else {
    const MlaShape& m = p.mla;
    MlaActivations& a = p.mla_acts;
    const std::int64_t np_l = p.np_local(), qh = m.q_head();
    p.qkv = nullptr;
    if (m.q_lora) {
      a.q_compressed = arena.add(dev, "q_compressed", p.dt, tok, m.q_lora);
      a.q_normed = p.qk_layernorm ? arena.add(dev, "q_normed", p.dt, tok, m.q_lora) : a.q_compressed;
    }
    a.kv_combined = arena.add(dev, "kv_combined", p.dt, tok, m.kv_width());
    a.kv_normed = p.qk_layernorm ? arena.add(dev, "kv_normed", p.dt, tok, m.kv_width()) : a.kv_combined;
    a.query = arena.add(dev, "query", p.dt, tok, np_l, qh);
    a.kv = arena.add(dev, "kv", p.dt, tok, np_l, m.qk + m.v);
    a.key_value = arena.add(dev, "key_value", p.dt, tok, np_l, 2 * qh);
    a.context = arena.add(dev, "context", p.dt, tok, np_l, qh);
  }
  p.proj_partial = partial ? arena.add(dev, "proj_partial", p.dt, tok, p.h) : nullptr;
  p.proj = arena.add(dev, "proj", p.dt, tok_l, p.h);
  p.h1 = arena.add(dev, "h1", p.dt, tok_l, p.h);
  p.ln2 = arena.add(dev, "ln2", p.dt, tok_l, p.h);
  p.ln2_full = p.sp ? arena.add(dev, "ln2_full", p.dt, tok, p.h) : p.ln2;
  p.out = arena.add(dev, "out", p.dt, tok_l, p.h);
}

void add_attention_half_grad_scratch(BufferArena& arena, rt::Device& dev, const RankPlan& p, RankGrads& g) {
  const std::int64_t n = std::int64_t(p.s) * p.b;
  g.d_ctx = arena.add(dev, "d_ctx", p.dt, n, p.ctx_width());
  g.mla = MlaGradScratch{};
  if (!p.mla.on) {
    g.d_qkv = arena.add(dev, "d_qkv", p.dt, n, p.qkv_width());
    g.d_qkv_pre = p.qk_layernorm ? arena.add(dev, "d_qkv_pre", p.dt, n, p.qkv_width()) : nullptr;
    return;
  }
  const MlaShape& m = p.mla;
  MlaGradScratch& d = g.mla;
  const std::int64_t np_l = p.np_local(), qh = m.q_head();
  g.d_qkv = g.d_qkv_pre = nullptr;
  d.d_context = arena.add(dev, "d_context", p.dt, n, np_l, qh);
  d.d_query = arena.add(dev, "d_query", p.dt, n, np_l, qh);
  d.d_key_value = arena.add(dev, "d_key_value", p.dt, n, np_l, 2 * qh);
  d.d_kv = arena.add(dev, "d_kv", p.dt, n, np_l, m.qk + m.v);
  if (m.q_lora) {
    d.d_q_normed = arena.add(dev, "d_q_normed", p.dt, n, m.q_lora);
    d.d_q_compressed = p.qk_layernorm ? arena.add(dev, "d_q_compressed", p.dt, n, m.q_lora) : d.d_q_normed;
  }
  d.d_kv_latent = arena.add(dev, "d_kv_latent", p.dt, n, m.kv_width());
  d.d_kv_combined = p.qk_layernorm ? arena.add(dev, "d_kv_combined", p.dt, n, m.kv_width()) : d.d_kv_latent;
}

AttentionInputs check_attention_inputs(const std::string& who, const Tensor& hidden_states, DType dt, int h, int np,
                                       int hn, const Tensor* attention_mask, const Tensor* rotary_pos_emb) {
  if (hidden_states.dim() != 3 || hidden_states.size(2) != h)
    throw ShapeError(who + ": hidden_states expected [s, b, " + std::to_string(h) + "], got " +
                     shape_str(hidden_states.shape()));
  if (hidden_states.dtype() != dt)
    throw ShapeError(who + ": hidden_states dtype " + dtype_name(hidden_states.dtype()) +
                     " differs from the params dtype " + dtype_name(dt));
  AttentionInputs in;
  in.s = static_cast<int>(hidden_states.size(0));
  in.b = static_cast<int>(hidden_states.size(1));
  if (in.s <= 0 || in.b <= 0) throw ShapeError(who + ": empty hidden_states " + shape_str(hidden_states.shape()));
  const std::string s = std::to_string(in.s);
  if (attention_mask) {
    const Shape& ms = attention_mask->shape();
    const bool ok = attention_mask->dtype() == DType::BOOL && ms.size() == 4 && (ms[0] == 1 || ms[0] == in.b) &&
                    (ms[1] == 1 || ms[1] == np) && ms[2] == in.s && ms[3] == in.s;
    if (!ok)
      throw ShapeError(who + ": attention_mask expected BOOL [" + std::to_string(in.b) + ", 1, " + s + ", " + s +
                       "] (dims 0/1 may be 1/np), got " + attention_mask->describe());
    in.mask_b = static_cast<int>(ms[0]);
    in.mask_h = static_cast<int>(ms[1]);
  }
  if (rotary_pos_emb) {
    const Shape& rs = rotary_pos_emb->shape();
    if (rs.size() != 4 || rs[0] != in.s || rs[1] != 1 || rs[2] != 1 || rotary_pos_emb->dtype() != DType::F32)
      throw ShapeError(who + ": rotary_pos_emb expected F32 [" + s + ", 1, 1, rot_dim], got " +
                       rotary_pos_emb->describe());
    in.rot = static_cast<int>(rs[3]);
    if (in.rot <= 0 || in.rot % 2 || in.rot > hn)
      throw ShapeError(who + ": rot_dim " + std::to_string(in.rot) + " must be even, > 0 and <= kv_channels " +
                       std::to_string(hn));
  }
  return in;
}

AttentionInputsWithAngles check_attention_inputs(const std::string& who, const TransformerConfig& c,
                                                 const Tensor& hidden_states, const Tensor* attention_mask,
                                                 const Tensor* rotary_pos_emb) {
  const bool mla = c.multi_latent_attention;
  if (mla && rotary_pos_emb)
    throw ConfigError(who +
                      ": multi-latent attention computes its own rotary embedding: rotary_pos_emb must not be "
                      "given");
  AttentionInputsWithAngles in;
  static_cast<AttentionInputs&>(in) =
      check_attention_inputs(who, hidden_states, params_dtype(c), c.hidden_size, c.num_attention_heads,
                             mla ? c.qk_pos_emb_head_dim : c.head_dim(), attention_mask, rotary_pos_emb);
  if (mla) {
    in.angles = mla_rotary_pos_emb(c, in.s).emb;  // [s, 1, 1, rot]: rot < pe with rotary_percent < 1
    in.rot = static_cast<int>(in.angles.size(3));
  } else if (rotary_pos_emb) {
    in.angles = *rotary_pos_emb;
  }
  return in;
}

bool set_forward_streams(RankPlan& p, const ForwardOptions& fo, MaskMode mask_mode, int mask_b, int mask_h) {
  const std::uint64_t attention = dropout_offset(fo.offset, DropoutSite::SelfAttention);
  const bool changed = p.training != fo.training || p.seed != fo.seed || p.offset_attention != attention ||
                       p.mask_mode != mask_mode || p.mask_b != mask_b || p.mask_h != mask_h;
  p.training = fo.training;
  p.seed = fo.seed;
  p.offset_attention = attention;
  p.offset_self_attn_bda = dropout_offset(fo.offset, DropoutSite::SelfAttnBda);
  p.offset_mlp_bda = dropout_offset(fo.offset, DropoutSite::MlpBda);
  p.mask_mode = mask_mode;
  p.mask_b = mask_b;
  p.mask_h = mask_h;
  return changed;
}

std::pair<Tensor, Tensor> qk_layernorm_taps(const Tensor& qkv, std::int64_t S, std::int64_t B, int ng, int hpg,
                                            int hn) {
  const DType dt = qkv.dtype();
  const std::size_t head = std::size_t(hn) * dtype_size(dt), group = std::size_t(hpg + 2) * head;
  Tensor q = Tensor::empty(dt, {S, B, std::int64_t(ng) * hpg, hn}), k = Tensor::empty(dt, {S, B, ng, hn});
  for (std::int64_t t = 0; t < S * B; ++t)
    for (int g = 0; g < ng; ++g) {
      const std::byte* grp = qkv.raw() + (std::size_t(t) * ng + std::size_t(g)) * group;
      std::memcpy(q.raw_mut() + (std::size_t(t) * ng * hpg + std::size_t(g) * hpg) * head, grp, hpg * head);
      std::memcpy(k.raw_mut() + (std::size_t(t) * ng + g) * head, grp + hpg * head, head);
    }
  return {std::move(q), std::move(k)};
}

void RankTapRecorder::add(std::string name, Tensor value, ShardLayout layout, Tensor block_magnitude) {
  progress::done(name);
  taps.push_back({std::move(name), std::move(value), rounding_now(), layout, std::move(block_magnitude)});
}

Tensor RankTapRecorder::core_attention_magnitudes() const {
  if (!p.softmax_stats) throw std::logic_error("core_attention tap: the forward kept no softmax statistics");
  const std::int64_t S = p.s, B = p.b;
  const Tensor stats = download(p.softmax_stats, DType::F32, {B, p.np_local(), S, 2});  // (m, l) per row
  // v: the last v columns of each MLA head [qk | v], or of each query group [q heads | k | v]
  const std::int64_t groups = p.mla.on ? p.np_local() : p.ng_local();
  const std::int64_t width = p.mla.on ? p.mla.qk + p.mla.v : std::int64_t(p.hpg() + 2) * p.hn;
  const std::int64_t v0 = p.mla.on ? p.mla.qk : std::int64_t(p.hpg() + 1) * p.hn;
  return core_attention_error_magnitudes(stats, p.s, get(p.mla.on ? p.mla_acts.kv : p.qkv, {S, B, groups, width}), v0,
                                         p.training ? p.attention_dropout : 0.0);
}

void RankTapRecorder::bias(const std::string& name, const std::string& key) {
  if (full.count(key)) taps.push_back({name, full.at(key).clone(), RoundingCount{}, ShardLayout{}});
}

void RankTapRecorder::row_parallel(const void* y, const std::string& module, const std::string& linear) {
  const ShardLayout seq_layout = p.sp ? ShardLayout{0, 1} : ShardLayout{};
  const Tensor out = get(y, {p.s_local(), p.b, p.h});
  const std::string bias_key = module + "." + linear + ".bias";
  add(module + "." + linear + ".0", out, seq_layout);
  bias(module + "." + linear + ".1", bias_key);
  add(module + ".0", out, seq_layout);
  bias(module + ".1", bias_key);
}

bool RankTapRecorder::attention_half(TapPoint t) {
  const std::int64_t S = p.s, S_l = p.s_local(), B = p.b, H = p.h;
  const ShardLayout seq_layout = p.sp ? ShardLayout{0, 1} : ShardLayout{}, heads{2, 1};
  switch (t) {
    case TapPoint::InputLayernorm:
      add("input_layernorm", get(p.ln1, {S_l, B, H}), seq_layout);
      return true;
    case TapPoint::LinearQkv:
      add("self_attention.linear_qkv.0", get(p.qkv, {S, B, p.qkv_width()}), heads);
      return true;
    case TapPoint::QkLayernorm: {
      auto [q, k] = qk_layernorm_taps(get(p.qkv, {S * B, p.qkv_width()}), S, B, p.ng_local(), p.hpg(), p.hn);
      add("self_attention.q_layernorm", std::move(q), heads);
      add("self_attention.k_layernorm", std::move(k), heads);
      return true;
    }
    case TapPoint::CoreAttention:
      add("self_attention.core_attention", get(p.ctx, {S, B, p.ctx_width()}), heads, core_attention_magnitudes());
      return true;
    case TapPoint::LinearProj:
      row_parallel(p.proj, "self_attention", "linear_proj");
      return true;
    case TapPoint::PreMlpLayernorm:
      add("pre_mlp_layernorm", get(p.ln2, {S_l, B, H}), seq_layout);
      return true;
    default:
      return mla(t);
  }
}

bool RankTapRecorder::mla(TapPoint t) {
  const MlaShape& m = p.mla;
  const MlaActivations& a = p.mla_acts;
  const std::int64_t S = p.s, B = p.b, np_l = p.np_local();
  const ShardLayout whole{}, heads{2, 1};
  const std::string sa = "self_attention.";
  switch (t) {
    case TapPoint::MlaRotaryPosEmb: {
      // the module's output: the angles (YaRN's is a tuple (angles, mscale): .0)
      add(sa + (m.yarn ? "rotary_pos_emb.0" : "rotary_pos_emb"),
          download(p.freqs, DType::F32, {S, p.rot_dim}).reshape({S, 1, 1, p.rot_dim}), whole);
      return true;
    }
    case TapPoint::MlaQDownProj:
      add(sa + "linear_q_down_proj.0", get(a.q_compressed, {S, B, m.q_lora}), whole);
      return true;
    case TapPoint::MlaQLayernorm:
      add(sa + "q_layernorm", get(a.q_normed, {S, B, m.q_lora}), whole);
      return true;
    case TapPoint::MlaQUpProj:
      add(sa + (m.q_lora ? "linear_q_up_proj.0" : "linear_q_proj.0"), get(a.query, {S, B, np_l * m.q_head()}), heads);
      return true;
    case TapPoint::MlaKvDownProj:
      add(sa + "linear_kv_down_proj.0", get(a.kv_combined, {S, B, m.kv_width()}), whole);
      return true;
    case TapPoint::MlaKvLayernorm:
      add(sa + "kv_layernorm",
          take_cols(get(a.kv_normed, {S * B, m.kv_width()}), 0, m.kv_lora).reshape({S, B, m.kv_lora}), whole);
      return true;
    case TapPoint::MlaKvUpProj:
      add(sa + "linear_kv_up_proj.0", get(a.kv, {S, B, np_l * (m.qk + m.v)}), heads);
      return true;
    default:
      return false;
  }
}

}  // namespace twin::opt
