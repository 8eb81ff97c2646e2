#include "optimized/moe/moe_layer.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/rounding.h"
#include "optimized/layer/sharding.h"  // take_rows

namespace twin::opt {

namespace {

DType router_dtype(const TransformerConfig& c) {
  if (c.moe_router_dtype == std::optional<std::string>("fp32")) return DType::F32;
  if (c.moe_router_dtype == std::optional<std::string>("fp64")) return DType::F64;
  return params_dtype(c);
}

std::string expert_key(int e, const std::string& rest) {
  return "mlp.experts.local_experts." + std::to_string(e) + "." + rest;
}

// The load-balancing loss this forward computes: only while training, as Megatron's router.
std::optional<AuxLossKind> aux_loss_kind(const TransformerConfig& c, bool training) {
  const std::string& lb = c.moe_router_load_balancing_type;
  if (!training || c.moe_aux_loss_coeff <= 0) return std::nullopt;
  if (lb == "aux_loss") return AuxLossKind::AuxLoss;
  if (lb == "seq_aux_loss") return AuxLossKind::SeqAuxLoss;
  if (lb == "global_aux_loss") return AuxLossKind::GlobalAuxLoss;
  return std::nullopt;
}

}  // namespace

std::vector<std::string> moe_mlp_param_keys(const TransformerConfig& c) {
  std::vector<std::string> k{"mlp.router.weight"};
  if (c.add_bias_linear) k.push_back("mlp.router.bias");
  for (int e = 0; e < c.num_moe_experts.value_or(0); ++e) {
    k.push_back(expert_key(e, "linear_fc1.weight"));
    if (c.add_bias_linear) k.push_back(expert_key(e, "linear_fc1.bias"));
    k.push_back(expert_key(e, "linear_fc2.weight"));
    if (c.add_bias_linear) k.push_back(expert_key(e, "linear_fc2.bias"));
  }
  if (c.moe_shared_expert_intermediate_size) {
    k.push_back("mlp.shared_experts.linear_fc1.weight");
    k.push_back("mlp.shared_experts.linear_fc2.weight");
    if (c.moe_shared_expert_gate) k.push_back("mlp.shared_experts.gate_weight");
  }
  return k;
}

std::vector<std::uint8_t> token_padding(const std::string& who, const Tensor* padding_mask, int s, int b) {
  std::vector<std::uint8_t> padding;
  if (!padding_mask) return padding;
  if (padding_mask->shape() != Shape{b, s})
    throw ShapeError(who + ": padding_mask expected [b, s] = " + shape_str({b, s}) + ", got " +
                     padding_mask->describe());
  padding.resize(std::size_t(s) * b);
  for (std::int64_t si = 0; si < s; ++si)
    for (std::int64_t bi = 0; bi < b; ++bi)
      padding[std::size_t(si * b + bi)] = padding_mask->at_f64(bi * s + si) != 0.0;
  return padding;
}

std::vector<std::uint8_t> recorded_map(const std::string& who, const Tensor* map, std::int64_t T, std::int64_t E) {
  std::vector<std::uint8_t> recorded;
  if (!map) return recorded;
  if (map->shape() != Shape{T, E})
    throw ShapeError(who + ": recorded routing map expected [T, E] = " + shape_str({T, E}) + ", got " +
                     map->describe());
  recorded.resize(std::size_t(T * E));
  for (std::int64_t i = 0; i < T * E; ++i) recorded[std::size_t(i)] = map->at_f64(i) != 0.0;
  return recorded;
}

void MoEMlpRank::configure(const TransformerConfig& c, int rank) {
  dt = params_dtype(c);
  rdt = router_dtype(c);
  h = c.hidden_size;
  E = *c.num_moe_experts;
  topk = c.moe_router_topk;
  local_E = E / c.expert_model_parallel_size;
  e0 = rank * local_E;
  ffn = c.moe_ffn_hidden_size.value_or(c.ffn());
  shared_ffn = c.moe_shared_expert_intermediate_size.value_or(0);
  if (topk < 1 || topk > E)
    throw ConfigError(who + ": moe_router_topk " + std::to_string(topk) + " outside [1, " + std::to_string(E) + "]");
  if (ffn <= 0) throw ConfigError(who + ": moe_ffn_hidden_size must be > 0");
  if (shared_ffn > 0 && c.add_bias_linear)
    throw ConfigError(who + ": bias is not supported in the shared experts (add_bias_linear)");
}

void MoEMlpRank::add_param_shapes(const TransformerConfig& c, std::map<std::string, Shape>& shapes) const {
  const std::int64_t w1 = (c.gated_linear_unit ? 2 : 1) * std::int64_t(ffn),
                     sw1 = (c.gated_linear_unit ? 2 : 1) * std::int64_t(shared_ffn);
  shapes.insert({{"mlp.router.weight", {E, h}},
                 {"mlp.router.bias", {E}},
                 {"mlp.shared_experts.linear_fc1.weight", {sw1, h}},
                 {"mlp.shared_experts.linear_fc2.weight", {h, shared_ffn}},
                 {"mlp.shared_experts.gate_weight", {1, h}}});
  for (int e = 0; e < E; ++e) {
    shapes[expert_key(e, "linear_fc1.weight")] = {w1, h};
    shapes[expert_key(e, "linear_fc1.bias")] = {w1};
    shapes[expert_key(e, "linear_fc2.weight")] = {h, ffn};
    shapes[expert_key(e, "linear_fc2.bias")] = {h};
  }
}

void MoEMlpRank::bind(MoELayerPlan& P, const TransformerConfig& c, const std::map<std::string, Tensor>& full, int rank,
                      rt::Communicator* ep_comm, DeviceWeights& weights, rt::Device& dev, int tp_rank, int tp) {
  auto upload_opt = [&](const std::string& key) {
    return full.count(key) ? weights.upload(dev, tensor_parallel_shard(c, key, full.at(key), tp_rank, tp)) : nullptr;
  };
  // Tensors of one key pattern over this rank's experts, stacked [local_E, ...] into one device buffer.
  auto upload_stacked = [&](const std::function<std::string(int)>& key) {
    std::vector<std::byte> bytes;
    for (int e = e0; e < e0 + local_E; ++e) {
      const Tensor& t = full.at(key(e));
      bytes.insert(bytes.end(), t.raw(), t.raw() + t.nbytes());
    }
    return weights.upload(dev, bytes.data(), bytes.size());
  };
  this->tp = tp;
  P.ep_replicas = tp == 1;
  P.E = E;
  P.ep = c.expert_model_parallel_size;
  P.ep_rank = rank;
  P.local_E = local_E;
  P.ep_comm = ep_comm;
  P.allgather = c.moe_token_dispatcher_type == "allgather";
  P.topk = topk;
  P.rdt = rdt;
  P.cast_input = rdt != dt;
  P.score = c.moe_router_score_function == "sigmoid"        ? ScoreFunction::Sigmoid
            : c.moe_router_score_function == "sqrtsoftplus" ? ScoreFunction::SqrtSoftplus
                                                            : ScoreFunction::Softmax;
  P.scores_fp32 = c.megatron.router_scores_fp32;
  P.aux_scores_fp32 = c.megatron.aux_loss_scores_fp32;
  P.pre_softmax = c.moe_router_pre_softmax;
  P.group_topk = c.moe_router_group_topk.value_or(0);
  P.num_groups = P.group_topk > 0 ? c.moe_router_num_groups.value_or(0) : 0;
  P.scaling_factor = static_cast<float>(c.moe_router_topk_scaling_factor.value_or(0.0));
  P.drop = c.moe_expert_capacity_factor.has_value();
  P.capacity_factor = c.moe_expert_capacity_factor.value_or(0.0);
  P.drop_by_probs = c.moe_token_drop_policy == "probs";
  if (c.moe_token_drop_policy != "probs" && c.moe_token_drop_policy != "position")
    throw ConfigError(who + ": moe_token_drop_policy '" + c.moe_token_drop_policy + "'");
  P.pad_to_capacity = c.moe_pad_expert_input_to_capacity;
  P.ffn = ffn;
  P.glu = c.gated_linear_unit;
  P.act = act_from_name(c.activation_func);
  // The router's weights in the router dtype (exact: a widening conversion).
  auto in_router_dtype = [&](const Tensor& t) {
    return t.dtype() == rdt ? t : Tensor::from_doubles(rdt, t.shape(), t.to_f64());
  };
  P.router_w = weights.upload(dev, in_router_dtype(full.at("mlp.router.weight")));
  if (full.count("mlp.router.bias")) P.router_b = weights.upload(dev, in_router_dtype(full.at("mlp.router.bias")));
  if (c.moe_router_enable_expert_bias) {
    // _maintain_float32_expert_bias: an fp32 buffer, zero until trained
    std::vector<double> eb(std::size_t(E), 0.0);
    if (full.count("mlp.router.expert_bias")) eb = full.at("mlp.router.expert_bias").to_f64();
    P.expert_bias = static_cast<const float*>(weights.upload(dev, Tensor::from_doubles(DType::F32, {E}, eb)));
    has_expert_bias = true;
    local_tokens.assign(std::size_t(E), 0.0);
  }
  P.fc1_w = upload_stacked([&](int e) { return expert_key(e, "linear_fc1.weight"); });
  P.fc2_w = upload_stacked([&](int e) { return expert_key(e, "linear_fc2.weight"); });
  if (c.add_bias_linear) {
    P.fc1_b = upload_stacked([&](int e) { return expert_key(e, "linear_fc1.bias"); });
    P.fc2_b = upload_stacked([&](int e) { return expert_key(e, "linear_fc2.bias"); });
  }
  P.shared_ffn = shared_ffn;
  P.shared_gate = shared_ffn > 0 && c.moe_shared_expert_gate;
  if (shared_ffn > 0) {
    P.shared_fc1_w = upload_opt("mlp.shared_experts.linear_fc1.weight");
    P.shared_fc2_w = upload_opt("mlp.shared_experts.linear_fc2.weight");
    P.shared_gate_w = upload_opt("mlp.shared_experts.gate_weight");
  }
  global_tokens = rt::DeviceBuffer(dev, std::size_t(E) * sizeof(double));
  global_tokens.zero();
  P.global_tokens = global_tokens.as<double>();
}

void MoEMlpRank::add_buffers(MoELayerPlan& P, BufferArena& A, rt::Device& d, int s, int b, int tp) const {
  const std::int64_t n = std::int64_t(s) * b, T = n / tp, H = h, Es = E, N = T * Es;  // N: routed rows at most
  const std::int64_t sf = shared_ffn / tp;
  // the router
  P.x_r = P.cast_input || rdt == DType::F64 ? A.add(d, "x_r", rdt, T, H) : nullptr;
  P.logits = A.add(d, "logits", rdt, T, Es);
  P.probs_pre = A.add(d, "probs_pre", rdt, T, Es);
  P.map_pre = A.add<std::uint8_t>(d, "map_pre", T, Es);
  P.probs = A.add(d, "probs", rdt, T, Es);
  P.routing_map = A.add<std::uint8_t>(d, "routing_map", T, Es);
  P.aux_scores = A.add<float>(d, "aux_scores", T, Es);
  P.aux_map = A.add<std::uint8_t>(d, "aux_map", T, Es);
  P.z = A.add<float>(d, "z", T);
  P.loss_scratch = A.add<double>(d, "loss_scratch", 2, b, Es);
  P.tp_counts = tp > 1 ? A.add<double>(d, "tp_counts", 2, b, Es) : nullptr;
  P.losses = A.add<float>(d, "losses", 2);
  // the dispatcher and the experts
  P.tokens_per_expert_dev = A.add<std::int64_t>(d, "tokens_per_expert", Es);
  P.offsets = A.add<std::int64_t>(d, "offsets", Es + 1);
  P.row_id_map = A.add<std::int64_t>(d, "row_id_map", N);
  P.permuted = A.add(d, "permuted", dt, N, H);
  P.permuted_probs = A.add(d, "permuted_probs", rdt, N);
  P.fc1 = A.add(d, "fc1", dt, N, P.glu ? 2 : 1, ffn);
  P.act_out = A.add(d, "act_out", dt, N, ffn);
  P.expert_out = A.add(d, "expert_out", dt, N, H);
  P.combined = A.add(d, "combined", dt, T, H);
  P.mlp_out = A.add(d, "mlp_out", dt, T, H);
  if (shared_ffn > 0) {
    P.shared_fc1 = A.add(d, "shared_fc1", dt, n, P.glu ? 2 : 1, sf);
    P.shared_act = A.add(d, "shared_act", dt, n, sf);
    P.shared_fc2_partial = tp > 1 ? A.add(d, "shared_fc2_partial", dt, n, H) : nullptr;
    P.shared_out = A.add(d, "shared_out", dt, T, H);
    // the gate's backward reads the output before the gate
    P.shared_fc2 = P.shared_gate ? A.add(d, "shared_fc2", dt, T, H) : P.shared_out;
    P.gate_logits = A.add(d, "gate_logits", dt, T);
  }
  if (P.ep > 1) {
    P.ep_counts = A.add<std::int64_t>(d, "ep_counts", P.ep, Es);
    P.ep_recv = A.add(d, "ep_recv", dt, N, H);
    P.ep_recv_probs = A.add(d, "ep_recv_probs", rdt, N);
    P.ep_in = A.add(d, "ep_in", dt, N, H);
    P.ep_in_probs = A.add(d, "ep_in_probs", rdt, N);
    P.ep_out = A.add(d, "ep_out", dt, N, H);
    P.ep_offsets = A.add<std::int64_t>(d, "ep_offsets", local_E + 1);
  }
  if (P.ep > 1 && P.allgather) {
    const std::int64_t TG = T * P.ep, el = local_E;  // the gathered tokens, this rank's experts
    P.ag_x = A.add(d, "ag_x", dt, TG, H);
    P.ag_map = A.add<std::uint8_t>(d, "ag_map", TG, Es);
    P.ag_probs = A.add(d, "ag_probs", rdt, TG, Es);
    P.ag_local_map = A.add<std::uint8_t>(d, "ag_local_map", TG, el);
    P.ag_local_probs = A.add(d, "ag_local_probs", rdt, TG, el);
    P.ag_tokens_per_expert = A.add<std::int64_t>(d, "ag_tokens_per_expert", el);
    P.ag_row_id_map = A.add<std::int64_t>(d, "ag_row_id_map", el, TG);
    P.ag_partial = A.add(d, "ag_partial", dt, TG, H);
    P.ag_partial_r = rdt != dt ? A.add(d, "ag_partial_r", rdt, TG, H) : nullptr;
    P.ag_combined_r = rdt != dt ? A.add(d, "ag_combined_r", rdt, T, H) : nullptr;
  }
}

bool MoEMlpRank::set_losses(MoELayerPlan& P, const TransformerConfig& c, const ForwardOptions& fo) {
  P.aux_kind = aux_loss_kind(c, fo.training);
  P.aux_coeff = c.moe_aux_loss_coeff;
  P.z_loss = fo.training && c.moe_z_loss_coeff.has_value();
  P.z_coeff = c.moe_z_loss_coeff.value_or(0.0);
  if (P.aux_kind == AuxLossKind::GlobalAuxLoss) ga_steps += 1;
  const bool changed = P.ga_steps != ga_steps || P.aux_kind != graph_aux_kind || P.z_loss != graph_z_loss;
  graph_aux_kind = P.aux_kind;
  graph_z_loss = P.z_loss;
  P.ga_steps = ga_steps;
  P.local_tokens = has_expert_bias ? &local_tokens : nullptr;
  if (P.z_loss && P.z_coeff == 0.0) throw ConfigError(who + ": moe_z_loss_coeff = 0");
  return changed;
}

void MoEMlpRank::count_routed_tokens(const Tensor& map, const std::vector<std::uint8_t>& padding) {
  const std::int64_t T = map.size(0);
  for (std::int64_t t = 0; t < T; ++t) {
    if (!padding.empty() && padding[std::size_t(t)]) continue;
    for (std::int64_t e = 0; e < E; ++e) local_tokens[std::size_t(e)] += map.at_f64(t * E + e);
  }
}

void MoEMlpRank::tap(MoETapPoint t, const MoELayerPlan& P, std::int64_t S, std::int64_t B,
                     const std::function<Tensor(const void*, DType, Shape)>& download, Record& rec) {
  const std::int64_t T = S * B, H = h, Es = E;
  auto routed_rows = [&] {
    std::int64_t N = 0;
    for (auto n : P.tokens_per_expert) N += n;
    return N;
  };
  switch (t) {
    case MoETapPoint::SharedFc1:  // every token's, this rank's columns (column parallel)
      rec.add(Role::Tap, "mlp.shared_experts.linear_fc1.0",
              download(P.shared_fc1, dt, {S * tp, B, (P.glu ? 2 : 1) * std::int64_t(shared_ffn / tp)}));
      break;
    case MoETapPoint::SharedFc2:
      rec.add(Role::Tap, "mlp.shared_experts.linear_fc2.0", download(P.shared_fc2, dt, {S, B, H}));
      break;
    case MoETapPoint::SharedExperts:
      rec.add(Role::Tap, "mlp.shared_experts", download(P.shared_out, dt, {S, B, H}));
      break;
    case MoETapPoint::RouterLogits: {
      const Tensor logits = download(P.logits, rdt, {S, B, Es});
      for (std::int64_t i = 0; i < logits.numel(); ++i) max_logit = std::max(max_logit, std::abs(logits.at_f64(i)));
      rec.add(Role::Tap, "mlp.router.logits", logits);
      break;
    }
    case MoETapPoint::RouterProbs: {
      // Probabilities move with the logits' absolute error (softmax and sigmoid are 1-Lipschitz).
      rec.add(Role::Tap, "mlp.router.0", download(P.probs, rdt, {T, Es})).magnitude = 1.0 + max_logit;
      // The maps are one byte per element, 0 or 1: BOOL's storage.
      rec.add(Role::Tap, "mlp.router.1", download(P.routing_map, DType::BOOL, {T, Es}));
      // The losses, each with its own rounding points from here (as the reference counts them):
      // a load-balancing loss the sum over the tokens, x tokens_per_expert, the sum over the
      // experts, x its scale and / coeff; z_loss logsumexp, its square, their mean, x coeff and
      // / coeff; then the fp32 tracker.
      const RoundingCount before_log = rounding_now();
      const Tensor losses = download(P.losses, DType::F32, {2});
      std::map<std::string, double> logged;
      if (P.aux_kind) {
        const char* names[] = {"load_balancing_loss", "seq_load_balancing_loss", "global_load_balancing_loss"};
        logged[names[static_cast<int>(*P.aux_kind)]] = losses.at_f64(0);
      }
      if (P.z_loss) logged["z_loss"] = losses.at_f64(1);
      for (const auto& [name, v] : logged) {
        const bool z = name == "z_loss";
        rounding_store(rdt, z ? 5 : 4);
        rounding_reduce(T * tp + (z ? 0 : Es));  // at tp > 1 the ranks' parts summed too
        rounding_store(DType::F32);
        rec.add(Role::Aux, name, Tensor::from_doubles(DType::F32, {}, {v})).magnitude =
            std::max(1.0 + max_logit, std::abs(v));
        rounding_set(before_log);
      }
      if (has_expert_bias)
        rec.add_exact(Role::State, "mlp.router.local_tokens_per_expert_after",
                      Tensor::from_doubles(DType::F64, {Es}, local_tokens));
      break;
    }
    case MoETapPoint::ExpertInputs: {
      const std::int64_t N = routed_rows();
      rec.add(Role::TapIn, "mlp.experts.dispatched_input", download(P.permuted, dt, {N, H}));
      rec.add(Role::TapIn, "mlp.experts.tokens_per_expert",
              Tensor::from_vector<std::int64_t>({Es}, P.tokens_per_expert));
      rec.add(Role::TapIn, "mlp.experts.permuted_probs", download(P.permuted_probs, rdt, {N})).magnitude =
          1.0 + max_logit;
      break;
    }
    case MoETapPoint::ExpertsFc1:    // each expert's rows of its linear_fc1's output (before the bias)
    case MoETapPoint::ExpertsFc2: {  // ... of its linear_fc2's (the bias returned apart, as .1)
      const bool fc1 = t == MoETapPoint::ExpertsFc1;
      const Tensor all = fc1 ? download(P.fc1, dt, {routed_rows(), (P.glu ? 2 : 1) * std::int64_t(P.ffn)})
                             : download(P.expert_out, dt, {routed_rows(), H});
      std::int64_t row = 0;
      for (int e = 0; e < E; ++e) {
        const std::int64_t n = P.tokens_per_expert[std::size_t(e)];
        rec.add(Role::Tap, expert_key(e, fc1 ? "linear_fc1.0" : "linear_fc2.0"), take_rows(all, row, row + n));
        row += n;
      }
      break;
    }
    case MoETapPoint::ExpertsOutput: {
      const Tensor all = download(P.expert_out, dt, {routed_rows(), H});
      std::int64_t row = 0;
      for (int e = 0; e < E; ++e) {
        const std::int64_t n = P.tokens_per_expert[std::size_t(e)];
        rec.add(Role::Tap, "mlp.experts.local_experts." + std::to_string(e) + ".0", take_rows(all, row, row + n));
        row += n;
      }
      rec.add(Role::Tap, "mlp.experts.0", all);
      break;
    }
    case MoETapPoint::MlpOutput:
      rec.add(Role::Tap, "mlp.0", download(P.mlp_out, dt, {S, B, H}));
      break;
  }
}

}  // namespace twin::opt

