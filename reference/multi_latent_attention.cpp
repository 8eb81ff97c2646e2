#include "reference/multi_latent_attention.h"

#include <cmath>

#include "reference/rotary_pos_embedding.h"
#include "core/rotary_embedding.h"

namespace twin::reference {

namespace {

std::string dims(std::initializer_list<std::int64_t> d) { return shape_str(Shape(d)); }

// The core attention sees np key heads (k_pos_emb is expanded to them): no query groups.
TransformerConfig without_query_groups(TransformerConfig c) {
  c.num_query_groups = c.num_attention_heads;
  return c;
}

void check_mla_config(const TransformerConfig& c) {
  if (c.num_attention_heads <= 0)
    throw ConfigError("num_attention_heads must be positive, got " + std::to_string(c.num_attention_heads));
  if (c.q_lora_rank && *c.q_lora_rank <= 0)
    throw ConfigError("q_lora_rank must be positive or None, got " + std::to_string(*c.q_lora_rank));
  for (const auto& [name, v] : {std::pair<const char*, int>{"kv_lora_rank", c.kv_lora_rank},
                                {"qk_head_dim", c.qk_head_dim},
                                {"qk_pos_emb_head_dim", c.qk_pos_emb_head_dim},
                                {"v_head_dim", c.v_head_dim}})
    if (v <= 0) throw ConfigError(std::string(name) + " must be positive, got " + std::to_string(v));
  if (c.rope_type != "rope" && c.rope_type != "yarn")
    throw ConfigError("rope_type: '" + c.rope_type + "' is not supported (rope, yarn)");
  if (c.rotary_interleaved) throw ConfigError("multi-latent attention's RoPE is not interleaved (rotary_interleaved)");
  if (c.attention_output_gate) throw ConfigError("attention_output_gate is not supported with multi-latent attention");
}

// _apply_rotary_pos_emb_bshd with multi_latent_attention: the rotated part t[..., :rot_dim] is
// reordered to its even then its odd channels before the (non-interleaved) rotation; the rest
// passes. A permutation: exact, its transpose in the backward.
Mat deinterleave(const Mat& t, Eigen::Index rot_dim) {
  Mat out = t;
  const Eigen::Index half = rot_dim / 2;
  for (Eigen::Index c = 0; c < half; ++c) {
    out.col(c) = t.col(2 * c);
    out.col(half + c) = t.col(2 * c + 1);
  }
  return out;
}
Mat deinterleave_transpose(const Mat& d, Eigen::Index rot_dim) {
  Mat out = d;
  const Eigen::Index half = rot_dim / 2;
  for (Eigen::Index c = 0; c < half; ++c) {
    out.col(2 * c) = d.col(c);
    out.col(2 * c + 1) = d.col(half + c);
  }
  return out;
}

}  // namespace

Mat mla_rope(const Mat& t, const RopeTables& tables, int rows_per_position, const Precision& p) {
  return apply_rotary_pos_emb(deinterleave(t, tables.cos_.cols()), tables, rows_per_position, false, p);
}
Mat mla_rope_backward(const Mat& d, const Mat& freqs, double mscale, int rows_per_position, const Precision& p) {
  return deinterleave_transpose(apply_rotary_pos_emb_backward(d, freqs, rows_per_position, false, p, mscale),
                                freqs.cols());
}

MLASelfAttention::MLASelfAttention(const TransformerConfig& config, const MLASelfAttentionSubmodules& submodules,
                                   int layer_number, AttnMaskType attn_mask_type, Precision p)
    : linear_kv_down_proj((check_mla_config(config), config.hidden_size),
                          config.kv_lora_rank + config.qk_pos_emb_head_dim, false, false, p),
      linear_kv_up_proj(config.kv_lora_rank, config.num_attention_heads * (config.qk_head_dim + config.v_head_dim),
                        false, false, p),
      core_attention(without_query_groups(config), layer_number, attn_mask_type, p, std::nullopt,
                     mla_softmax_scale(config), config.qk_head_dim + config.qk_pos_emb_head_dim, config.v_head_dim),
      linear_proj(config.num_attention_heads * config.v_head_dim, config.hidden_size, config.add_bias_linear,
                  /*skip_bias_add=*/true, p),
      config_(config),
      np_(config.num_attention_heads),
      hidden_(config.hidden_size),
      qk_(config.qk_head_dim),
      pe_(config.qk_pos_emb_head_dim),
      v_(config.v_head_dim),
      p_(p) {
  const int q_out = np_ * (qk_ + pe_);
  if (config.q_lora_rank) {
    linear_q_down_proj.emplace(hidden_, *config.q_lora_rank, false, false, p);
    linear_q_up_proj.emplace(*config.q_lora_rank, q_out, false, false, p);
    if (submodules.q_layernorm)
      q_layernorm = submodules.q_layernorm(config, *config.q_lora_rank, config.layernorm_epsilon, p);
  } else {
    linear_q_proj.emplace(hidden_, q_out, false, false, p);
  }
  if (submodules.kv_layernorm)
    kv_layernorm = submodules.kv_layernorm(config, config.kv_lora_rank, config.layernorm_epsilon, p);
}

void MLASelfAttention::load_state_dict(const StateDict& sd, const std::string& prefix) {
  if (linear_q_proj) linear_q_proj->load_state_dict(sd, prefix + "linear_q_proj.");
  if (linear_q_down_proj) linear_q_down_proj->load_state_dict(sd, prefix + "linear_q_down_proj.");
  if (linear_q_up_proj) linear_q_up_proj->load_state_dict(sd, prefix + "linear_q_up_proj.");
  linear_kv_down_proj.load_state_dict(sd, prefix + "linear_kv_down_proj.");
  linear_kv_up_proj.load_state_dict(sd, prefix + "linear_kv_up_proj.");
  if (q_layernorm) q_layernorm->load_state_dict(sd, prefix + "q_layernorm.");
  if (kv_layernorm) kv_layernorm->load_state_dict(sd, prefix + "kv_layernorm.");
  core_attention.load_state_dict(sd, prefix + "core_attention.");
  linear_proj.load_state_dict(sd, prefix + "linear_proj.");
}

// q_compressed = q_layernorm(linear_q_down_proj(x)); q = linear_q_up_proj(q_compressed), or
// linear_q_proj(x) without q_lora_rank. [s*b, h] -> [s*b*np, q_head_dim].
Mat MLASelfAttention::query_path(const Mat& x, const AttentionArgs& a, const Taps& taps,
                                 MLASelfAttentionSaved* saved) const {
  Mat q;
  if (linear_q_proj) {
    q = linear_q_proj->forward(x, saved ? &saved->linear_q_up_proj : nullptr).output;
    q = taps.record("linear_q_proj.0", q, {a.s, a.b, q.cols()}, p_);
  } else {
    Mat qc = linear_q_down_proj->forward(x, saved ? &saved->linear_q_down_proj : nullptr).output;
    qc = taps.record("linear_q_down_proj.0", qc, {a.s, a.b, qc.cols()}, p_);
    if (saved) saved->q_compressed = qc;
    if (q_layernorm) {
      const double magnitude = taps.enabled() ? q_layernorm->error_magnitude(qc) : -1.0;
      qc = taps.record("q_layernorm", q_layernorm->forward(qc), {a.s, a.b, qc.cols()}, p_);
      taps.set_magnitude(magnitude);
    }
    q = linear_q_up_proj->forward(qc, saved ? &saved->linear_q_up_proj : nullptr).output;
    q = taps.record("linear_q_up_proj.0", q, {a.s, a.b, q.cols()}, p_);
  }
  // [s*b, np * q_head_dim] viewed as [s*b*np, q_head_dim] (row-major: the same numbers)
  return Eigen::Map<const Mat>(q.data(), q.rows() * np_, qk_ + pe_);
}

// kv_combined = linear_kv_down_proj(x) split into kv_compressed and k_pos_emb; kv =
// linear_kv_up_proj(kv_layernorm(kv_compressed)) [s*b*np, qk_head_dim + v_head_dim].
MLASelfAttention::KV MLASelfAttention::key_value_path(const Mat& x, const AttentionArgs& a, const Taps& taps,
                                                      MLASelfAttentionSaved* saved) const {
  Mat kv_combined = linear_kv_down_proj.forward(x, saved ? &saved->linear_kv_down_proj : nullptr).output;
  kv_combined = taps.record("linear_kv_down_proj.0", kv_combined, {a.s, a.b, kv_combined.cols()}, p_);
  const int kvr = config_.kv_lora_rank;
  Mat kvc = kv_combined.leftCols(kvr);
  KV out;
  out.k_pos_emb = kv_combined.rightCols(pe_);
  if (saved) saved->kv_compressed = kvc;
  if (kv_layernorm) {
    const double magnitude = taps.enabled() ? kv_layernorm->error_magnitude(kvc) : -1.0;
    kvc = taps.record("kv_layernorm", kv_layernorm->forward(kvc), {a.s, a.b, kvr}, p_);
    taps.set_magnitude(magnitude);
  }
  Mat kv = linear_kv_up_proj.forward(kvc, saved ? &saved->linear_kv_up_proj : nullptr).output;
  kv = taps.record("linear_kv_up_proj.0", kv, {a.s, a.b, kv.cols()}, p_);
  out.kv = Eigen::Map<const Mat>(kv.data(), kv.rows() * np_, qk_ + v_);
  return out;
}

AttentionOutput MLASelfAttention::forward(const Mat& hidden_states, const AttentionArgs& a, const Taps& taps) {
  return forward(hidden_states, a, taps, nullptr);
}

AttentionOutput MLASelfAttention::forward(const Mat& hidden_states, const AttentionArgs& a, const Taps& taps,
                                          MLASelfAttentionSaved* saved) {
  if (hidden_states.rows() != static_cast<Eigen::Index>(a.s) * a.b || hidden_states.cols() != hidden_)
    throw ShapeError("MLASelfAttention: hidden_states expected shape " + dims({a.s, a.b, hidden_}) + ", got " +
                     std::to_string(hidden_states.rows()) + " x " + std::to_string(hidden_states.cols()) + " rows");
  if (a.rotary_pos_emb)
    throw ConfigError("MLASelfAttention computes its own rotary embedding: rotary_pos_emb must not be given");
  const Eigen::Index tokens = static_cast<Eigen::Index>(a.s) * a.b;

  // rotary_pos_emb: [s, 1, 1, rot_dim] angles, recorded as the module returns them (fp32).
  MlaRotaryEmbedding rope = mla_rotary_pos_emb(config_, a.s);
  rope.emb = taps.record(config_.rope_type == "yarn" ? "rotary_pos_emb.0" : "rotary_pos_emb", rope.emb);
  const Mat freqs = rotary_freqs(rope.emb, a.s, pe_);
  const RopeTables tables = rope_tables(freqs, p_, rope.mscale);
  auto count_rope = [&] {
    p_.count_act(3);                         // t * cos_, _rotate_half(t) * sin_, sum
    if (rope.mscale != 1.0) p_.count_f32();  // cos / sin times mscale
  };

  // The q path, then the kv path, both from x.
  const RoundingCount at_input = rounding_now();
  Mat query = query_path(hidden_states, a, taps, saved);  // [s*b*np, q_head_dim]
  query.rightCols(pe_) = mla_rope(query.rightCols(pe_), tables, a.b * np_, p_);
  count_rope();
  const RoundingCount query_end = rounding_now();
  rounding_set(at_input);
  KV kv = key_value_path(hidden_states, a, taps, saved);
  const Mat k_pos_emb = mla_rope(kv.k_pos_emb, tables, a.b, p_);  // [s*b, pe]: one head, expanded below
  count_rope();
  rounding_join(query_end);

  Mat key(tokens * np_, qk_ + pe_), value(tokens * np_, v_);
  for (Eigen::Index r = 0; r < key.rows(); ++r) {
    key.row(r) << kv.kv.row(r).head(qk_), k_pos_emb.row(r / np_);
    value.row(r) = kv.kv.row(r).tail(v_);
  }
  if (saved) {
    saved->query = query;
    saved->key = key;
    saved->value = value;
    saved->freqs = freqs;
    saved->mscale = rope.mscale;
  }

  Mat core_attn_out =
      core_attention.forward(query, key, value, a.s, a.s, a.b, a.attention_mask, a.training, a.rng);  // [sq, b, np*v]
  core_attn_out = taps.record("core_attention", core_attn_out, {a.s, a.b, core_attn_out.cols()}, p_);
  if (taps.enabled())  // its error scales with the softmax's inputs too (core/attention_bound.h)
    taps.set_block_magnitude(
        core_attention.error_magnitudes(query, key, value, a.s, a.s, a.b, a.attention_mask, a.training));

  AttentionOutput out;
  static_cast<OutputWithBias&>(out) = linear_proj.forward(core_attn_out, saved ? &saved->linear_proj : nullptr);
  record_output(taps, out, a.s, a.b, p_);
  return out;
}

AttentionGrads MLASelfAttention::backward(const Mat& doutput, const MLASelfAttentionSaved& saved,
                                          const AttentionArgs& a) const {
  const Eigen::Index tokens = static_cast<Eigen::Index>(a.s) * a.b;
  AttentionGrads g;
  const LinearGrads proj = linear_proj.backward(doutput, saved.linear_proj);
  const CoreAttentionGrads core = core_attention.backward(proj.input, saved.query, saved.key, saved.value, a.s, a.s,
                                                          a.b, a.attention_mask, a.training, a.rng);
  ParamGrads params;
  const RoundingCount at_core = rounding_now();

  // The q path: RoPE's backward on q_pos_emb, the view back to [s*b, np * q_head_dim].
  Mat dquery = core.query;  // [s*b*np, q_head_dim]
  dquery.rightCols(pe_) = mla_rope_backward(dquery.rightCols(pe_), saved.freqs, saved.mscale, a.b * np_, p_);
  const Mat dq = Eigen::Map<const Mat>(dquery.data(), tokens, static_cast<Eigen::Index>(np_) * (qk_ + pe_));
  Mat dx_q;
  if (linear_q_proj) {
    const LinearGrads lg = linear_q_proj->backward(dq, saved.linear_q_up_proj);
    add_param_grads(params, "linear_q_proj.", lg);
    dx_q = lg.input;
  } else {
    const LinearGrads up = linear_q_up_proj->backward(dq, saved.linear_q_up_proj);
    Mat dqc = up.input;
    if (q_layernorm) {
      const NormGrads n = q_layernorm->backward(dqc, saved.q_compressed);
      dqc = n.input;
      add_param_grads(params, "q_layernorm.", n);
    }
    const LinearGrads down = linear_q_down_proj->backward(dqc, saved.linear_q_down_proj);
    add_param_grads(params, "linear_q_down_proj.", down);
    add_param_grads(params, "linear_q_up_proj.", up);
    dx_q = down.input;
  }
  const RoundingCount query_end = rounding_now();
  rounding_set(at_core);

  // The kv path: k_pos_emb's expand summed over the heads (stored), its RoPE's backward; the
  // splits' transposes into kv [s*b, np * (qk + v)] and kv_combined.
  Mat dk_pos_emb = Mat::Zero(tokens, pe_);
  Mat dkv(tokens, static_cast<Eigen::Index>(np_) * (qk_ + v_));
  for (Eigen::Index t = 0; t < tokens; ++t)
    for (int h = 0; h < np_; ++h) {
      const Eigen::Index r = t * np_ + h;
      dk_pos_emb.row(t) += core.key.row(r).tail(pe_);
      dkv.row(t).segment(static_cast<Eigen::Index>(h) * (qk_ + v_), qk_) = core.key.row(r).head(qk_);
      dkv.row(t).segment(static_cast<Eigen::Index>(h) * (qk_ + v_) + qk_, v_) = core.value.row(r);
    }
  p_.act_inplace(dk_pos_emb);  // rounds: expand's backward, a sum over the np heads
  p_.count_reduce(np_);
  p_.count_act();
  dk_pos_emb = mla_rope_backward(dk_pos_emb, saved.freqs, saved.mscale, a.b, p_);
  const LinearGrads up = linear_kv_up_proj.backward(dkv, saved.linear_kv_up_proj);
  Mat dkvc = up.input;
  if (kv_layernorm) {
    const NormGrads n = kv_layernorm->backward(dkvc, saved.kv_compressed);
    dkvc = n.input;
    add_param_grads(params, "kv_layernorm.", n);
  }
  Mat dkv_combined(tokens, config_.kv_lora_rank + pe_);
  dkv_combined << dkvc, dk_pos_emb;
  const LinearGrads down = linear_kv_down_proj.backward(dkv_combined, saved.linear_kv_down_proj);
  add_param_grads(params, "linear_kv_down_proj.", down);
  add_param_grads(params, "linear_kv_up_proj.", up);
  rounding_join(query_end);

  g.hidden_states = p_.act(Mat(dx_q + down.input));  // rounds: the two paths' gradients summed
  p_.count_act();
  g.params = std::move(params);
  add_param_grads(g.params, "linear_proj.", proj);
  return g;
}

}  // namespace twin::reference
