#include "optimized/layer/sharding.h"

#include <cstring>

namespace twin::opt {

std::map<std::string, Tensor> checked_params(const std::string& who, const std::map<std::string, Tensor>& params,
                                             const std::vector<std::string>& keys,
                                             const std::map<std::string, Shape>& shapes, DType dt) {
  std::map<std::string, Tensor> out;
  for (const std::string& key : keys) {
    auto it = params.find(key);
    if (it == params.end()) throw ShapeError(who + ": missing parameter '" + key + "'");
    it->second.expect(shapes.at(key), dt, who + ": parameter '" + key + "'");
    out[key] = it->second;
  }
  return out;
}

void check_tensor_parallel_sizes(const std::string& who, const TransformerConfig& c, int tp,
                                 const std::string& tp_name) {
  const int np = c.num_attention_heads, ng = c.query_groups(), ffn = c.ffn();
  auto reject = [&](bool bad, const std::string& what) {
    if (bad) throw ConfigError(who + ": " + what);
  };
  reject(c.hidden_size <= 0 || np <= 0 || ng <= 0 || c.head_dim() <= 0 || ffn <= 0,
         "hidden_size, heads, query groups, kv_channels and ffn must be > 0");
  reject(np % ng != 0,
         "num_attention_heads " + std::to_string(np) + " not divisible by num_query_groups " + std::to_string(ng));
  reject(tp < 1, tp_name + " must be >= 1");
  reject(np % tp != 0 || ng % tp != 0, tp_name + " " + std::to_string(tp) + " must divide num_attention_heads " +
                                           std::to_string(np) + " and num_query_groups " + std::to_string(ng));
  reject(ffn % tp != 0, tp_name + " " + std::to_string(tp) + " must divide ffn_hidden_size " + std::to_string(ffn));
  if (c.multi_latent_attention) {  // the down projections' column-parallel shards
    const int kv_width = c.kv_lora_rank + c.qk_pos_emb_head_dim;
    reject(kv_width % tp != 0 || c.q_lora_rank.value_or(0) % tp != 0,
           tp_name + " " + std::to_string(tp) + " must divide q_lora_rank and kv_lora_rank + qk_pos_emb_head_dim " +
               std::to_string(kv_width) + " (the down projections are column parallel)");
  }
}

Tensor take_rows(const Tensor& t, std::int64_t r0, std::int64_t r1) {
  const std::size_t row = std::size_t(t.numel() / t.size(0)) * dtype_size(t.dtype());
  Shape shape = t.shape();
  shape[0] = r1 - r0;
  Tensor out = Tensor::empty(t.dtype(), shape);
  std::memcpy(out.raw_mut(), t.raw() + std::size_t(r0) * row, std::size_t(r1 - r0) * row);
  return out;
}

Tensor take_cols(const Tensor& t, std::int64_t c0, std::int64_t c1) {
  const std::int64_t rows = t.size(0), cols = t.size(1);
  const std::size_t es = dtype_size(t.dtype());
  Tensor out = Tensor::empty(t.dtype(), {rows, c1 - c0});
  for (std::int64_t r = 0; r < rows; ++r)
    std::memcpy(out.raw_mut() + std::size_t(r * (c1 - c0)) * es, t.raw() + std::size_t(r * cols + c0) * es,
                std::size_t(c1 - c0) * es);
  return out;
}

namespace {

bool starts_with(const std::string& s, const std::string& prefix) { return s.rfind(prefix, 0) == 0; }

// Rank r's rows of both GLU halves of a [2 ffn, ...] fc1 tensor: [its gate rows | its linear rows].
Tensor glu_rows(const Tensor& t, std::int64_t ffn, std::int64_t f_l, int r) {
  const Tensor first = take_rows(t, r * f_l, (r + 1) * f_l);
  const Tensor second = take_rows(t, ffn + r * f_l, ffn + (r + 1) * f_l);
  Shape shape = first.shape();
  shape[0] = 2 * f_l;
  Tensor both = Tensor::empty(t.dtype(), shape);
  std::memcpy(both.raw_mut(), first.raw(), first.nbytes());
  std::memcpy(both.raw_mut() + first.nbytes(), second.raw(), second.nbytes());
  return both;
}

}  // namespace

Tensor tensor_parallel_shard(const TransformerConfig& c, const std::string& key, const Tensor& t, int r, int tp) {
  if (tp == 1) return t;
  const std::int64_t np = c.num_attention_heads, ng = c.query_groups(), hn = c.head_dim(), ffn = c.ffn();
  const std::int64_t np_l = np / tp, ng_l = ng / tp, f_l = ffn / tp;
  if (starts_with(key, "self_attention.linear_qkv.")) {
    const std::int64_t group_rows = (np / ng + 2) * hn;
    return take_rows(t, r * ng_l * group_rows, (r + 1) * ng_l * group_rows);
  }
  if (starts_with(key, "cross_attention.attn.linear_q.")) return take_rows(t, r * np_l * hn, (r + 1) * np_l * hn);
  // MLA's up projections by heads (their rows are [np, width]); its down projections whole (the
  // forward reads the whole weight, layer/mla_attention.cuh)
  if (key == "self_attention.linear_q_up_proj.weight" || key == "self_attention.linear_q_proj.weight" ||
      key == "self_attention.linear_kv_up_proj.weight")
    return take_rows(t, r * (t.size(0) / tp), (r + 1) * (t.size(0) / tp));
  if (starts_with(key, "cross_attention.attn.linear_kv."))
    return take_rows(t, r * np_l * 2 * hn, (r + 1) * np_l * 2 * hn);
  if (key == "self_attention.linear_proj.weight" || key == "cross_attention.attn.linear_proj.weight")
    return take_cols(t, r * (t.size(1) / tp), (r + 1) * (t.size(1) / tp));  // np * hn (MLA: np * v) columns
  if (key == "mlp.linear_fc2.weight") return take_cols(t, r * f_l, (r + 1) * f_l);
  if (starts_with(key, "mlp.linear_fc1."))
    return c.gated_linear_unit ? glu_rows(t, ffn, f_l, r) : take_rows(t, r * f_l, (r + 1) * f_l);
  // the MoE layer's shared experts: a tensor-parallel MLP of moe_shared_expert_intermediate_size
  const std::int64_t sf = c.moe_shared_expert_intermediate_size.value_or(0), sf_l = sf / tp;
  if (key == "mlp.shared_experts.linear_fc2.weight") return take_cols(t, r * sf_l, (r + 1) * sf_l);
  if (key == "mlp.shared_experts.linear_fc1.weight")
    return c.gated_linear_unit ? glu_rows(t, sf, sf_l, r) : take_rows(t, r * sf_l, (r + 1) * sf_l);
  return t;  // norms, the row-parallel biases, the router, the shared experts' gate, the experts
}

ShardLayout tensor_parallel_layout(const TransformerConfig& c, const std::string& key) {
  if (starts_with(key, "self_attention.linear_qkv.") || starts_with(key, "cross_attention.attn.linear_q.") ||
      starts_with(key, "cross_attention.attn.linear_kv.") || key == "self_attention.linear_q_up_proj.weight" ||
      key == "self_attention.linear_q_proj.weight" || key == "self_attention.linear_kv_up_proj.weight")
    return {0, 1};
  if (key == "self_attention.linear_proj.weight" || key == "cross_attention.attn.linear_proj.weight" ||
      key == "mlp.linear_fc2.weight" || key == "mlp.shared_experts.linear_fc2.weight")
    return {1, 1};
  if (starts_with(key, "mlp.linear_fc1.") || key == "mlp.shared_experts.linear_fc1.weight")
    return {0, c.gated_linear_unit ? 2 : 1};
  return {};  // norms, the row-parallel biases: whole on every rank
}

Tensor gather_shards(const std::vector<const Tensor*>& shards, ShardLayout layout) {
  const Tensor& s0 = *shards.at(0);
  if (layout.dim < 0 || shards.size() == 1) return s0;
  Shape shape = s0.shape();
  std::int64_t outer = 1;
  for (int d = 0; d < layout.dim; ++d) outer *= shape[d];
  const std::size_t chunk = s0.nbytes() / static_cast<std::size_t>(outer * layout.blocks);
  shape[layout.dim] *= static_cast<std::int64_t>(shards.size());
  Tensor out = Tensor::empty(s0.dtype(), shape);
  std::byte* dst = out.raw_mut();
  for (std::int64_t o = 0; o < outer * layout.blocks; ++o)
    for (const Tensor* t : shards) {
      std::memcpy(dst, t->raw() + static_cast<std::size_t>(o) * chunk, chunk);
      dst += chunk;
    }
  return out;
}

}  // namespace twin::opt