namespace twin::opt {

namespace {

// Rows [first, first + n) of `parts[rank]` for each (rank, first, n) in turn, one tensor.
struct RowRange {
  std::size_t rank;
  std::int64_t first, n;
};
Tensor rows_in_order(const std::vector<const Tensor*>& parts, const std::vector<RowRange>& ranges) {
  const Tensor& t0 = *parts.front();
  std::int64_t per_row = 1;
  for (std::size_t d = 1; d < t0.shape().size(); ++d) per_row *= t0.shape()[d];
  const std::size_t row_bytes = std::size_t(per_row) * dtype_size(t0.dtype());
  Shape shape = t0.shape();
  shape[0] = 0;
  for (const RowRange& r : ranges) shape[0] += r.n;
  Tensor out = Tensor::empty(t0.dtype(), shape);
  std::byte* dst = out.raw_mut();
  for (const RowRange& r : ranges) {
    std::memcpy(dst, parts[r.rank]->raw() + std::size_t(r.first) * row_bytes, std::size_t(r.n) * row_bytes);
    dst += std::size_t(r.n) * row_bytes;
  }
  return out;
}

// The elementwise sum (mean: / the ranks) of the ranks' tensors, in the first's dtype.
Tensor reduce_ranks(const std::vector<const Tensor*>& parts, bool mean) {
  std::vector<double> v = parts.front()->to_f64();
  for (std::size_t r = 1; r < parts.size(); ++r) {
    const std::vector<double> x = parts[r]->to_f64();
    for (std::size_t i = 0; i < v.size(); ++i) v[i] += x[i];
  }
  if (mean)
    for (double& x : v) x /= double(parts.size());
  return Tensor::from_doubles(parts.front()->dtype(), parts.front()->shape(), v);
}

}  // namespace

Record gather_tensor_parallel_moe_records(const std::vector<Record>& ranks,
                                          const std::vector<std::vector<std::int64_t>>& tokens_per_expert, bool glu) {
  const Record& r0 = ranks.front();
  const std::size_t tp = ranks.size(), E = tokens_per_expert.front().size();
  Record out;
  out.calls = r0.calls;
  for (std::size_t i = 0; i < r0.entries.size(); ++i) {
    const RecordEntry& e0 = r0.entries[i];
    std::vector<const Tensor*> parts;
    RecordEntry merged = e0;
    for (const Record& r : ranks) {
      if (r.entries.size() != r0.entries.size() || r.entries[i].key() != e0.key())
        throw std::logic_error("optimized MoE layer: the tensor-parallel ranks recorded different taps at " + e0.key());
      parts.push_back(&r.entries[i].value);
      merged.rounding.join(r.entries[i].rounding);
      merged.magnitude = std::max(merged.magnitude, r.entries[i].magnitude);
    }
    const std::string& n = e0.name;
    if (e0.role == Role::Aux || e0.role == Role::State || n == "mlp.experts.tokens_per_expert") {
      merged.value = reduce_ranks(parts, n == "z_loss");
      if (e0.role == Role::Aux) merged.magnitude = std::max(merged.magnitude, std::abs(merged.value.at_f64(0)));
    } else if (n == "mlp.experts.0" || n == "mlp.experts.dispatched_input" || n == "mlp.experts.permuted_probs") {
      std::vector<RowRange> ranges;
      std::vector<std::int64_t> first(tp, 0);
      for (std::size_t e = 0; e < E; ++e)
        for (std::size_t r = 0; r < tp; ++r) {
          const std::int64_t rows = tokens_per_expert[r][e];
          ranges.push_back({r, first[r], rows});
          first[r] += rows;
        }
      merged.value = rows_in_order(parts, ranges);
    } else if (n == "mlp.shared_experts.linear_fc1.0") {
      merged.value = gather_shards(parts, ShardLayout{2, glu ? 2 : 1});
    } else {
      std::vector<RowRange> ranges;
      for (std::size_t r = 0; r < tp; ++r) ranges.push_back({r, 0, parts[r]->shape().empty() ? 0 : parts[r]->size(0)});
      merged.value = rows_in_order(parts, ranges);
    }
    out.entries.push_back(std::move(merged));
  }
  return out;
}

}  // namespace twin::opt
