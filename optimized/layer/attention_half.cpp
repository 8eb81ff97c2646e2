#include "optimized/layer/attention_half.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/dropout_site.h"

namespace twin::opt {

std::vector<std::string> attention_half_param_keys(const TransformerConfig& c) {
  const bool ln = c.normalization == "LayerNorm";
  std::vector<std::string> k = {"input_layernorm.weight"};
  if (ln) k.push_back("input_layernorm.bias");
  k.push_back("self_attention.linear_qkv.weight");
  if (c.add_bias_linear || c.add_qkv_bias) k.push_back("self_attention.linear_qkv.bias");
  if (c.qk_layernorm) {
    k.push_back("self_attention.q_layernorm.weight");
    if (ln) k.push_back("self_attention.q_layernorm.bias");
    k.push_back("self_attention.k_layernorm.weight");
    if (ln) k.push_back("self_attention.k_layernorm.bias");
  }
  k.push_back("self_attention.linear_proj.weight");
  if (c.add_bias_linear) k.push_back("self_attention.linear_proj.bias");
  k.push_back("pre_mlp_layernorm.weight");
  if (ln) k.push_back("pre_mlp_layernorm.bias");
  return k;
}

std::map<std::string, Shape> attention_half_param_shapes(std::int64_t h, std::int64_t np, std::int64_t ng,
                                                         std::int64_t hn) {
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
  double scale = c.softmax_scale ? *c.softmax_scale : 1.0 / std::sqrt(static_cast<double>(c.head_dim()));
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
}

void add_attention_half_buffers(BufferArena& arena, rt::Device& dev, RankPlan& p) {
  const std::int64_t tok = std::int64_t(p.s) * p.b, tok_l = std::int64_t(p.s_local()) * p.b;
  const bool partial = p.tp > 1;
  p.ln1 = arena.add(dev, "ln1", p.dt, tok_l, p.h);
  p.ln1_full = p.sp ? arena.add(dev, "ln1_full", p.dt, tok, p.h) : p.ln1;
  p.qkv = arena.add(dev, "qkv", p.dt, tok, p.qkv_width());
  p.ctx = arena.add(dev, "ctx", p.dt, tok, p.np_local(), p.hn);
  p.proj_partial = partial ? arena.add(dev, "proj_partial", p.dt, tok, p.h) : nullptr;
  p.proj = arena.add(dev, "proj", p.dt, tok_l, p.h);
  p.h1 = arena.add(dev, "h1", p.dt, tok_l, p.h);
  p.ln2 = arena.add(dev, "ln2", p.dt, tok_l, p.h);
  p.ln2_full = p.sp ? arena.add(dev, "ln2_full", p.dt, tok, p.h) : p.ln2;
  p.out = arena.add(dev, "out", p.dt, tok_l, p.h);
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

void RankTapRecorder::add(std::string name, Tensor value, ShardLayout layout) {
  taps.push_back({std::move(name), std::move(value), rounding_now(), layout});
}

void RankTapRecorder::bias(const std::string& name, const std::string& key) {
  if (full.count(key)) taps.push_back({name, full.at(key).clone(), RoundingCount{}, ShardLayout{}});
}

void RankTapRecorder::row_parallel(const void* y, const std::string& module, const std::string& linear) {
  const ShardLayout seq_layout = p.sp ? ShardLayout{0, 1} : ShardLayout{};
  const Tensor out = download(y, {p.s_local(), p.b, p.h});
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
      add("input_layernorm", download(p.ln1, {S_l, B, H}), seq_layout);
      return true;
    case TapPoint::LinearQkv:
      add("self_attention.linear_qkv.0", download(p.qkv, {S, B, p.qkv_width()}), heads);
      return true;
    case TapPoint::QkLayernorm: {
      auto [q, k] = qk_layernorm_taps(download(p.qkv, {S * B, p.qkv_width()}), S, B, p.ng_local(), p.hpg(), p.hn);
      add("self_attention.q_layernorm", std::move(q), heads);
      add("self_attention.k_layernorm", std::move(k), heads);
      return true;
    }
    case TapPoint::CoreAttention:
      add("self_attention.core_attention", download(p.ctx, {S, B, std::int64_t(p.np_local()) * p.hn}), heads);
      return true;
    case TapPoint::LinearProj:
      row_parallel(p.proj, "self_attention", "linear_proj");
      return true;
    case TapPoint::PreMlpLayernorm:
      add("pre_mlp_layernorm", download(p.ln2, {S_l, B, H}), seq_layout);
      return true;
    default:
      return false;
  }
}

}  // namespace twin::opt
