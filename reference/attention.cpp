#include "reference/attention.h"

#include <cmath>

#include "core/progress.h"
#include "reference/rotary_pos_embedding.h"

namespace twin::reference {

namespace {
std::string dims(std::initializer_list<std::int64_t> d) { return shape_str(Shape(d)); }

int checked_groups(const TransformerConfig& c) {
  const int np = c.num_attention_heads, ng = c.query_groups();
  if (np <= 0) throw ConfigError("num_attention_heads must be positive, got " + std::to_string(np));
  if (ng <= 0 || np % ng != 0)
    throw ConfigError("num_attention_heads (" + std::to_string(np) + ") must be divisible by num_query_groups (" +
                      std::to_string(ng) + ")");
  if (c.head_dim() <= 0) throw ConfigError("kv_channels must be positive, got " + std::to_string(c.head_dim()));
  return ng;
}

int qkv_out_dim(const TransformerConfig& c) {
  const int ng = checked_groups(c), np = c.num_attention_heads, hn = c.head_dim();
  int out = np * hn + 2 * ng * hn;  // query_projection_size + 2 * kv_projection_size
  if (c.attention_output_gate) out += hn * np;
  return out;
}
}  // namespace

void record_output(const Taps& taps, AttentionOutput& out, int s, int b, const Precision& p) {
  if (!taps.enabled()) return;
  for (const std::string name : {"linear_proj.", ""}) {
    out.output = taps.record(name + "0", out.output, {s, b, out.output.cols()}, p);
    if (out.bias) taps.record_param(name + "1", p.to_tensor(*out.bias, {static_cast<std::int64_t>(out.bias->size())}));
  }
}

int qkv_row_offset(int num_heads, int num_query_groups, int head_dim, int group, int part) {
  const int r = num_heads / num_query_groups;
  return (group * (r + 2) + part) * head_dim;
}

// ---- SelfAttention -----------------------------------------------------------------------------
SelfAttention::SelfAttention(const TransformerConfig& config, const SelfAttentionSubmodules& submodules,
                             int layer_number, AttnMaskType attn_mask_type, Precision p)
    : linear_qkv(config.hidden_size, qkv_out_dim(config), config.add_bias_linear || config.add_qkv_bias,
                 /*skip_bias_add=*/false, p),
      core_attention(config, layer_number, attn_mask_type, p),
      linear_proj(config.num_attention_heads * config.head_dim(), config.hidden_size, config.add_bias_linear,
                  /*skip_bias_add=*/true, p),
      np_(config.num_attention_heads),
      ng_(config.query_groups()),
      hn_(config.head_dim()),
      hidden_(config.hidden_size),
      output_gate_(config.attention_output_gate),
      rotary_interleaved_(config.rotary_interleaved),
      p_(p) {
  if (submodules.q_layernorm) q_layernorm = submodules.q_layernorm(config, hn_, config.layernorm_epsilon, p);
  if (submodules.k_layernorm) k_layernorm = submodules.k_layernorm(config, hn_, config.layernorm_epsilon, p);
}

void SelfAttention::load_state_dict(const StateDict& sd, const std::string& prefix) {
  linear_qkv.load_state_dict(sd, prefix + "linear_qkv.");
  if (q_layernorm) q_layernorm->load_state_dict(sd, prefix + "q_layernorm.");
  if (k_layernorm) k_layernorm->load_state_dict(sd, prefix + "k_layernorm.");
  core_attention.load_state_dict(sd, prefix + "core_attention.");
  linear_proj.load_state_dict(sd, prefix + "linear_proj.");
}

SelfAttention::QKV SelfAttention::get_query_key_value_tensors(const Mat& hidden_states, const AttentionArgs& a,
                                                              const Taps& taps, SelfAttentionSaved* saved) const {
  // Attention heads [sq, b, h] --> [sq, b, ng * (np/ng + 2) * hn]
  const OutputWithBias qkv = linear_qkv.forward(hidden_states, saved ? &saved->linear_qkv : nullptr);
  const Mat mixed_qkv = taps.record("linear_qkv.0", qkv.output, {a.s, a.b, qkv.output.cols()}, p_);

  const int r = np_ / ng_;  // num_query_heads_per_group
  const int per_group = (output_gate_ ? 2 * r + 2 : r + 2) * hn_;
  const Eigen::Index tokens = static_cast<Eigen::Index>(a.s) * a.b;
  QKV out;
  out.query.resize(tokens * np_, hn_);  // [sq, b, np, hn]
  out.key.resize(tokens * ng_, hn_);    // [sq, b, ng, hn]
  out.value.resize(tokens * ng_, hn_);
  if (output_gate_) out.gate = Mat(tokens * np_, hn_);
  // [sq, b, ng, per_group] split into [query (r heads) | gate (r heads) | key | value]
  for (Eigen::Index t = 0; t < tokens; ++t) {
    for (int g = 0; g < ng_; ++g) {
      const Eigen::Index base = static_cast<Eigen::Index>(g) * per_group;
      int col = 0;
      for (int i = 0; i < r; ++i, col += hn_)
        out.query.row(t * np_ + g * r + i) = mixed_qkv.row(t).segment(base + col, hn_);
      if (output_gate_)
        for (int i = 0; i < r; ++i, col += hn_)
          out.gate->row(t * np_ + g * r + i) = mixed_qkv.row(t).segment(base + col, hn_);
      out.key.row(t * ng_ + g) = mixed_qkv.row(t).segment(base + col, hn_);
      col += hn_;
      out.value.row(t * ng_ + g) = mixed_qkv.row(t).segment(base + col, hn_);
    }
  }
  // q and k are parallel branches from linear_qkv: neither inherits the other's roundings.
  const RoundingCount at_split = rounding_now();
  if (saved) {
    saved->query_pre_norm = out.query;
    saved->key_pre_norm = out.key;
  }
  if (q_layernorm) {
    const double magnitude = taps.enabled() ? q_layernorm->error_magnitude(out.query) : -1.0;
    out.query = taps.record("q_layernorm", q_layernorm->forward(out.query), {a.s, a.b, np_, hn_}, p_);
    taps.set_magnitude(magnitude);
  }
  const RoundingCount query_path = rounding_now();
  rounding_set(at_split);
  if (k_layernorm) {
    const double magnitude = taps.enabled() ? k_layernorm->error_magnitude(out.key) : -1.0;
    out.key = taps.record("k_layernorm", k_layernorm->forward(out.key), {a.s, a.b, ng_, hn_}, p_);
    taps.set_magnitude(magnitude);
  }
  rounding_join(query_path);
  return out;
}

AttentionOutput SelfAttention::forward(const Mat& hidden_states, const AttentionArgs& a, const Taps& taps) {
  return forward(hidden_states, a, taps, nullptr);
}

AttentionOutput SelfAttention::forward(const Mat& hidden_states, const AttentionArgs& a, const Taps& taps,
                                       SelfAttentionSaved* saved) {
  if (hidden_states.rows() != static_cast<Eigen::Index>(a.s) * a.b || hidden_states.cols() != hidden_)
    throw ShapeError("SelfAttention: hidden_states expected shape " + dims({a.s, a.b, hidden_}) + ", got " +
                     std::to_string(hidden_states.rows()) + " x " + std::to_string(hidden_states.cols()) + " rows");
  QKV qkv = get_query_key_value_tensors(hidden_states, a, taps, saved);

  if (a.rotary_pos_emb) {
    const Mat freqs = rotary_freqs(*a.rotary_pos_emb, a.s, hn_);  // [s, rot_dim]
    const RopeTables tables = rope_tables(freqs, p_);
    qkv.query = apply_rotary_pos_emb(qkv.query, tables, a.b * np_, rotary_interleaved_, p_);
    qkv.key = apply_rotary_pos_emb(qkv.key, tables, a.b * ng_, rotary_interleaved_, p_);
    p_.count_act(3);  // t * cos_, _rotate_half(t) * sin_, sum: on q and on k alike
    if (saved) saved->freqs = freqs;
  }
  if (saved) {
    saved->query = qkv.query;
    saved->key = qkv.key;
    saved->value = qkv.value;
  }

  Mat core_attn_out = core_attention.forward(qkv.query, qkv.key, qkv.value, a.s, a.s, a.b, a.attention_mask, a.training,
                                             a.rng);  // [sq, b, np * hn]
  core_attn_out = taps.record("core_attention", core_attn_out, {a.s, a.b, core_attn_out.cols()}, p_);
  if (taps.enabled())  // its error scales with the softmax's inputs too (core/attention_bound.h)
    taps.set_block_magnitude(
        core_attention.error_magnitudes(qkv.query, qkv.key, qkv.value, a.s, a.s, a.b, a.attention_mask, a.training));

  if (qkv.gate) {  // _apply_output_gate: x * sigmoid(gate.float()), back to x's dtype
    for (Eigen::Index t = 0; t < core_attn_out.rows(); ++t)
      for (Eigen::Index c = 0; c < core_attn_out.cols(); ++c) {
        const double gate = (*qkv.gate)(t * np_ + c / hn_, c % hn_);
        const double sig = p_.f32(1.0 / (1.0 + std::exp(-gate)));         // rounds: sigmoid in fp32
        core_attn_out(t, c) = p_.act(p_.f32(core_attn_out(t, c) * sig));  // rounds: fp32 product, .to(x_dtype)
      }
    p_.count_f32();
    p_.count_act();
  }

  AttentionOutput out;
  static_cast<OutputWithBias&>(out) = linear_proj.forward(core_attn_out, saved ? &saved->linear_proj : nullptr);
  record_output(taps, out, a.s, a.b, p_);
  return out;
}

AttentionGrads SelfAttention::backward(const Mat& doutput, const SelfAttentionSaved& saved,
                                       const AttentionArgs& a) const {
  if (output_gate_)
    throw ConfigError("SelfAttention backward: the attention output gate's backward is not implemented");
  AttentionGrads g;
  progress::now("linear_proj");
  const LinearGrads proj = linear_proj.backward(doutput, saved.linear_proj);
  progress::now("core_attention");
  const CoreAttentionGrads core = core_attention.backward(proj.input, saved.query, saved.key, saved.value, a.s, a.s,
                                                          a.b, a.attention_mask, a.training, a.rng);
  Mat dquery = core.query, dkey = core.key;
  if (saved.freqs.size()) {
    dquery = apply_rotary_pos_emb_backward(dquery, saved.freqs, a.b * np_, rotary_interleaved_, p_);
    dkey = apply_rotary_pos_emb_backward(dkey, saved.freqs, a.b * ng_, rotary_interleaved_, p_);
  }
  ParamGrads norms;
  if (q_layernorm) {
    const NormGrads n = q_layernorm->backward(dquery, saved.query_pre_norm);
    dquery = n.input;
    add_param_grads(norms, "q_layernorm.", n);
  }
  if (k_layernorm) {
    const NormGrads n = k_layernorm->backward(dkey, saved.key_pre_norm);
    dkey = n.input;
    add_param_grads(norms, "k_layernorm.", n);
  }
  // The split's transpose: each head's gradient back into its rows of mixed_qkv.
  const int r = np_ / ng_;
  const int per_group = (r + 2) * hn_;
  const Eigen::Index tokens = static_cast<Eigen::Index>(a.s) * a.b;
  Mat dmixed(tokens, static_cast<Eigen::Index>(ng_) * per_group);  // [sq, b, ng * (np/ng + 2) * hn]
  for (Eigen::Index t = 0; t < tokens; ++t)
    for (int grp = 0; grp < ng_; ++grp) {
      const Eigen::Index base = static_cast<Eigen::Index>(grp) * per_group;
      int col = 0;
      for (int i = 0; i < r; ++i, col += hn_)
        dmixed.row(t).segment(base + col, hn_) = dquery.row(t * np_ + grp * r + i);
      dmixed.row(t).segment(base + col, hn_) = dkey.row(t * ng_ + grp);
      col += hn_;
      dmixed.row(t).segment(base + col, hn_) = core.value.row(t * ng_ + grp);
    }
  progress::now("linear_qkv");
  const LinearGrads qkv = linear_qkv.backward(dmixed, saved.linear_qkv);
  g.hidden_states = qkv.input;
  add_param_grads(g.params, "linear_qkv.", qkv);
  g.params.insert(g.params.end(), norms.begin(), norms.end());
  add_param_grads(g.params, "linear_proj.", proj);
  return g;
}

// ---- CrossAttention ----------------------------------------------------------------------------
CrossAttention::CrossAttention(const TransformerConfig& config, int layer_number, AttnMaskType attn_mask_type,
                               Precision p)
    : linear_q(config.hidden_size, config.num_attention_heads * config.head_dim(), config.add_bias_linear,
               /*skip_bias_add=*/false, p),
      linear_kv(config.hidden_size, 2 * config.query_groups() * config.head_dim(), config.add_bias_linear,
                /*skip_bias_add=*/false, p),
      core_attention(config, layer_number, attn_mask_type, p),
      linear_proj(config.num_attention_heads * config.head_dim(), config.hidden_size, config.add_bias_linear,
                  /*skip_bias_add=*/true, p),
      np_(config.num_attention_heads),
      hn_(config.head_dim()),
      hidden_(config.hidden_size),
      p_(p) {
  if (config.query_groups() != config.num_attention_heads)
    throw ConfigError("Group query attention is not currently supported in cross attention (num_query_groups " +
                      std::to_string(config.query_groups()) + " != num_attention_heads " +
                      std::to_string(config.num_attention_heads) + ")");
}

void CrossAttention::load_state_dict(const StateDict& sd, const std::string& prefix) {
  linear_q.load_state_dict(sd, prefix + "linear_q.");
  linear_kv.load_state_dict(sd, prefix + "linear_kv.");
  core_attention.load_state_dict(sd, prefix + "core_attention.");
  linear_proj.load_state_dict(sd, prefix + "linear_proj.");
}

AttentionOutput CrossAttention::forward(const Mat& hidden_states, const AttentionArgs& a, const Taps& taps) {
  if (!a.key_value_states) throw std::invalid_argument("CrossAttention: key_value_states cannot be None");
  const Tensor& kv = *a.key_value_states;
  if (kv.dim() != 3 || kv.size(1) != a.b || kv.size(2) != hidden_)
    throw ShapeError("CrossAttention: key_value_states expected shape " + dims({-1, a.b, hidden_}) +
                     " (sk, b, h), got " + shape_str(kv.shape()));
  const int sk = static_cast<int>(kv.size(0));
  return forward_mats(hidden_states, a.s, a.b,
                      to_mat(kv, static_cast<std::int64_t>(sk) * a.b, hidden_, "key_value_states"), sk,
                      a.attention_mask, a.training, a.rng, taps);
}

AttentionOutput CrossAttention::forward_mats(const Mat& hidden_states, int sq, int b, const Mat& key_value_states,
                                             int sk, const Tensor* attention_mask, bool training, const DropoutRng& rng,
                                             const Taps& taps, CrossAttentionSaved* saved) {
  if (hidden_states.rows() != static_cast<Eigen::Index>(sq) * b || hidden_states.cols() != hidden_)
    throw ShapeError("CrossAttention: hidden_states expected shape " + dims({sq, b, hidden_}));
  // Attention heads [sk, b, h] --> [sk, b, (np * 2 * hn)] --> [sk, b, np, 2 * hn] --> 2 x [sk, b, np, hn]
  const RoundingCount hidden_states_rounding = rounding_now();
  const OutputWithBias kv_out = linear_kv.forward(key_value_states, saved ? &saved->linear_kv : nullptr);
  const Mat mixed_kv = taps.record("linear_kv.0", kv_out.output, {sk, b, kv_out.output.cols()}, p_);
  // The query comes from hidden_states, not through linear_kv's tap (a no-op end to end, where the
  // count only grows; in isolation that tap reset it).
  rounding_join(hidden_states_rounding);
  const Eigen::Index kv_rows = static_cast<Eigen::Index>(sk) * b * np_;
  Mat key(kv_rows, hn_), value(kv_rows, hn_);
  for (Eigen::Index t = 0; t < static_cast<Eigen::Index>(sk) * b; ++t)
    for (int h = 0; h < np_; ++h) {
      key.row(t * np_ + h) = mixed_kv.row(t).segment(static_cast<Eigen::Index>(h) * 2 * hn_, hn_);
      value.row(t * np_ + h) = mixed_kv.row(t).segment(static_cast<Eigen::Index>(h) * 2 * hn_ + hn_, hn_);
    }
  // Attention head [sq, b, h] --> [sq, b, hp] --> [sq, b, np, hn]
  const OutputWithBias q_out = linear_q.forward(hidden_states, saved ? &saved->linear_q : nullptr);
  const Mat q = taps.record("linear_q.0", q_out.output, {sq, b, q_out.output.cols()}, p_);
  const Mat query = Eigen::Map<const Mat>(q.data(), static_cast<Eigen::Index>(sq) * b * np_, hn_);

  if (saved) {
    saved->query = query;
    saved->key = key;
    saved->value = value;
  }
  Mat core_attn_out = core_attention.forward(query, key, value, sq, sk, b, attention_mask, training, rng);
  core_attn_out = taps.record("core_attention", core_attn_out, {sq, b, core_attn_out.cols()}, p_);
  if (taps.enabled())  // its error scales with the softmax's inputs too (core/attention_bound.h)
    taps.set_block_magnitude(core_attention.error_magnitudes(query, key, value, sq, sk, b, attention_mask, training));

  AttentionOutput out;
  static_cast<OutputWithBias&>(out) = linear_proj.forward(core_attn_out, saved ? &saved->linear_proj : nullptr);
  record_output(taps, out, sq, b, p_);
  return out;
}

CrossAttentionGrads CrossAttention::backward(const Mat& doutput, const CrossAttentionSaved& saved, int sq, int sk,
                                             int b, const Tensor* attention_mask, bool training,
                                             const DropoutRng& rng) const {
  CrossAttentionGrads g;
  const LinearGrads proj = linear_proj.backward(doutput, saved.linear_proj);
  const CoreAttentionGrads core = core_attention.backward(proj.input, saved.query, saved.key, saved.value, sq, sk, b,
                                                          attention_mask, training, rng);
  // The (key, value) split's transpose: each head's gradients back into its rows of mixed_kv.
  const Eigen::Index kv_tokens = static_cast<Eigen::Index>(sk) * b;
  Mat dmixed_kv(kv_tokens, static_cast<Eigen::Index>(np_) * 2 * hn_);  // [sk, b, np * 2 * hn]
  for (Eigen::Index t = 0; t < kv_tokens; ++t)
    for (int h = 0; h < np_; ++h) {
      dmixed_kv.row(t).segment(static_cast<Eigen::Index>(h) * 2 * hn_, hn_) = core.key.row(t * np_ + h);
      dmixed_kv.row(t).segment(static_cast<Eigen::Index>(h) * 2 * hn_ + hn_, hn_) = core.value.row(t * np_ + h);
    }
  // The query's view [sq*b*np, hn] back to [sq*b, np*hn] (the same memory).
  const Mat dq =
      Eigen::Map<const Mat>(core.query.data(), static_cast<Eigen::Index>(sq) * b, static_cast<Eigen::Index>(np_) * hn_);
  const LinearGrads kv = linear_kv.backward(dmixed_kv, saved.linear_kv);
  const LinearGrads q = linear_q.backward(dq, saved.linear_q);
  g.hidden_states = q.input;
  g.key_value_states = kv.input;
  add_param_grads(g.params, "linear_q.", q);
  add_param_grads(g.params, "linear_kv.", kv);
  add_param_grads(g.params, "linear_proj.", proj);
  return g;
}

}  // namespace twin::reference
