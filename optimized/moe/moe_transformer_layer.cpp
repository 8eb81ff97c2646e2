// Host side of the optimized MoE layer: its parameter keys, its plan binding (the attention half
// as the dense layer's, layer/attention_half.h; the router and this rank's experts), its three
// phases' steps (inputs, buffers, losses, taps) and the ranks run through layer/rank_runner.h. The
// kernel sequence is moe_layer.cuh, called through layer/kernels.h.
#include "optimized/moe/moe_transformer_layer.h"

#include <cmath>
#include <cstring>
#include <optional>
#include <tuple>

#include "optimized/layer/attention_half.h"
#include "optimized/layer/graph_cache.h"
#include "optimized/layer/kernels.h"
#include "optimized/layer/rank_runner.h"
#include "optimized/layer/sharding.h"
#include "optimized/moe/moe_transformer_layer_plan.h"
#include "optimized/runtime/collectives.h"

namespace twin::opt {

namespace {

constexpr char kWho[] = "optimized MoE layer";

DType router_dtype(const TransformerConfig& c) {
  if (c.moe_router_dtype == std::optional<std::string>("fp32")) return DType::F32;
  if (c.moe_router_dtype == std::optional<std::string>("fp64")) return DType::F64;
  return params_dtype(c);
}

std::string expert_key(int e, const std::string& rest) {
  return "mlp.experts.local_experts." + std::to_string(e) + "." + rest;
}

// What a forward's buffers and captured graphs are made for: a change reallocates them.
struct BufferShape {
  int s = -1, b = -1, rot = -1;
  std::size_t mask_bytes = 0;
  bool padding = false;
  bool operator==(const BufferShape& o) const {
    return std::tie(s, b, rot, mask_bytes, padding) == std::tie(o.s, o.b, o.rot, o.mask_bytes, o.padding);
  }
};

// padding_mask [b, s] (True = padding) in token order t = s_idx * b + b_idx; empty without one.
std::vector<std::uint8_t> token_padding(const Tensor* padding_mask, int s, int b) {
  std::vector<std::uint8_t> padding;
  if (!padding_mask) return padding;
  if (padding_mask->shape() != Shape{b, s})
    throw ShapeError(std::string(kWho) + ": padding_mask expected [b, s] = " + shape_str({b, s}) + ", got " +
                     padding_mask->describe());
  padding.resize(std::size_t(s) * b);
  for (std::int64_t si = 0; si < s; ++si)
    for (std::int64_t bi = 0; bi < b; ++bi)
      padding[std::size_t(si * b + bi)] = padding_mask->at_f64(bi * s + si) != 0.0;
  return padding;
}

// The recorded routing map [T, E] as bytes; empty without one.
std::vector<std::uint8_t> recorded_map(const Tensor* map, std::int64_t T, std::int64_t E) {
  std::vector<std::uint8_t> recorded;
  if (!map) return recorded;
  if (map->shape() != Shape{T, E})
    throw ShapeError(std::string(kWho) + ": recorded routing map expected [T, E] = " + shape_str({T, E}) + ", got " +
                     map->describe());
  recorded.resize(std::size_t(T * E));
  for (std::int64_t i = 0; i < T * E; ++i) recorded[std::size_t(i)] = map->at_f64(i) != 0.0;
  return recorded;
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

std::string moe_layer_unsupported(const TransformerConfig& c, const LayerOptions& o) {
  if (!c.num_moe_experts || *c.num_moe_experts <= 0) return "num_moe_experts is not set";
  if (const std::string why = layer_unsupported(LayerKind::MoE, c, o); !why.empty()) return why;
  const int E = *c.num_moe_experts;
  const int ep = c.expert_model_parallel_size;
  if (ep < 1) return "expert_model_parallel_size " + std::to_string(ep) + " (must be >= 1)";
  if (E % ep != 0)
    return "num_moe_experts " + std::to_string(E) + " not divisible by expert_model_parallel_size " +
           std::to_string(ep);
  if (c.moe_router_group_topk && *c.moe_router_group_topk > 0) {
    const int g = c.moe_router_num_groups.value_or(0), gk = *c.moe_router_group_topk;
    if (g <= 0 || E % g != 0 || gk > g || c.moe_router_topk > gk * (E / g))
      return "this group-limited top-k configuration (groups " + std::to_string(g) + ", group_topk " +
             std::to_string(gk) + ")";
  }
  if (c.moe_pad_expert_input_to_capacity && !c.moe_expert_capacity_factor)
    return "moe_pad_expert_input_to_capacity without moe_expert_capacity_factor";
  return "";
}

std::vector<std::string> moe_layer_param_keys(const TransformerConfig& c) {
  std::vector<std::string> k = attention_half_param_keys(c);
  k.push_back("mlp.router.weight");
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

struct MoETransformerLayer::Impl {
  rt::Device* dev = nullptr;
  DType dt = DType::F32, rdt = DType::F32;
  int h = 0, np = 0, ng = 0, hn = 0, E = 0, topk = 1, ffn = 0, shared_ffn = 0;
  int e0 = 0, local_E = 0;                    // this rank's experts: [e0, e0 + local_E)
  std::unique_ptr<rt::Communicator> ep_comm;  // ep > 1: this rank's handle to the expert-parallel group
  std::map<std::string, Tensor> full;
  std::vector<rt::DeviceBuffer> weights;
  BufferArena acts;  // activations of the current shape
  std::optional<rt::Stream> stream;
  MoEPlan plan;
  rt::DeviceBuffer global_tokens;  // global_aux_loss accumulator
  double ga_steps = 0;
  std::vector<double> local_tokens;  // expert-bias counter
  bool has_expert_bias = false;
  // Buffers of the current shape, the inputs' device copies and the phases' graphs.
  BufferShape buffer_shape;
  rt::DeviceBuffer x_in, freqs, mask, pad;
  StreamGraph router_graph, postprocess_graph;
  std::optional<AuxLossKind> graph_aux_kind;  // the router graph's loss kernel arguments
  bool graph_z_loss = false;
  // What one forward carries from phase to phase: the phase that ran last (a phase runs only after
  // its predecessor), the options, the inputs the phases read on the host, the record so far.
  enum class Phase { None, Router, ExpertCompute };
  Phase done = Phase::None;
  ForwardOptions fo;
  std::vector<std::uint8_t> padding, recorded;  // [T] token order, [T, E]
  std::int64_t S = 0, B = 0;
  double max_logit = 0.0;
  LayerOutput pending;

  Tensor download(const void* ptr, DType type, Shape shape) {
    Tensor t = Tensor::empty(type, shape);
    if (t.nbytes()) {
      dev->copy(t.raw_mut(), ptr, t.nbytes(), rt::CopyKind::DeviceToHost, stream->handle());
      stream->synchronize();
    }
    return t;
  }
  // Forgets a forward in flight (after the postprocess, or when a phase threw).
  void end_forward() {
    done = Phase::None;
    plan.attn.on_tap = nullptr;
    plan.on_tap = nullptr;
    plan.recorded_map = nullptr;
    plan.padding_host = nullptr;
  }
  const void* upload(const Tensor& t) {
    weights.emplace_back(*dev, std::max<std::size_t>(t.nbytes(), 1));
    weights.back().upload(t.raw(), t.nbytes());
    return weights.back().get();
  }
  const void* upload_opt(const std::string& key) { return full.count(key) ? upload(full.at(key)) : nullptr; }
  // Tensors of one key pattern over this rank's experts, stacked [local_E, ...] into one device buffer.
  const void* upload_stacked(const std::function<std::string(int)>& key) {
    std::vector<std::byte> bytes;
    for (int e = e0; e < e0 + local_E; ++e) {
      const Tensor& t = full.at(key(e));
      bytes.insert(bytes.end(), t.raw(), t.raw() + t.nbytes());
    }
    weights.emplace_back(*dev, std::max<std::size_t>(bytes.size(), 1));
    weights.back().upload(bytes.data(), bytes.size());
    return weights.back().get();
  }

  // The router phase's steps (below).
  void ensure_buffers(const BufferShape& shape);
  void upload_inputs(const Tensor& hidden_states, const MoEForwardInputs& in);
  void set_losses(const TransformerConfig& c, const ForwardOptions& fo);
  void attention_tap(TapPoint t);
  void moe_tap(MoETapPoint t);
  void count_routed_tokens();
};

MoETransformerLayer::~MoETransformerLayer() = default;

MoETransformerLayer::MoETransformerLayer(const TransformerConfig& c, const std::map<std::string, Tensor>& params,
                                         LayerOptions o)
    : config_(c), options_(o) {
  if (const std::string why = moe_layer_unsupported(c, o); !why.empty())
    throw ConfigError(std::string(kWho) + ": unsupported: " + why);
  const int ep = c.expert_model_parallel_size;
  std::vector<std::unique_ptr<rt::Communicator>> comms;
  if (ep > 1) comms = rt::make_threaded_group(ep);
  for (int r = 0; r < ep; ++r) {
    ranks_.push_back(std::make_unique<Impl>());
    ranks_.back()->ep_comm = ep > 1 ? std::move(comms[std::size_t(r)]) : nullptr;
    init_rank(*ranks_.back(), c, params, o, r);
  }
}

// One expert-parallel rank: every parameter checked, the attention half's and the router's
// uploaded, and this rank's local experts.
void MoETransformerLayer::init_rank(Impl& m, const TransformerConfig& c, const std::map<std::string, Tensor>& params,
                                    const LayerOptions& o, int rank) {
  m.dt = params_dtype(c);
  m.rdt = router_dtype(c);
  m.h = c.hidden_size;
  m.np = c.num_attention_heads;
  m.ng = c.query_groups();
  m.hn = c.head_dim();
  m.E = *c.num_moe_experts;
  m.topk = c.moe_router_topk;
  m.local_E = m.E / c.expert_model_parallel_size;
  m.e0 = rank * m.local_E;
  m.ffn = c.moe_ffn_hidden_size.value_or(c.ffn());
  m.shared_ffn = c.moe_shared_expert_intermediate_size.value_or(0);
  if (m.topk < 1 || m.topk > m.E)
    throw ConfigError(std::string(kWho) + ": moe_router_topk " + std::to_string(m.topk) + " outside [1, " +
                      std::to_string(m.E) + "]");
  if (m.ffn <= 0) throw ConfigError(std::string(kWho) + ": moe_ffn_hidden_size must be > 0");
  if (m.shared_ffn > 0 && c.add_bias_linear)
    throw ConfigError(std::string(kWho) + ": bias is not supported in the shared experts (add_bias_linear)");
  if (m.np % m.ng != 0) throw ConfigError(std::string(kWho) + ": heads not divisible by query groups");
  m.dev = &rt::device(o.backend);
  m.stream.emplace(*m.dev);

  // ---- params: every key present, right shape and dtype; no other key
  const std::int64_t w1 = (c.gated_linear_unit ? 2 : 1) * m.ffn,
                     sw1 = (c.gated_linear_unit ? 2 : 1) * std::int64_t(m.shared_ffn);
  std::map<std::string, Shape> shapes = attention_half_param_shapes(m.h, m.np, m.ng, m.hn);
  shapes.insert({{"mlp.router.weight", {m.E, m.h}},
                 {"mlp.router.bias", {m.E}},
                 {"mlp.shared_experts.linear_fc1.weight", {sw1, m.h}},
                 {"mlp.shared_experts.linear_fc2.weight", {m.h, m.shared_ffn}},
                 {"mlp.shared_experts.gate_weight", {1, m.h}}});
  for (int e = 0; e < m.E; ++e) {
    shapes[expert_key(e, "linear_fc1.weight")] = {w1, m.h};
    shapes[expert_key(e, "linear_fc1.bias")] = {w1};
    shapes[expert_key(e, "linear_fc2.weight")] = {m.h, m.ffn};
    shapes[expert_key(e, "linear_fc2.bias")] = {m.h};
  }
  m.full = checked_params(kWho, params, moe_layer_param_keys(c), shapes, m.dt);
  for (const auto& [key, t] : params) {
    if (m.full.count(key)) continue;
    if (key == "mlp.router.expert_bias" && c.moe_router_enable_expert_bias) {
      t.expect({m.E}, std::string(kWho) + ": parameter 'mlp.router.expert_bias'");
      m.full[key] = t;
      continue;
    }
    throw ShapeError(std::string(kWho) + ": parameter '" + key + "' is not one the MoE layer owns");
  }

  // ---- the plan: the attention half as the dense layer's RankPlan (tp = 1)
  MoEPlan& P = m.plan;
  RankPlan& p = P.attn;
  plan_attention_half(p, c, o.layer_number);
  p.ffn = m.ffn;
  m.weights.reserve(64);
  for (const PlanWeight& w : kAttentionHalfWeights) p.*w.slot = m.upload_opt(w.key);

  // ---- the MoE MLP
  P.E = m.E;
  P.ep = c.expert_model_parallel_size;
  P.ep_rank = rank;
  P.local_E = m.local_E;
  P.ep_comm = m.ep_comm.get();
  P.allgather = c.moe_token_dispatcher_type == "allgather";
  P.topk = m.topk;
  P.rdt = m.rdt;
  P.cast_input = m.rdt != m.dt;
  P.score = c.moe_router_score_function == "sigmoid" ? ScoreFunction::Sigmoid : ScoreFunction::Softmax;
  P.pre_softmax = c.moe_router_pre_softmax;
  P.group_topk = c.moe_router_group_topk.value_or(0);
  P.num_groups = P.group_topk > 0 ? c.moe_router_num_groups.value_or(0) : 0;
  P.scaling_factor = static_cast<float>(c.moe_router_topk_scaling_factor.value_or(0.0));
  P.drop = c.moe_expert_capacity_factor.has_value();
  P.capacity_factor = c.moe_expert_capacity_factor.value_or(0.0);
  P.drop_by_probs = c.moe_token_drop_policy == "probs";
  if (c.moe_token_drop_policy != "probs" && c.moe_token_drop_policy != "position")
    throw ConfigError(std::string(kWho) + ": moe_token_drop_policy '" + c.moe_token_drop_policy + "'");
  P.pad_to_capacity = c.moe_pad_expert_input_to_capacity;
  P.ffn = m.ffn;
  P.glu = c.gated_linear_unit;
  P.act = p.act;
  // The router's weights in the router dtype (exact: a widening conversion).
  auto in_router_dtype = [&](const Tensor& t) {
    return t.dtype() == m.rdt ? t : Tensor::from_doubles(m.rdt, t.shape(), t.to_f64());
  };
  P.router_w = m.upload(in_router_dtype(m.full.at("mlp.router.weight")));
  if (m.full.count("mlp.router.bias")) P.router_b = m.upload(in_router_dtype(m.full.at("mlp.router.bias")));
  if (c.moe_router_enable_expert_bias) {
    // _maintain_float32_expert_bias: an fp32 buffer, zero until trained
    std::vector<double> eb(std::size_t(m.E), 0.0);
    if (m.full.count("mlp.router.expert_bias")) eb = m.full.at("mlp.router.expert_bias").to_f64();
    P.expert_bias = static_cast<const float*>(m.upload(Tensor::from_doubles(DType::F32, {m.E}, eb)));
    m.has_expert_bias = true;
    m.local_tokens.assign(std::size_t(m.E), 0.0);
  }
  P.fc1_w = m.upload_stacked([&](int e) { return expert_key(e, "linear_fc1.weight"); });
  P.fc2_w = m.upload_stacked([&](int e) { return expert_key(e, "linear_fc2.weight"); });
  if (c.add_bias_linear) {
    P.fc1_b = m.upload_stacked([&](int e) { return expert_key(e, "linear_fc1.bias"); });
    P.fc2_b = m.upload_stacked([&](int e) { return expert_key(e, "linear_fc2.bias"); });
  }
  P.shared_ffn = m.shared_ffn;
  P.shared_gate = m.shared_ffn > 0 && c.moe_shared_expert_gate;
  if (m.shared_ffn > 0) {
    P.shared_fc1_w = m.upload_opt("mlp.shared_experts.linear_fc1.weight");
    P.shared_fc2_w = m.upload_opt("mlp.shared_experts.linear_fc2.weight");
    P.shared_gate_w = m.upload_opt("mlp.shared_experts.gate_weight");
  }
  m.global_tokens = rt::DeviceBuffer(*m.dev, std::size_t(m.E) * sizeof(double));
  m.global_tokens.zero();
  P.global_tokens = m.global_tokens.as<double>();
}

const std::vector<std::int64_t>& MoETransformerLayer::tokens_per_expert() const {
  return ranks_.front()->plan.tokens_per_expert;
}

// forward is exactly the three phases in turn. At ep > 1 each rank's thread runs its three phases
// (the same rank functions the phases called one by one run) in turn: one thread start per rank
// and forward rather than per rank and phase (each new thread starts a simulator worker).
LayerOutput MoETransformerLayer::forward(const Tensor& hidden_states, const MoEForwardInputs& in,
                                         const ForwardOptions& fo) {
  if (ranks_.size() == 1) {
    _forward_mlp_router(hidden_states, in, fo);
    _forward_mlp_expert_compute();
    return _forward_mlp_postprocess();
  }
  set_gather_expert_taps(fo);
  std::vector<LayerOutput> outs(ranks_.size());
  on_every_rank([&](int r) {
    router_rank(r, hidden_states, in, rank_options(fo, r));
    expert_compute_rank(r);
    outs[std::size_t(r)] = postprocess_rank(r);
  });
  return std::move(outs.front());
}

// The taps are rank 0's (the other ranks hold the same tokens: their routing and outputs are
// rank 0's), as a rank-0 hook in Megatron records them.
ForwardOptions MoETransformerLayer::rank_options(const ForwardOptions& fo, int rank) {
  ForwardOptions rank_fo = fo;
  rank_fo.record_taps = fo.record_taps && rank == 0;
  return rank_fo;
}

void MoETransformerLayer::set_gather_expert_taps(const ForwardOptions& fo) {
  if (ranks_.size() > 1)
    for (auto& r : ranks_) r->plan.gather_expert_taps = fo.record_taps;  // a collective: every rank alike
}

namespace {

constexpr char kPhaseOrder[] =
    " (a forward runs _forward_mlp_router, _forward_mlp_expert_compute, _forward_mlp_postprocess in turn)";

// Runs `phase`; if it throws, `drop` forgets the forward in flight (its buffers hold a partial phase).
template <class F, class D>
auto run_phase(F&& phase, D&& drop) -> decltype(phase()) {
  try {
    return phase();
  } catch (...) {
    drop();
    throw;
  }
}

}  // namespace

// One phase on every expert-parallel rank: at ep = 1 on this thread; at ep > 1 on one thread per
// rank (the expert compute's collectives pair them). Rounding points are counted per thread: each
// rank counts from the caller's count, and the caller continues from the ranks' join (they execute
// the same points). If any rank throws, every rank drops the forward in flight, so the ranks stay
// in step (a rank a phase ahead would wait in a collective for the others).
void MoETransformerLayer::on_every_rank(const std::function<void(int)>& phase) {
  run_phase([&] { run_ranks_counted(static_cast<int>(ranks_.size()), phase); },
            [&] {
              for (auto& r : ranks_) r->end_forward();
            });
}

void MoETransformerLayer::_forward_mlp_router(const Tensor& hidden_states, const MoEForwardInputs& in,
                                              const ForwardOptions& fo) {
  set_gather_expert_taps(fo);
  on_every_rank([&](int r) { router_rank(r, hidden_states, in, rank_options(fo, r)); });
}

// The preconditions are checked here, before any rank runs, and leave the forward in flight as it
// was; the ranks move through the phases in step, so rank 0's phase is every rank's.
void MoETransformerLayer::_forward_mlp_expert_compute() {
  const Impl::Phase done = ranks_.front()->done;
  if (done != Impl::Phase::Router)
    throw std::logic_error(
        std::string("optimized MoE layer: _forward_mlp_expert_compute needs _forward_mlp_router first") +
        (done == Impl::Phase::ExpertCompute ? " (it already ran on the last router phase's outputs)" : "") +
        kPhaseOrder);
  on_every_rank([&](int r) { expert_compute_rank(r); });
}

LayerOutput MoETransformerLayer::_forward_mlp_postprocess() {
  const Impl::Phase done = ranks_.front()->done;
  if (done == Impl::Phase::None)
    throw std::logic_error(std::string("optimized MoE layer: _forward_mlp_postprocess needs _forward_mlp_router and "
                                       "_forward_mlp_expert_compute first") +
                           kPhaseOrder);
  if (done == Impl::Phase::Router)
    throw std::logic_error(
        std::string("optimized MoE layer: _forward_mlp_postprocess needs _forward_mlp_expert_compute first") +
        kPhaseOrder);
  std::vector<LayerOutput> outs(ranks_.size());
  on_every_rank([&](int r) { outs[std::size_t(r)] = postprocess_rank(r); });
  return std::move(outs.front());
}

// The router phase (_forward_mlp_router, here with the attention half before it: the twin's
// router graph covers both): inputs checked and uploaded, attention, pre_mlp_layernorm, shared
// experts, router, the dispatch preprocess, the expert-bias counter. Starts a new forward,
// dropping one left unfinished.
void MoETransformerLayer::router_rank(int rank, const Tensor& hidden_states, const MoEForwardInputs& in,
                                      const ForwardOptions& fo) {
  Impl& m = *ranks_[std::size_t(rank)];
  m.end_forward();
  run_phase([&] { router_rank_body(m, hidden_states, in, fo); }, [&] { m.end_forward(); });
  m.done = Impl::Phase::Router;
}

void MoETransformerLayer::router_rank_body(Impl& m, const Tensor& hidden_states, const MoEForwardInputs& in,
                                           const ForwardOptions& fo) {
  const AttentionInputs ai =
      check_attention_inputs(kWho, hidden_states, m.dt, m.h, m.np, m.hn, in.attention_mask, in.rotary_pos_emb);
  if (fo.use_graph && (fo.record_taps || in.recorded_routing_map))
    throw std::invalid_argument(std::string(kWho) + ": graph replay runs without taps and without a recorded map");
  const std::int64_t T = std::int64_t(ai.s) * ai.b;
  m.padding = token_padding(in.padding_mask, ai.s, ai.b);
  m.recorded = recorded_map(in.recorded_routing_map, T, m.E);

  MoEPlan& P = m.plan;
  RankPlan& p = P.attn;
  m.ensure_buffers(
      BufferShape{ai.s, ai.b, ai.rot, in.attention_mask ? in.attention_mask->nbytes() : 0, !m.padding.empty()});
  m.upload_inputs(hidden_states, in);
  const MaskMode mask_mode = self_attention_mask_mode(in.attention_mask != nullptr, options_.attn_mask_type, ai.s);
  if (set_forward_streams(p, fo, mask_mode, ai.mask_b, ai.mask_h)) {  // graphs bake these in: re-record
    m.router_graph.reset();
    m.postprocess_graph.reset();
  }
  p.mask = in.attention_mask ? m.mask.as<const std::uint8_t>() : nullptr;
  p.rot_dim = ai.rot;
  p.rope_interleaved = config_.rotary_interleaved;
  p.freqs = ai.rot ? m.freqs.as<const float>() : nullptr;
  P.padding = m.padding.empty() ? nullptr : m.pad.as<const std::uint8_t>();
  P.padding_host = m.padding.empty() ? nullptr : &m.padding;
  P.recorded_map = m.recorded.empty() ? nullptr : m.recorded.data();
  m.set_losses(config_, fo);

  // The record fills over the three phases; the hooks live as long as the layer's Impl (they
  // capture it, never this phase's locals).
  m.pending = LayerOutput{};
  m.max_logit = 0.0;
  m.fo = fo;
  m.S = ai.s;
  m.B = ai.b;
  Impl* const mp = &m;
  p.on_tap = fo.record_taps ? std::function<void(TapPoint)>([mp](TapPoint t) { mp->attention_tap(t); }) : nullptr;
  P.on_tap = fo.record_taps ? std::function<void(MoETapPoint)>([mp](MoETapPoint t) { mp->moe_tap(t); }) : nullptr;

  run_graph_phase(m, PhaseKind::Router);
  if (fo.use_graph && P.local_tokens) m.count_routed_tokens();  // kept out of the graph
  P.recorded_map = nullptr;                                     // read by the router phase alone
  P.padding_host = nullptr;
}

// ---- the router phase's steps ----------------------------------------------------------------------
// (Re)allocates the buffers when the shape changes; graphs are recorded against them.
void MoETransformerLayer::Impl::ensure_buffers(const BufferShape& shape) {
  if (shape == buffer_shape) return;
  buffer_shape = shape;
  router_graph.reset();
  postprocess_graph.reset();
  acts.clear();
  MoEPlan& P = plan;
  RankPlan& p = P.attn;
  p.s = shape.s;
  p.b = shape.b;
  rt::Device& d = *dev;
  BufferArena& A = acts;
  const std::int64_t T = std::int64_t(shape.s) * shape.b, H = h, Es = E, N = T * Es;  // N: routed rows at most
  x_in = rt::DeviceBuffer(d, std::size_t(T * H) * dtype_size(dt));
  p.x = x_in.get();
  add_attention_half_buffers(A, d, p);
  freqs = shape.rot ? rt::DeviceBuffer(d, std::size_t(shape.s) * shape.rot * sizeof(float)) : rt::DeviceBuffer();
  mask = shape.mask_bytes ? rt::DeviceBuffer(d, shape.mask_bytes) : rt::DeviceBuffer();
  pad = shape.padding ? rt::DeviceBuffer(d, std::size_t(T)) : rt::DeviceBuffer();
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
  P.loss_scratch = A.add<double>(d, "loss_scratch", 2, shape.b, Es);
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
    P.shared_fc1 = A.add(d, "shared_fc1", dt, T, P.glu ? 2 : 1, shared_ffn);
    P.shared_act = A.add(d, "shared_act", dt, T, shared_ffn);
    P.shared_out = A.add(d, "shared_out", dt, T, H);
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

void MoETransformerLayer::Impl::upload_inputs(const Tensor& hidden_states, const MoEForwardInputs& in) {
  x_in.upload(hidden_states.raw(), hidden_states.nbytes());
  if (in.rotary_pos_emb) freqs.upload(in.rotary_pos_emb->raw(), in.rotary_pos_emb->nbytes());
  if (in.attention_mask) mask.upload(in.attention_mask->raw(), in.attention_mask->nbytes());
  if (!padding.empty()) pad.upload(padding.data(), padding.size());
}

// The router's losses of this forward (only while training, as Megatron's router) and the
// expert-bias counter; a change of the loss kernel's arguments re-records the router graph.
void MoETransformerLayer::Impl::set_losses(const TransformerConfig& c, const ForwardOptions& fo) {
  MoEPlan& P = plan;
  P.aux_kind = aux_loss_kind(c, fo.training);
  P.aux_coeff = c.moe_aux_loss_coeff;
  P.z_loss = fo.training && c.moe_z_loss_coeff.has_value();
  P.z_coeff = c.moe_z_loss_coeff.value_or(0.0);
  if (P.aux_kind == AuxLossKind::GlobalAuxLoss) ga_steps += 1;
  if (P.ga_steps != ga_steps || P.aux_kind != graph_aux_kind || P.z_loss != graph_z_loss) {
    router_graph.reset();
    graph_aux_kind = P.aux_kind;
    graph_z_loss = P.z_loss;
  }
  P.ga_steps = ga_steps;
  P.local_tokens = has_expert_bias ? &local_tokens : nullptr;
  if (P.z_loss && P.z_coeff == 0.0) throw ConfigError(std::string(kWho) + ": moe_z_loss_coeff = 0");
}

// The expert-bias counter after a graph replay (the replay skips the host's count): every
// non-padding token's routed experts.
void MoETransformerLayer::Impl::count_routed_tokens() {
  stream->synchronize();
  const std::int64_t T = S * B;
  const Tensor map = download(plan.routing_map, DType::BOOL, {T, E});
  for (std::int64_t t = 0; t < T; ++t) {
    if (!padding.empty() && padding[std::size_t(t)]) continue;
    for (std::int64_t e = 0; e < E; ++e) local_tokens[std::size_t(e)] += map.at_f64(t * E + e);
  }
}

// The attention half's taps as every kind records them (tp = 1: every tensor whole).
void MoETransformerLayer::Impl::attention_tap(TapPoint t) {
  std::vector<RankTap> taps;
  RankTapRecorder rec{plan.attn, full, [&](const void* ptr, Shape shape) { return download(ptr, dt, shape); }, taps};
  rec.attention_half(t);
  for (RankTap& tap : taps) pending.record.add(Role::Tap, tap.name, std::move(tap.value)).rounding = tap.rounding;
}

// The MoE MLP's taps, inputs, losses and state.
void MoETransformerLayer::Impl::moe_tap(MoETapPoint t) {
  MoEPlan& P = plan;
  Record& rec = pending.record;
  const std::int64_t T = S * B, H = h, Es = E;
  const std::size_t es = dtype_size(dt);
  auto routed_rows = [&] {
    std::int64_t N = 0;
    for (auto n : P.tokens_per_expert) N += n;
    return N;
  };
  switch (t) {
    case MoETapPoint::SharedFc1:
      rec.add(Role::Tap, "mlp.shared_experts.linear_fc1.0",
              download(P.shared_fc1, dt, {S, B, (P.glu ? 2 : 1) * std::int64_t(shared_ffn)}));
      break;
    case MoETapPoint::SharedFc2:
      rec.add(Role::Tap, "mlp.shared_experts.linear_fc2.0", download(P.shared_out, dt, {S, B, H}));
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
        rounding_reduce(T + (z ? 0 : Es));
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
    case MoETapPoint::ExpertsOutput: {
      const std::int64_t N = routed_rows();
      const Tensor all = download(P.expert_out, dt, {N, H});
      std::int64_t row = 0;
      for (int e = 0; e < E; ++e) {
        const std::int64_t n = P.tokens_per_expert[std::size_t(e)];
        Tensor part = Tensor::empty(dt, {n, H});
        if (n) std::memcpy(part.raw_mut(), all.raw() + std::size_t(row * H) * es, std::size_t(n * H) * es);
        rec.add(Role::Tap, "mlp.experts.local_experts." + std::to_string(e) + ".0", part);
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

// Runs one phase's kernel sequence on the rank's stream: eager, or (router and postprocess, with
// use_graph) captured into the phase's graph once and replayed.
void MoETransformerLayer::run_graph_phase(Impl& m, PhaseKind kind) {
  const LayerKernels& kernels = layer_kernels(options_.backend);
  void (*fn)(MoEPlan&, cudaStream_t) = nullptr;
  StreamGraph* graph = nullptr;
  switch (kind) {
    case PhaseKind::Router:
      fn = kernels.moe_router_phase;
      graph = &m.router_graph;
      break;
    case PhaseKind::ExpertCompute:
      fn = kernels.moe_expert_compute;
      break;
    case PhaseKind::Postprocess:
      fn = kernels.moe_postprocess;
      graph = &m.postprocess_graph;
      break;
  }
  MoEPlan& P = m.plan;
  const cudaStream_t st = m.stream->handle();
  if (!graph) return fn(P, st);
  P.capturing = graph->will_capture(m.fo.use_graph);
  graph->run(*m.stream, m.fo.use_graph, [&] { fn(P, st); });
  P.capturing = false;
}

// The expert-compute phase (_forward_mlp_expert_compute): the tokens per expert to the host, the
// grouped experts (at ep > 1 between the dispatcher's dispatch and combine); always eager.
void MoETransformerLayer::expert_compute_rank(int rank) {
  Impl& m = *ranks_[std::size_t(rank)];
  run_phase([&] { run_graph_phase(m, PhaseKind::ExpertCompute); }, [&] { m.end_forward(); });
  m.done = Impl::Phase::ExpertCompute;
}

// The postprocess phase (_forward_mlp_postprocess): combine, + shared experts, mlp_bda; the
// output and the record of the whole forward.
LayerOutput MoETransformerLayer::postprocess_rank(int rank) {
  Impl& m = *ranks_[std::size_t(rank)];
  return run_phase(
      [&] {
        run_graph_phase(m, PhaseKind::Postprocess);
        m.stream->synchronize();
        LayerOutput result = std::move(m.pending);
        result.hidden_states = m.download(m.plan.attn.out, m.dt, {m.S, m.B, m.h});
        m.end_forward();
        return result;
      },
      [&] { m.end_forward(); });
}

}  // namespace twin::opt
