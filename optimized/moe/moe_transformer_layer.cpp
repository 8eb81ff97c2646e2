// Host side of the optimized MoE layer: what it supports, parameters onto the device, buffers,
// taps and losses into the Record. The kernel sequence is moe_layer.cuh.
#include "optimized/moe/moe_transformer_layer.h"

#include <cmath>
#include <cstring>
#include <optional>

#include "optimized/activations.cuh"            // Act
#include "optimized/dot_product_attention.cuh"  // MaskMode
#include "optimized/moe/moe_transformer_layer_plan.h"
#include "optimized/moe/router.cuh"  // ScoreFunction, AuxLossKind, kRouterMaxExperts
#include "optimized/runtime/collectives.h"

namespace twin::opt {

static_assert(sim::kRouterMaxExperts == kMaxRouterExperts, "the feature table's expert limit is the router kernel's");

namespace {

DType router_dtype(const TransformerConfig& c) {
  if (c.moe_router_dtype == std::optional<std::string>("fp32")) return DType::F32;
  if (c.moe_router_dtype == std::optional<std::string>("fp64")) return DType::F64;
  return params_dtype(c);
}

std::string expert_key(int e, const std::string& rest) {
  return "mlp.experts.local_experts." + std::to_string(e) + "." + rest;
}

std::string fmt_key(int s, int b, int rot, std::size_t mask_bytes, bool padding) {
  return std::to_string(s) + "," + std::to_string(b) + "," + std::to_string(rot) + "," + std::to_string(mask_bytes) +
         "," + (padding ? "p" : "-");
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
  std::vector<std::string> k;
  for (const auto& d : dense_layer_param_keys(c))
    if (d.rfind("mlp.", 0) != 0) k.push_back(d);
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
  std::vector<rt::DeviceBuffer> weights, acts;
  std::optional<rt::Stream> stream;
  MoEPlan plan;
  rt::DeviceBuffer global_tokens;  // global_aux_loss accumulator
  double ga_steps = 0;
  std::vector<double> local_tokens;  // expert-bias counter
  bool has_expert_bias = false;
  // Buffers of the current shape, the inputs' device copies and the phases' graphs.
  std::string shape_key;
  rt::DeviceBuffer x_in, freqs, mask, pad;
  std::optional<rt::Graph> router_graph, postprocess_graph;
  int graph_aux_kind = -2;
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
};

MoETransformerLayer::~MoETransformerLayer() = default;

MoETransformerLayer::MoETransformerLayer(const TransformerConfig& c, const std::map<std::string, Tensor>& params,
                                         LayerOptions o)
    : config_(c), options_(o) {
  if (const std::string why = moe_layer_unsupported(c, o); !why.empty())
    throw ConfigError("optimized MoE layer: unsupported: " + why);
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
    throw ConfigError("optimized MoE layer: moe_router_topk " + std::to_string(m.topk) + " outside [1, " +
                      std::to_string(m.E) + "]");
  if (m.ffn <= 0) throw ConfigError("optimized MoE layer: moe_ffn_hidden_size must be > 0");
  if (m.shared_ffn > 0 && c.add_bias_linear)
    throw ConfigError("optimized MoE layer: bias is not supported in the shared experts (add_bias_linear)");
  if (m.np % m.ng != 0) throw ConfigError("optimized MoE layer: heads not divisible by query groups");
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
  const auto keys = moe_layer_param_keys(c);
  for (const auto& key : keys) {
    auto it = params.find(key);
    if (it == params.end()) throw ShapeError("optimized MoE layer: missing parameter '" + key + "'");
    it->second.expect(shapes.at(key), m.dt, "optimized MoE layer: parameter '" + key + "'");
    m.full[key] = it->second;
  }
  for (const auto& [key, t] : params) {
    if (m.full.count(key)) continue;
    if (key == "mlp.router.expert_bias" && c.moe_router_enable_expert_bias) {
      t.expect({m.E}, "optimized MoE layer: parameter 'mlp.router.expert_bias'");
      m.full[key] = t;
      continue;
    }
    throw ShapeError("optimized MoE layer: parameter '" + key + "' is not one the MoE layer owns");
  }

  // ---- the plan: the attention half as the dense layer's RankPlan (tp = 1)
  MoEPlan& P = m.plan;
  RankPlan& p = P.attn;
  p.h = m.h;
  p.np = m.np;
  p.ng = m.ng;
  p.hn = m.hn;
  p.ffn = m.ffn;
  p.dt = m.dt;
  p.rms = c.normalization != "LayerNorm";
  p.eps = c.layernorm_epsilon;
  p.zero_centered_gamma = c.layernorm_zero_centered_gamma;
  p.qk_layernorm = c.qk_layernorm;
  p.glu = c.gated_linear_unit;
  p.act = static_cast<int>(sim::act_from_name(c.activation_func));
  double scale = c.softmax_scale ? *c.softmax_scale : 1.0 / std::sqrt(static_cast<double>(m.hn));
  if (c.apply_query_key_layer_scaling) {
    p.coeff = static_cast<float>(std::max(1, o.layer_number));
    scale /= std::max(1, o.layer_number);
  }
  p.alpha = static_cast<float>(scale);
  p.softmax_fp32 = !(c.fp16 || c.bf16) || c.attention_softmax_in_fp32 || c.apply_query_key_layer_scaling;
  p.hidden_dropout = c.hidden_dropout;
  p.attention_dropout = c.attention_dropout;
  m.weights.reserve(64);
  p.ln1_w = m.upload_opt("input_layernorm.weight");
  p.ln1_b = m.upload_opt("input_layernorm.bias");
  p.qkv_w = m.upload_opt("self_attention.linear_qkv.weight");
  p.qkv_b = m.upload_opt("self_attention.linear_qkv.bias");
  p.qln_w = m.upload_opt("self_attention.q_layernorm.weight");
  p.qln_b = m.upload_opt("self_attention.q_layernorm.bias");
  p.kln_w = m.upload_opt("self_attention.k_layernorm.weight");
  p.kln_b = m.upload_opt("self_attention.k_layernorm.bias");
  p.proj_w = m.upload_opt("self_attention.linear_proj.weight");
  p.proj_b = m.upload_opt("self_attention.linear_proj.bias");
  p.ln2_w = m.upload_opt("pre_mlp_layernorm.weight");
  p.ln2_b = m.upload_opt("pre_mlp_layernorm.bias");

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
  P.score = static_cast<int>(c.moe_router_score_function == "sigmoid" ? sim::ScoreFunction::Sigmoid
                                                                      : sim::ScoreFunction::Softmax);
  P.pre_softmax = c.moe_router_pre_softmax;
  P.group_topk = c.moe_router_group_topk.value_or(0);
  P.num_groups = P.group_topk > 0 ? c.moe_router_num_groups.value_or(0) : 0;
  P.scaling_factor = static_cast<float>(c.moe_router_topk_scaling_factor.value_or(0.0));
  P.drop = c.moe_expert_capacity_factor.has_value();
  P.capacity_factor = c.moe_expert_capacity_factor.value_or(0.0);
  P.drop_by_probs = c.moe_token_drop_policy == "probs";
  if (c.moe_token_drop_policy != "probs" && c.moe_token_drop_policy != "position")
    throw ConfigError("optimized MoE layer: moe_token_drop_policy '" + c.moe_token_drop_policy + "'");
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
  const int ep = static_cast<int>(ranks_.size());
  run_phase(
      [&] {
        if (ep == 1) return phase(0);
        const RoundingCount at_start = rounding_now();
        std::vector<RoundingCount> at_end(static_cast<std::size_t>(ep));
        rt::run_ranks(ep, [&](int r) {
          CountRoundings counting;
          rounding_set(at_start);
          phase(r);
          at_end[std::size_t(r)] = rounding_now();
        });
        RoundingCount ranks_end = at_start;
        for (const RoundingCount& e : at_end) ranks_end.join(e);
        rounding_set(ranks_end);
      },
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
  const TransformerConfig& c = config_;
  if (hidden_states.dim() != 3 || hidden_states.size(2) != m.h)
    throw ShapeError("optimized MoE layer: hidden_states expected [s, b, " + std::to_string(m.h) + "], got " +
                     shape_str(hidden_states.shape()));
  if (hidden_states.dtype() != m.dt)
    throw ShapeError("optimized MoE layer: hidden_states dtype differs from the params dtype");
  if (fo.use_graph && (fo.record_taps || in.recorded_routing_map))
    throw std::invalid_argument("optimized MoE layer: graph replay runs without taps and without a recorded map");
  const int s = static_cast<int>(hidden_states.size(0)), b = static_cast<int>(hidden_states.size(1));
  if (s <= 0 || b <= 0) throw ShapeError("optimized MoE layer: empty hidden_states");
  const std::int64_t T = std::int64_t(s) * b, H = m.h, E = m.E;
  int mask_b = 1, mask_h = 1;
  if (in.attention_mask) {
    const Shape& ms = in.attention_mask->shape();
    const bool ok = in.attention_mask->dtype() == DType::BOOL && ms.size() == 4 && (ms[0] == 1 || ms[0] == b) &&
                    (ms[1] == 1 || ms[1] == m.np) && ms[2] == s && ms[3] == s;
    if (!ok)
      throw ShapeError("optimized MoE layer: attention_mask expected BOOL [b, 1, s, s], got " +
                       in.attention_mask->describe());
    mask_b = static_cast<int>(ms[0]);
    mask_h = static_cast<int>(ms[1]);
  }
  int rot = 0;
  if (in.rotary_pos_emb) {
    const Shape& rs = in.rotary_pos_emb->shape();
    if (rs.size() != 4 || rs[0] != s || rs[1] != 1 || rs[2] != 1 || in.rotary_pos_emb->dtype() != DType::F32)
      throw ShapeError("optimized MoE layer: rotary_pos_emb expected F32 [s, 1, 1, rot_dim], got " +
                       in.rotary_pos_emb->describe());
    rot = static_cast<int>(rs[3]);
    if (rot <= 0 || rot % 2 || rot > m.hn) throw ShapeError("optimized MoE layer: bad rot_dim " + std::to_string(rot));
  }
  std::vector<std::uint8_t>& padding = m.padding;
  padding.clear();
  if (in.padding_mask) {
    if (in.padding_mask->shape() != Shape{b, s})
      throw ShapeError("optimized MoE layer: padding_mask expected [b, s] = " + shape_str({b, s}) + ", got " +
                       in.padding_mask->describe());
    padding.resize(std::size_t(T));
    for (std::int64_t si = 0; si < s; ++si)  // [b, s] -> token order t = s_idx * b + b_idx
      for (std::int64_t bi = 0; bi < b; ++bi)
        padding[std::size_t(si * b + bi)] = in.padding_mask->at_f64(bi * s + si) != 0.0;
  }
  std::vector<std::uint8_t>& recorded = m.recorded;
  recorded.clear();
  if (in.recorded_routing_map) {
    if (in.recorded_routing_map->shape() != Shape{T, E})
      throw ShapeError("optimized MoE layer: recorded routing map expected [T, E] = " + shape_str({T, E}) + ", got " +
                       in.recorded_routing_map->describe());
    recorded.resize(std::size_t(T * E));
    for (std::int64_t i = 0; i < T * E; ++i) recorded[std::size_t(i)] = in.recorded_routing_map->at_f64(i) != 0.0;
  }

  // ---- buffers: (re)allocated when the shape changes; graphs are recorded against them
  MoEPlan& P = m.plan;
  RankPlan& p = P.attn;
  const std::size_t es = dtype_size(m.dt), rs = dtype_size(m.rdt);
  const std::size_t tok = std::size_t(T);
  const std::string key = fmt_key(s, b, rot, in.attention_mask ? in.attention_mask->nbytes() : 0, !padding.empty());
  if (key != m.shape_key) {
    m.shape_key = key;
    m.router_graph.reset();
    m.postprocess_graph.reset();
    m.acts.clear();
    m.acts.reserve(64);
    auto buf = [&](std::size_t bytes) {
      m.acts.emplace_back(*m.dev, std::max<std::size_t>(bytes, 1));
      return m.acts.back().get();
    };
    p.s = s;
    p.b = b;
    m.x_in = rt::DeviceBuffer(*m.dev, tok * H * es);
    p.x = m.x_in.get();
    p.ln1 = p.ln1_full = buf(tok * H * es);
    p.qkv = buf(tok * p.qkv_width() * es);
    p.ctx = buf(tok * p.np_local() * m.hn * es);
    p.proj = buf(tok * H * es);
    p.h1 = buf(tok * H * es);
    p.ln2 = p.ln2_full = buf(tok * H * es);
    p.out = buf(tok * H * es);
    m.freqs = rot ? rt::DeviceBuffer(*m.dev, in.rotary_pos_emb->nbytes()) : rt::DeviceBuffer();
    m.mask = in.attention_mask ? rt::DeviceBuffer(*m.dev, in.attention_mask->nbytes()) : rt::DeviceBuffer();
    m.pad = padding.empty() ? rt::DeviceBuffer() : rt::DeviceBuffer(*m.dev, tok);
    const std::size_t nmax = tok * std::size_t(E), w1 = std::size_t((P.glu ? 2 : 1) * m.ffn);
    P.x_r = P.cast_input || m.rdt == DType::F64 ? buf(tok * H * rs) : nullptr;
    P.logits = buf(tok * E * rs);
    P.probs_pre = buf(tok * E * rs);
    P.map_pre = static_cast<std::uint8_t*>(buf(tok * E));
    P.probs = buf(tok * E * rs);
    P.routing_map = static_cast<std::uint8_t*>(buf(tok * E));
    P.aux_scores = static_cast<float*>(buf(tok * E * sizeof(float)));
    P.aux_map = static_cast<std::uint8_t*>(buf(tok * E));
    P.z = static_cast<float*>(buf(tok * sizeof(float)));
    P.loss_scratch = static_cast<double*>(buf(2 * std::size_t(b) * E * sizeof(double)));
    P.losses = static_cast<float*>(buf(2 * sizeof(float)));
    P.tokens_per_expert_dev = static_cast<std::int64_t*>(buf(E * sizeof(std::int64_t)));
    P.offsets = static_cast<std::int64_t*>(buf((E + 1) * sizeof(std::int64_t)));
    P.row_id_map = static_cast<std::int64_t*>(buf(nmax * sizeof(std::int64_t)));
    P.permuted = buf(nmax * H * es);
    P.permuted_probs = buf(nmax * rs);
    P.fc1 = buf(nmax * w1 * es);
    P.act_out = buf(nmax * m.ffn * es);
    P.expert_out = buf(nmax * H * es);
    P.combined = buf(tok * H * es);
    P.mlp_out = buf(tok * H * es);
    if (m.shared_ffn > 0) {
      P.shared_fc1 = buf(tok * (P.glu ? 2 : 1) * m.shared_ffn * es);
      P.shared_act = buf(tok * m.shared_ffn * es);
      P.shared_out = buf(tok * H * es);
      P.gate_logits = buf(tok * es);
    }
    if (P.ep > 1) {
      P.ep_counts = static_cast<std::int64_t*>(buf(std::size_t(P.ep) * E * sizeof(std::int64_t)));
      P.ep_recv = buf(nmax * H * es);
      P.ep_recv_probs = buf(nmax * rs);
      P.ep_in = buf(nmax * H * es);
      P.ep_in_probs = buf(nmax * rs);
      P.ep_out = buf(nmax * H * es);
      P.ep_offsets = static_cast<std::int64_t*>(buf((std::size_t(m.local_E) + 1) * sizeof(std::int64_t)));
    }
    if (P.ep > 1 && P.allgather) {
      const std::size_t tg = tok * std::size_t(P.ep), el = std::size_t(m.local_E);
      P.ag_x = buf(tg * H * es);
      P.ag_map = static_cast<std::uint8_t*>(buf(tg * E));
      P.ag_probs = buf(tg * E * rs);
      P.ag_local_map = static_cast<std::uint8_t*>(buf(tg * el));
      P.ag_local_probs = buf(tg * el * rs);
      P.ag_tokens_per_expert = static_cast<std::int64_t*>(buf(el * sizeof(std::int64_t)));
      P.ag_row_id_map = static_cast<std::int64_t*>(buf(el * tg * sizeof(std::int64_t)));
      P.ag_partial = buf(tg * H * es);
      P.ag_partial_r = m.rdt != m.dt ? buf(tg * H * rs) : nullptr;
      P.ag_combined_r = m.rdt != m.dt ? buf(tok * H * rs) : nullptr;
    }
  }
  m.x_in.upload(hidden_states.raw(), hidden_states.nbytes());
  if (rot) m.freqs.upload(in.rotary_pos_emb->raw(), in.rotary_pos_emb->nbytes());
  if (in.attention_mask) m.mask.upload(in.attention_mask->raw(), in.attention_mask->nbytes());
  if (!padding.empty()) m.pad.upload(padding.data(), tok);
  const int mask_mode = in.attention_mask                                ? static_cast<int>(sim::MaskMode::Explicit)
                        : (options_.attn_mask_type == "causal" && s > 1) ? static_cast<int>(sim::MaskMode::Causal)
                                                                         : static_cast<int>(sim::MaskMode::None);
  // graphs bake these values in: a change re-records
  if (p.training != fo.training || p.seed != fo.seed || p.offset_attention != fo.offset || p.mask_mode != mask_mode ||
      p.mask_b != mask_b || p.mask_h != mask_h) {
    m.router_graph.reset();
    m.postprocess_graph.reset();
  }
  p.training = fo.training;
  p.seed = fo.seed;
  p.offset_attention = fo.offset;
  p.offset_self_attn_bda = fo.offset + 1;
  p.offset_mlp_bda = fo.offset + 4;
  p.mask_mode = mask_mode;
  p.mask_b = mask_b;
  p.mask_h = mask_h;
  p.mask = in.attention_mask ? m.mask.as<const std::uint8_t>() : nullptr;
  p.rot_dim = rot;
  p.rope_interleaved = c.rotary_interleaved;
  p.freqs = rot ? m.freqs.as<const float>() : nullptr;
  P.padding = padding.empty() ? nullptr : m.pad.as<const std::uint8_t>();
  P.padding_host = padding.empty() ? nullptr : &padding;
  P.recorded_map = recorded.empty() ? nullptr : recorded.data();
  // The losses: only while training, as Megatron's router.
  const std::string& lb = c.moe_router_load_balancing_type;
  const bool aux_on =
      fo.training && c.moe_aux_loss_coeff > 0 && (lb == "aux_loss" || lb == "seq_aux_loss" || lb == "global_aux_loss");
  P.aux_kind = !aux_on                ? -1
               : lb == "aux_loss"     ? static_cast<int>(sim::AuxLossKind::AuxLoss)
               : lb == "seq_aux_loss" ? static_cast<int>(sim::AuxLossKind::SeqAuxLoss)
                                      : static_cast<int>(sim::AuxLossKind::GlobalAuxLoss);
  P.aux_coeff = c.moe_aux_loss_coeff;
  if (P.aux_kind == static_cast<int>(sim::AuxLossKind::GlobalAuxLoss)) m.ga_steps += 1;
  if (P.ga_steps != m.ga_steps || P.aux_kind != m.graph_aux_kind || P.z_loss != m.graph_z_loss) {
    m.router_graph.reset();  // the loss kernel's arguments are baked into the graph
    m.graph_aux_kind = P.aux_kind;
    m.graph_z_loss = P.z_loss;
  }
  P.ga_steps = m.ga_steps;
  P.z_loss = fo.training && c.moe_z_loss_coeff.has_value();
  P.z_coeff = c.moe_z_loss_coeff.value_or(0.0);
  P.local_tokens = m.has_expert_bias ? &m.local_tokens : nullptr;
  if (P.z_loss && P.z_coeff == 0.0) throw ConfigError("optimized MoE layer: moe_z_loss_coeff = 0");

  // ---- taps
  // The record fills over the three phases; the hooks live as long as the layer's Impl (they
  // capture it, never this phase's locals).
  m.pending = LayerOutput{};
  m.max_logit = 0.0;
  m.fo = fo;
  m.S = s;
  m.B = b;
  const std::int64_t S = s, B = b;
  Impl* const mp = &m;
  if (fo.record_taps) {
    p.on_tap = [mp, S, B, H, es](TapPoint t) {
      Impl& m = *mp;
      RankPlan& p = m.plan.attn;
      Record& rec = m.pending.record;
      auto download = [&](const void* ptr, DType type, Shape shape) { return m.download(ptr, type, shape); };
      auto bias_tap = [&](const std::string& name, const std::string& key) {
        if (m.full.count(key)) rec.add_exact(Role::Tap, name, m.full.at(key).clone());
      };
      switch (t) {
        case TapPoint::InputLayernorm:
          rec.add(Role::Tap, "input_layernorm", download(p.ln1, m.dt, {S, B, H}));
          break;
        case TapPoint::LinearQkv:
          rec.add(Role::Tap, "self_attention.linear_qkv.0", download(p.qkv, m.dt, {S, B, p.qkv_width()}));
          break;
        case TapPoint::QkLayernorm: {
          const Tensor qkv = download(p.qkv, m.dt, {S * B, p.qkv_width()});
          const int hpg = p.hpg();
          Tensor q = Tensor::empty(m.dt, {S, B, m.np, m.hn}), k = Tensor::empty(m.dt, {S, B, m.ng, m.hn});
          const std::size_t head = std::size_t(m.hn) * es;
          for (std::int64_t t2 = 0; t2 < S * B; ++t2)
            for (int g = 0; g < m.ng; ++g) {
              const std::byte* grp =
                  qkv.raw() + (std::size_t(t2) * p.qkv_width() + std::size_t(g) * (hpg + 2) * m.hn) * es;
              std::memcpy(q.raw_mut() + (std::size_t(t2) * m.np + std::size_t(g) * hpg) * head, grp, hpg * head);
              std::memcpy(k.raw_mut() + (std::size_t(t2) * m.ng + g) * head, grp + hpg * head, head);
            }
          rec.add(Role::Tap, "self_attention.q_layernorm", q);
          rec.add(Role::Tap, "self_attention.k_layernorm", k);
          break;
        }
        case TapPoint::CoreAttention:
          rec.add(Role::Tap, "self_attention.core_attention", download(p.ctx, m.dt, {S, B, std::int64_t(m.np) * m.hn}));
          break;
        case TapPoint::LinearProj: {
          const Tensor y = download(p.proj, m.dt, {S, B, H});
          rec.add(Role::Tap, "self_attention.linear_proj.0", y);
          bias_tap("self_attention.linear_proj.1", "self_attention.linear_proj.bias");
          rec.add(Role::Tap, "self_attention.0", y);
          bias_tap("self_attention.1", "self_attention.linear_proj.bias");
          break;
        }
        case TapPoint::PreMlpLayernorm:
          rec.add(Role::Tap, "pre_mlp_layernorm", download(p.ln2, m.dt, {S, B, H}));
          break;
        default:
          break;
      }
    };
    P.on_tap = [mp, S, B, H, T, E, es](MoETapPoint t) {
      Impl& m = *mp;
      MoEPlan& P = m.plan;
      Record& rec = m.pending.record;
      double& max_logit = m.max_logit;
      auto download = [&](const void* ptr, DType type, Shape shape) { return m.download(ptr, type, shape); };
      // The maps are one byte per element, 0 or 1: BOOL's storage.
      auto download_bool = [&](const void* ptr, Shape shape) { return m.download(ptr, DType::BOOL, shape); };
      switch (t) {
        case MoETapPoint::SharedFc1:
          rec.add(Role::Tap, "mlp.shared_experts.linear_fc1.0",
                  download(P.shared_fc1, m.dt, {S, B, (P.glu ? 2 : 1) * std::int64_t(m.shared_ffn)}));
          break;
        case MoETapPoint::SharedFc2:
          rec.add(Role::Tap, "mlp.shared_experts.linear_fc2.0", download(P.shared_out, m.dt, {S, B, H}));
          break;
        case MoETapPoint::SharedExperts:
          rec.add(Role::Tap, "mlp.shared_experts", download(P.shared_out, m.dt, {S, B, H}));
          break;
        case MoETapPoint::RouterLogits: {
          const Tensor logits = download(P.logits, m.rdt, {S, B, E});
          for (std::int64_t i = 0; i < logits.numel(); ++i) max_logit = std::max(max_logit, std::abs(logits.at_f64(i)));
          rec.add(Role::Tap, "mlp.router.logits", logits);
          break;
        }
        case MoETapPoint::RouterProbs: {
          // Probabilities move with the logits' absolute error (softmax and sigmoid are 1-Lipschitz).
          rec.add(Role::Tap, "mlp.router.0", download(P.probs, m.rdt, {T, E})).magnitude = 1.0 + max_logit;
          rec.add(Role::Tap, "mlp.router.1", download_bool(P.routing_map, {T, E}));
          // The losses, each with its own rounding points from here (as the reference counts them):
          // a load-balancing loss the sum over the tokens, x tokens_per_expert, the sum over the
          // experts, x its scale and / coeff; z_loss logsumexp, its square, their mean, x coeff and
          // / coeff; then the fp32 tracker.
          const RoundingCount before_log = rounding_now();
          const Tensor losses = download(P.losses, DType::F32, {2});
          std::map<std::string, double> logged;
          if (P.aux_kind >= 0) {
            const char* names[] = {"load_balancing_loss", "seq_load_balancing_loss", "global_load_balancing_loss"};
            logged[names[P.aux_kind]] = losses.at_f64(0);
          }
          if (P.z_loss) logged["z_loss"] = losses.at_f64(1);
          for (const auto& [name, v] : logged) {
            const bool z = name == "z_loss";
            rounding_store(m.rdt, z ? 5 : 4);
            rounding_reduce(T + (z ? 0 : E));
            rounding_store(DType::F32);
            rec.add(Role::Aux, name, Tensor::from_doubles(DType::F32, {}, {v})).magnitude =
                std::max(1.0 + max_logit, std::abs(v));
            rounding_set(before_log);
          }
          if (m.has_expert_bias)
            rec.add_exact(Role::State, "mlp.router.local_tokens_per_expert_after",
                          Tensor::from_doubles(DType::F64, {E}, m.local_tokens));
          break;
        }
        case MoETapPoint::ExpertInputs: {
          std::int64_t N = 0;
          for (auto n : P.tokens_per_expert) N += n;
          rec.add(Role::TapIn, "mlp.experts.dispatched_input", download(P.permuted, m.dt, {N, H}));
          rec.add(Role::TapIn, "mlp.experts.tokens_per_expert",
                  Tensor::from_vector<std::int64_t>({E}, P.tokens_per_expert));
          rec.add(Role::TapIn, "mlp.experts.permuted_probs", download(P.permuted_probs, m.rdt, {N})).magnitude =
              1.0 + max_logit;
          break;
        }
        case MoETapPoint::ExpertsOutput: {
          std::int64_t N = 0;
          for (auto n : P.tokens_per_expert) N += n;
          const Tensor all = download(P.expert_out, m.dt, {N, H});
          std::int64_t row = 0;
          for (int e = 0; e < m.E; ++e) {
            const std::int64_t n = P.tokens_per_expert[std::size_t(e)];
            Tensor part = Tensor::empty(m.dt, {n, H});
            if (n) std::memcpy(part.raw_mut(), all.raw() + std::size_t(row * H) * es, std::size_t(n * H) * es);
            rec.add(Role::Tap, "mlp.experts.local_experts." + std::to_string(e) + ".0", part);
            row += n;
          }
          rec.add(Role::Tap, "mlp.experts.0", all);
          break;
        }
        case MoETapPoint::MlpOutput:
          rec.add(Role::Tap, "mlp.0", download(P.mlp_out, m.dt, {S, B, H}));
          break;
      }
    };
  } else {
    p.on_tap = nullptr;
    P.on_tap = nullptr;
  }

  run_graph_phase(m, PhaseKind::Router);
  if (fo.use_graph && P.local_tokens) {  // the expert-bias counter, kept out of the graph
    m.stream->synchronize();
    const Tensor map = m.download(P.routing_map, DType::BOOL, {T, E});
    for (std::int64_t t = 0; t < T; ++t) {
      if (!padding.empty() && padding[std::size_t(t)]) continue;
      for (std::int64_t e = 0; e < E; ++e) m.local_tokens[std::size_t(e)] += map.at_f64(t * E + e);
    }
  }
  P.recorded_map = nullptr;  // read by the router phase alone
  P.padding_host = nullptr;
}

// Runs one phase's kernel sequence on the rank's stream: eager, or (router and postprocess, with
// use_graph) captured into the phase's graph once and replayed.
void MoETransformerLayer::run_graph_phase(Impl& m, PhaseKind kind) {
  using Fn = void (*)(MoEPlan&, cudaStream_t);
  Fn sim_fn = nullptr, cuda_fn = nullptr;
  std::optional<rt::Graph>* graph = nullptr;
  switch (kind) {
    case PhaseKind::Router:
      sim_fn = sim::moe_router_phase;
      graph = &m.router_graph;
      break;
    case PhaseKind::ExpertCompute:
      sim_fn = sim::moe_expert_compute;
      break;
    case PhaseKind::Postprocess:
      sim_fn = sim::moe_postprocess;
      graph = &m.postprocess_graph;
      break;
  }
#if TWIN_HAVE_CUDA
  cuda_fn = kind == PhaseKind::Router          ? cuda::moe_router_phase
            : kind == PhaseKind::ExpertCompute ? cuda::moe_expert_compute
                                               : cuda::moe_postprocess;
#else
  cuda_fn = sim_fn;
#endif
  const Fn fn = options_.backend == rt::Backend::Cuda ? cuda_fn : sim_fn;
  MoEPlan& P = m.plan;
  const cudaStream_t st = m.stream->handle();
  if (!graph || !m.fo.use_graph) return fn(P, st);
  if (!*graph) {
    P.capturing = true;
    m.stream->begin_capture();
    fn(P, st);
    graph->emplace(m.stream->end_capture());
    P.capturing = false;
  }
  (*graph)->launch(*m.stream);
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
