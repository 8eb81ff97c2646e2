// Host side of the optimized MoE layer: its parameter keys, its plan binding (the attention half
// as every kind's, layer/attention_half.h; the MoE MLP's, moe_layer.h), its three phases' steps
// (inputs, buffers, streams, graphs) and the ranks run through layer/rank_runner.h. The kernel
// sequence is moe_layer.cuh, called through layer/kernels.h.
#include "optimized/moe/moe_transformer_layer.h"
#include "optimized/moe/moe_transformer_layer_impl.h"

#include <cmath>
#include <cstring>
#include <optional>
#include <tuple>

#include "core/progress.h"
#include "optimized/layer/attention_half.h"
#include "optimized/layer/graph_cache.h"
#include "optimized/layer/kernels.h"
#include "optimized/layer/rank_exchange.h"
#include "optimized/layer/rank_runner.h"
#include "optimized/layer/sharding.h"
#include "optimized/moe/moe_layer.h"
#include "optimized/moe/moe_transformer_layer_plan.h"
#include "optimized/runtime/collectives.h"
#include "optimized/runtime/processes.h"

namespace twin::opt {

namespace {

constexpr char kWho[] = "optimized MoE layer";

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
  const int tp = o.tp;  // the layer runs options.tp ranks (the config's size is where a golden ran)
  if (tp > 1) {
    // Megatron trains an MoE layer at tp > 1 only with sequence parallelism (moe_layer.py raises
    // without it); each rank then routes its slice of the tokens through whole experts.
    if (!o.sp)
      return "MoE at tensor_model_parallel_size > 1 without sequence_parallel (Megatron trains it only with SP)";
    // At expert tensor-parallel size 1 Megatron forms the expert-parallel groups of consecutive
    // ranks, inside the tensor-parallel ones: at ep = tp the two are one group.
    if (ep > 1 && ep != tp)
      return "tensor and expert parallelism together other than ep = tp (tp " + std::to_string(tp) + ", ep " +
             std::to_string(ep) + ")";
    if (c.moe_expert_capacity_factor)
      return "an expert capacity under sequence parallelism (each rank would cut its own slice of the tokens)";
    if (c.moe_shared_expert_intermediate_size.value_or(0) % tp != 0)
      return "moe_shared_expert_intermediate_size not divisible by tensor_model_parallel_size";
    TransformerConfig attention = c;  // the attention half's sizes (the layer has no dense MLP)
    attention.ffn_hidden_size = tp;
    try {
      check_tensor_parallel_sizes("a tensor-parallel split Megatron refuses too", attention, tp, "tp");
    } catch (const ConfigError& e) {
      return e.what();
    }
  }
  return "";
}

std::vector<std::string> moe_layer_param_keys(const TransformerConfig& c) {
  std::vector<std::string> k = attention_half_param_keys(c);
  for (std::string& key : moe_mlp_param_keys(c)) k.push_back(std::move(key));
  return k;
}

MoETransformerLayer::~MoETransformerLayer() = default;

MoETransformerLayer::MoETransformerLayer(const TransformerConfig& c, const std::map<std::string, Tensor>& params,
                                         LayerOptions o)
    : config_(c), options_(o) {
  if (const std::string why = moe_layer_unsupported(c, o); !why.empty())
    throw ConfigError(std::string(kWho) + ": unsupported: " + why);
  // One group of ranks: expert-parallel (ep > 1), tensor-parallel (tp > 1) or both at ep = tp.
  const int ep = c.expert_model_parallel_size, n = std::max(ep, o.tp);
  std::vector<std::unique_ptr<rt::Communicator>> comms = make_rank_communicators(kWho, n, o.processes, o.backend);
  for (int r = 0; r < n; ++r) {
    ranks_.push_back(std::make_unique<Impl>());
    Impl& m = *ranks_.back();
    (o.tp > 1 ? m.tp_comm : m.ep_comm) = n > 1 ? std::move(comms[std::size_t(r)]) : nullptr;
    if (!runs_rank(r, o.processes)) m.weights.set_elsewhere();  // its process holds them (and its buffers)
    init_rank(m, c, params, o, ep > 1 ? r : 0, o.tp > 1 ? r : 0);
    if (o.processes) m.stream->set_process(r);
  }
}

MoETransformerLayer::Impl& MoETransformerLayer::local() const {
  return *ranks_[std::size_t(options_.processes ? rt::process_rank() : 0)];
}

// One expert-parallel rank: every parameter checked, the attention half's and the router's
// uploaded, and this rank's local experts.
void MoETransformerLayer::init_rank(Impl& m, const TransformerConfig& c, const std::map<std::string, Tensor>& params,
                                    const LayerOptions& o, int ep_rank, int tp_rank) {
  m.dt = params_dtype(c);
  m.h = c.hidden_size;
  m.np = c.num_attention_heads;
  m.ng = c.query_groups();
  m.hn = c.head_dim();
  m.mlp.who = kWho;
  m.mlp.configure(c, ep_rank);
  if (m.np % m.ng != 0) throw ConfigError(std::string(kWho) + ": heads not divisible by query groups");
  m.dev = &rt::device(o.backend);
  m.stream.emplace(*m.dev);

  // ---- params: every key present, right shape and dtype; no other key
  std::map<std::string, Shape> shapes = attention_half_param_shapes(c);
  m.mlp.add_param_shapes(c, shapes);
  m.full = checked_params(kWho, params, moe_layer_param_keys(c), shapes, m.dt);
  for (const auto& [key, t] : params) {
    if (m.full.count(key)) continue;
    if (key == "mlp.router.expert_bias" && c.moe_router_enable_expert_bias) {
      t.expect({m.mlp.E}, std::string(kWho) + ": parameter 'mlp.router.expert_bias'");
      m.full[key] = t;
      continue;
    }
    throw ShapeError(std::string(kWho) + ": parameter '" + key + "' is not one the MoE layer owns");
  }

  // ---- the plan: the attention half as the dense layer's RankPlan (this rank's shards), then the MoE MLP
  RankPlan& p = m.plan.attn;
  plan_attention_half(p, c, o.layer_number);
  p.ffn = m.mlp.ffn;
  p.tp = o.tp;
  p.rank = tp_rank;
  p.sp = o.sp;
  p.comm = m.tp_comm.get();
  for (const PlanWeight& w : kAttentionHalfWeights)
    if (m.full.count(w.key))
      p.*w.slot = m.weights.upload(*m.dev, tensor_parallel_shard(c, w.key, m.full.at(w.key), tp_rank, o.tp));
  rt::Communicator* const ep_comm = m.ep_comm ? m.ep_comm.get() : c.expert_model_parallel_size > 1 ? p.comm : nullptr;
  m.mlp.bind(m.plan, c, m.full, ep_rank, ep_comm, m.weights, *m.dev, tp_rank, o.tp);
}

std::vector<std::int64_t> MoETransformerLayer::tokens_per_expert() const {
  std::vector<std::int64_t> n = ranks_.front()->plan.tokens_per_expert;
  for (std::size_t r = 1; r < ranks_.size() && options_.tp > 1; ++r)  // each rank's tokens
    for (std::size_t e = 0; e < n.size(); ++e) n[e] += ranks_[r]->plan.tokens_per_expert[e];
  return n;
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
  return gather_tensor_parallel(std::move(outs));
}

// At ep > 1 the taps are rank 0's (the other ranks hold the same tokens: their routing and
// outputs are rank 0's), as a rank-0 hook in Megatron records them; at tp > 1 every rank records
// its part.
ForwardOptions MoETransformerLayer::rank_options(const ForwardOptions& fo, int rank) const {
  ForwardOptions rank_fo = fo;
  rank_fo.record_taps = fo.record_taps && (rank == 0 || options_.tp > 1);
  return rank_fo;
}

// The output's sequence slices in rank order; the attention half's taps gathered by their
// layouts, then the MoE MLP's (gather_tensor_parallel_moe_records). At ep > 1 (or one rank) rank 0's.
LayerOutput MoETransformerLayer::gather_tensor_parallel(std::vector<LayerOutput> outs) {
  share_forward_results(outs);
  if (options_.tp == 1) return std::move(outs.front());
  LayerOutput out;
  std::vector<const Tensor*> slices;
  for (const LayerOutput& o : outs) slices.push_back(&o.hidden_states);
  out.hidden_states = gather_shards(slices, ShardLayout{0, 1});
  std::vector<std::vector<RankTap>> attention;
  std::vector<Record> moe;
  std::vector<std::vector<std::int64_t>> tokens;
  for (std::size_t r = 0; r < ranks_.size(); ++r) {
    attention.push_back(std::move(ranks_[r]->attention_taps));
    ranks_[r]->attention_taps.clear();
    moe.push_back(std::move(outs[r].record));
    tokens.push_back(ranks_[r]->plan.tokens_per_expert);
  }
  if (moe.front().entries.empty()) return out;
  out.record = gather_rank_taps(attention, kWho);
  for (RecordEntry& e : gather_tensor_parallel_moe_records(moe, tokens, local().plan.glu).entries)
    out.record.entries.push_back(std::move(e));
  return out;
}

void MoETransformerLayer::share_forward_results(std::vector<LayerOutput>& outs) {
  if (!options_.processes) return;
  share_ranks(outs, true);
  std::vector<std::vector<RankTap>> attention;
  std::vector<std::vector<std::int64_t>> tokens, local_tokens;
  for (const auto& r : ranks_) {
    attention.push_back(std::move(r->attention_taps));
    tokens.push_back(r->plan.tokens_per_expert);
    local_tokens.push_back(r->plan.local_tokens_per_expert);
  }
  share_ranks(attention, true);
  share_ranks(tokens, true);
  share_ranks(local_tokens, true);
  for (std::size_t r = 0; r < ranks_.size(); ++r) {
    ranks_[r]->attention_taps = std::move(attention[r]);
    ranks_[r]->plan.tokens_per_expert = std::move(tokens[r]);
    ranks_[r]->plan.local_tokens_per_expert = std::move(local_tokens[r]);
  }
}

void MoETransformerLayer::set_gather_expert_taps(const ForwardOptions& fo) {
  if (config_.expert_model_parallel_size > 1)
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
  run_phase([&] { run_ranks_counted(static_cast<int>(ranks_.size()), phase, options_.processes); },
            [&] {
              for (auto& r : ranks_) r->end_forward();
            });
}

void MoETransformerLayer::_forward_mlp_router(const Tensor& hidden_states, const MoEForwardInputs& in,
                                              const ForwardOptions& fo) {
  progress::now("_forward_mlp_router");
  set_gather_expert_taps(fo);
  on_every_rank([&](int r) { router_rank(r, hidden_states, in, rank_options(fo, r)); });
}

// The preconditions are checked here, before any rank runs, and leave the forward in flight as it
// was; the ranks move through the phases in step, so rank 0's phase is every rank's.
void MoETransformerLayer::_forward_mlp_expert_compute() {
  progress::now("_forward_mlp_expert_compute");
  const Impl::Phase done = local().done;
  if (done != Impl::Phase::Router)
    throw std::logic_error(
        std::string("optimized MoE layer: _forward_mlp_expert_compute needs _forward_mlp_router first") +
        (done == Impl::Phase::ExpertCompute ? " (it already ran on the last router phase's outputs)" : "") +
        kPhaseOrder);
  on_every_rank([&](int r) { expert_compute_rank(r); });
}

LayerOutput MoETransformerLayer::_forward_mlp_postprocess() {
  progress::now("_forward_mlp_postprocess");
  const Impl::Phase done = local().done;
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
  return gather_tensor_parallel(std::move(outs));
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
  const AttentionInputsWithAngles ai =
      check_attention_inputs(kWho, config_, hidden_states, in.attention_mask, in.rotary_pos_emb);
  if (fo.use_graph && (fo.record_taps || in.recorded_routing_map))
    throw std::invalid_argument(std::string(kWho) + ": graph replay runs without taps and without a recorded map");
  MoEPlan& P = m.plan;
  RankPlan& p = P.attn;
  if (p.sp && ai.s % p.tp != 0)
    throw ShapeError(std::string(kWho) + ": sequence length " + std::to_string(ai.s) + " not divisible by tp " +
                     std::to_string(p.tp) + " under sequence parallelism");
  if (p.tp > 1 && in.padding_mask)
    throw ConfigError(std::string(kWho) +
                      ": unsupported: a padding_mask at tp > 1 (each rank holds a slice of "
                      "the sequence, the mask is the whole batch's)");
  // This rank's tokens: under sequence parallelism rows [rank T, (rank + 1) T) of the token order
  // t = s_idx * b + b_idx.
  const std::int64_t T = std::int64_t(ai.s / p.tp) * ai.b;
  m.padding = token_padding(kWho, in.padding_mask, ai.s, ai.b);
  m.recorded = recorded_map(kWho, in.recorded_routing_map, T * p.tp, m.mlp.E);
  if (!m.recorded.empty() && p.tp > 1)
    m.recorded = std::vector<std::uint8_t>(m.recorded.begin() + p.rank * T * m.mlp.E,
                                           m.recorded.begin() + (p.rank + 1) * T * m.mlp.E);

  m.ensure_buffers(
      BufferShape{ai.s, ai.b, ai.rot, in.attention_mask ? in.attention_mask->nbytes() : 0, !m.padding.empty()});
  m.upload_inputs(hidden_states, in, ai.angles);
  const MaskMode mask_mode = self_attention_mask_mode(in.attention_mask != nullptr, options_.attn_mask_type, ai.s);
  m.kept = false;  // set again once this forward's postprocess has run
  m.backward_done = Impl::BackwardPhase::None;
  const bool kept_changed = m.set_kept_buffers(fo.keep_for_backward, fo.record_taps);
  if (set_forward_streams(p, fo, mask_mode, ai.mask_b, ai.mask_h) || kept_changed) {  // graphs bake these in
    m.reset_graphs();
  }
  p.mask = in.attention_mask ? m.mask.as<const std::uint8_t>() : nullptr;
  p.rot_dim = ai.rot;
  p.rope_interleaved = config_.rotary_interleaved;
  p.freqs = ai.rot ? m.freqs.as<const float>() : nullptr;
  P.padding = m.padding.empty() ? nullptr : m.pad.as<const std::uint8_t>();
  P.padding_host = m.padding.empty() ? nullptr : &m.padding;
  P.recorded_map = m.recorded.empty() ? nullptr : m.recorded.data();
  if (m.mlp.set_losses(P, config_, fo)) {  // the loss arguments the router graphs bake in
    m.router_graph.reset();
    m.backward_router_graph.reset();
  }

  // The record fills over the three phases; the hooks live as long as the layer's Impl (they
  // capture it, never this phase's locals).
  m.pending = LayerOutput{};
  m.attention_taps.clear();
  m.mlp.max_logit = 0.0;
  m.fo = fo;
  m.S = ai.s / p.tp;  // this rank's (sequence parallel) slice
  m.B = ai.b;
  Impl* const mp = &m;
  p.on_tap = fo.record_taps ? std::function<void(TapPoint)>([mp](TapPoint t) { mp->attention_tap(t); }) : nullptr;
  P.on_tap = fo.record_taps ? std::function<void(MoETapPoint)>([mp](MoETapPoint t) {
    mp->mlp.tap(
        t, mp->plan, mp->S, mp->B,
        [mp](const void* ptr, DType type, Shape shape) { return mp->download(ptr, type, std::move(shape)); },
        mp->pending.record);
  })
                            : nullptr;

  run_graph_phase(m, PhaseKind::Router);
  if (fo.use_graph && P.local_tokens)  // the counter is host work, kept out of the graph
    m.mlp.count_routed_tokens(m.download(P.routing_map, DType::BOOL, {T, m.mlp.E}), m.padding);
  P.recorded_map = nullptr;  // read by the router phase alone
  P.padding_host = nullptr;
}

// ---- the router phase's steps ----------------------------------------------------------------------
// (Re)allocates the buffers when the shape changes; graphs are recorded against them.
void MoETransformerLayer::Impl::ensure_buffers(const BufferShape& shape) {
  if (shape == buffer_shape) return;
  buffer_shape = shape;
  reset_graphs();
  acts.clear();
  MoEPlan& P = plan;
  RankPlan& p = P.attn;
  p.s = shape.s;
  p.b = shape.b;
  rt::Device& d = *dev;
  BufferArena& A = acts;
  const std::int64_t T = std::int64_t(p.s_local()) * shape.b;  // this rank's tokens
  x_in = rt::DeviceBuffer(d, std::size_t(T * h) * dtype_size(dt));
  p.x = x_in.get();
  add_attention_half_buffers(A, d, p);
  freqs = shape.rot ? rt::DeviceBuffer(d, std::size_t(shape.s) * shape.rot * sizeof(float)) : rt::DeviceBuffer();
  mask = shape.mask_bytes ? rt::DeviceBuffer(d, shape.mask_bytes) : rt::DeviceBuffer();
  pad = shape.padding ? rt::DeviceBuffer(d, std::size_t(T)) : rt::DeviceBuffer();
  mlp.add_buffers(P, A, d, shape.s, shape.b, p.tp);
}

void MoETransformerLayer::Impl::upload_inputs(const Tensor& hidden_states, const MoEForwardInputs& in,
                                              const Tensor& angles) {
  const std::size_t slice = hidden_states.nbytes() / std::size_t(plan.attn.tp);  // the rank's sequence slice
  x_in.upload(hidden_states.raw() + std::size_t(plan.attn.rank) * slice, slice);
  if (angles.defined()) freqs.upload(angles.raw(), angles.nbytes());
  if (in.attention_mask) mask.upload(in.attention_mask->raw(), in.attention_mask->nbytes());
  if (!padding.empty()) pad.upload(padding.data(), padding.size());
}

// The softmax statistics [b, np, s, 2] fp32 (also read by the core_attention tap's magnitude);
// qk-layernorm works in place on linear_qkv's output, so its backward reads a copy from before
// [s, b, qkv_width] (the dense layer's kept buffers).
bool MoETransformerLayer::Impl::set_kept_buffers(bool keep, bool record_taps) {
  RankPlan& p = plan.attn;
  auto kept_buffer = [&](rt::DeviceBuffer& buf, std::size_t bytes, bool want) -> void* {
    if (!want) return nullptr;
    if (buf.bytes() != bytes) buf = rt::DeviceBuffer(*dev, bytes);
    return buf.get();
  };
  float* const stats = static_cast<float*>(
      kept_buffer(softmax_stats, sizeof(float) * 2 * std::size_t(p.b) * p.np_local() * p.s, keep || record_taps));
  void* const pre_norm = kept_buffer(qkv_pre_norm, std::size_t(p.s) * p.b * std::size_t(p.qkv_width()) * dtype_size(dt),
                                     keep && p.qk_layernorm && !p.mla.on);
  const bool changed = p.softmax_stats != stats || p.qkv_pre_norm != pre_norm;
  p.softmax_stats = stats;
  p.qkv_pre_norm = pre_norm;
  return changed;
}

// The attention half's taps as every kind records them: at tp = 1 every tensor whole, into the
// record; at tp > 1 this rank's parts (gathered after the forward).
void MoETransformerLayer::Impl::attention_tap(TapPoint t) {
  std::vector<RankTap> taps;
  RankTapRecorder rec{plan.attn, full,
                      [&](const void* ptr, DType type, Shape shape) { return download(ptr, type, std::move(shape)); },
                      taps};
  rec.attention_half(t);
  if (plan.attn.tp > 1) {
    for (RankTap& tap : taps) attention_taps.push_back(std::move(tap));
    return;
  }
  for (RankTap& tap : taps) {
    RecordEntry& e = pending.record.add(Role::Tap, tap.name, std::move(tap.value));
    e.rounding = tap.rounding;
    e.block_magnitude = std::move(tap.block_magnitude);
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
        m.kept = m.fo.keep_for_backward;
        result.hidden_states = m.download(m.plan.attn.out, m.dt, {m.S, m.B, m.h});
        m.end_forward();
        return result;
      },
      [&] { m.end_forward(); });
}

}  // namespace twin::opt
