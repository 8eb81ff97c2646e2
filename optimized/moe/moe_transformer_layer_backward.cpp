// Host side of the optimized MoE layer's backward, one job per part as the dense layer's
// (transformer_layer_backward.cpp): what it supports, its buffers, running it on the forward's
// kept buffers (moe_layer_backward.cuh through layer/kernels.h), each parameter's gradient under
// its Megatron key, and the magnitudes their rounding error scales with (computed here on the host
// from the gradients and activations the run leaves in its buffers, as the reference's ParamGrad
// defines them).
#include <algorithm>
#include <map>
#include <utility>
#include <stdexcept>

#include "core/progress.h"
#include "optimized/layer/attention_half.h"
#include "optimized/layer/grad_magnitudes.h"
#include "optimized/layer/kernels.h"
#include "optimized/layer/rank_runner.h"
#include "optimized/moe/moe_transformer_layer_impl.h"

namespace twin::opt {

namespace {

constexpr char kWho[] = "optimized MoE layer";

}  // namespace

// ---- what it supports ----------------------------------------------------------------------------
std::optional<std::string> MoETransformerLayer::backward_unsupported() const {
  const TransformerConfig& c = config_;
  if (const std::string why = attention_half_backward_unsupported(local().plan.attn.post_ln_residual); !why.empty())
    return why;
  if (c.moe_router_load_balancing_type == "sinkhorn") return std::string("sinkhorn routing");
  if (c.moe_input_jitter_eps) return std::string("moe_input_jitter_eps (the jitter's backward)");
  if (c.moe_router_force_load_balancing) return std::string("moe_router_force_load_balancing");
  if (c.calculate_per_token_loss) return std::string("calculate_per_token_loss (the losses scaled by the token count)");
  if (c.add_bias_linear) return std::string("biases (add_bias_linear: the router's and the experts')");
  if (c.moe_apply_probs_on_input) return std::string("moe_apply_probs_on_input");
  if (c.bias_activation_fusion) return std::string("bias_activation_fusion (the fused activation's backward)");
  return std::nullopt;
}

// ---- its buffers: the gradients and scratch for the current (s, b) ---------------------------------
void MoETransformerLayer::Impl::ensure_grad_buffers(rt::Backend backend) {
  if (grads_shape == buffer_shape) return;
  grads_shape = BufferShape{};
  backward_postprocess_graph.reset();  // they wrote into the buffers released here
  backward_router_graph.reset();
  const MoEPlan& P = plan;
  const RankPlan& p = P.attn;
  rt::Device& d = *dev;
  BufferArena& A = grad_bufs;
  A.clear();
  // T: this rank's tokens (its sequence slice at tp > 1), n: the layer's
  const std::int64_t T = std::int64_t(p.s_local()) * p.b, n = std::int64_t(p.s) * p.b, H = h, E = P.E, N = T * E;
  const int w1 = (P.glu ? 2 : 1) * P.ffn, sf = P.shared_ffn / p.tp, sw1 = (P.glu ? 2 : 1) * sf;
  const DType rdt = P.rdt;
  MoEGrads g;
  // ---- the attention half and pre_mlp_layernorm (this rank's shards and rows)
  RankGrads& a = g.attn;
  a.dout = A.add(d, "dout", dt, T, H);
  a.dx = A.add(d, "dx", dt, T, H);
  for (const GradSlot& s : kAttentionHalfGradSlots)
    if (full.count(s.key)) a.*s.slot = A.add(d, s.key, dt, full.at(s.key).numel() / (s.shard_dim < 0 ? 1 : p.tp));
  a.dh1 = A.add(d, "dh1", dt, T, H);
  a.d_mlp = A.add(d, "d_mlp", dt, T, H);
  a.d_ln2 = A.add(d, "d_ln2", dt, T, H);
  a.d_proj = A.add(d, "d_proj", dt, T, H);
  a.d_proj_full = p.sp ? A.add(d, "d_proj_full", dt, n, H) : nullptr;
  add_attention_half_grad_scratch(A, d, p, a);
  a.d_ln1_partial = p.tp > 1 ? A.add(d, "d_ln1_partial", dt, n, H) : nullptr;
  a.d_ln1 = A.add(d, "d_ln1", dt, T, H);
  a.workspace_bytes = layer_kernels(backend).moe_rank_backward_workspace_bytes(P);
  a.workspace = A.add<std::byte>(d, "workspace", a.workspace_bytes);
  // ---- MoELayer
  g.d_output = a.d_mlp;
  g.d_input = a.d_ln2;
  g.router_w = A.add(d, "router_w", dt, E, H);
  g.fc1_w = A.add(d, "fc1_w", dt, P.local_E, w1, H);
  g.fc2_w = A.add(d, "fc2_w", dt, P.local_E, H, P.ffn);
  if (P.ep > 1) {
    g.ep_d_recv = A.add(d, "ep_d_recv", dt, N, H);
    g.ep_d_out = A.add(d, "ep_d_out", dt, N, H);
    g.ep_d_in = A.add(d, "ep_d_in", dt, N, H);
    g.ep_d_in_probs = A.add(d, "ep_d_in_probs", rdt, N);
    g.ep_d_recv_probs = A.add(d, "ep_d_recv_probs", rdt, N);
  }
  if (P.ep > 1 && P.allgather) {
    const std::int64_t TG = T * P.ep;
    g.ag_d = A.add(d, "ag_d", dt, TG, H);
    g.ag_d_local_probs = A.add(d, "ag_d_local_probs", rdt, TG, P.local_E);
    g.ag_d_probs_recv = A.add(d, "ag_d_probs_recv", rdt, TG, P.local_E);
  }
  g.d_rows = A.add(d, "d_rows", dt, N, H);
  g.d_act = A.add(d, "d_act", dt, N, P.ffn);
  g.d_fc1 = A.add(d, "d_fc1", dt, N, w1);
  g.d_permuted = A.add(d, "d_permuted", dt, N, H);
  g.d_permuted_probs = A.add(d, "d_permuted_probs", rdt, N);
  g.d_hidden = A.add(d, "d_hidden", dt, T, H);
  g.dprobs = A.add(d, "dprobs", rdt, T, E);
  g.aux_grad = A.add<float>(d, "aux_grad", T, E);
  g.aux_scratch = A.add<double>(d, "aux_scratch", 2, p.b, E);
  g.dlogits = A.add(d, "dlogits", rdt, T, E);
  g.d_x_r = rdt != dt ? A.add(d, "d_x_r", rdt, T, H) : nullptr;
  g.d_router_w_r = rdt != dt ? A.add(d, "d_router_w_r", rdt, E, H) : nullptr;
  g.d_x_router = A.add(d, "d_x_router", dt, T, H);
  if (P.shared_ffn > 0) {
    g.shared_fc1_w = A.add(d, "shared_fc1_w", dt, sw1, H);
    g.shared_fc2_w = A.add(d, "shared_fc2_w", dt, H, sf);
    g.shared_gate_w = P.shared_gate ? A.add(d, "shared_gate_w", dt, H) : nullptr;
    g.d_shared_mlp = P.shared_gate ? A.add(d, "d_shared_mlp", dt, T, H) : nullptr;
    g.d_gate_logits = P.shared_gate ? A.add(d, "d_gate_logits", dt, T) : nullptr;
    g.d_shared_full = p.sp ? A.add(d, "d_shared_full", dt, n, H) : nullptr;
    g.d_shared_act = A.add(d, "d_shared_act", dt, n, sf);
    g.d_shared_fc1 = A.add(d, "d_shared_fc1", dt, n, sw1);
    g.d_x_shared_partial = p.tp > 1 ? A.add(d, "d_x_shared_partial", dt, n, H) : nullptr;
    g.d_x_shared = A.add(d, "d_x_shared", dt, T, H);
  }
  grads = g;
  grads_shape = buffer_shape;
}

namespace {

// An expert's parameter key "mlp.experts.local_experts.<e>.<rest>": e and rest; e = -1 for
// another key.
std::pair<int, std::string> expert_of_key(const std::string& key) {
  const std::string prefix = "mlp.experts.local_experts.";
  if (key.rfind(prefix, 0) != 0) return {-1, ""};
  const std::size_t dot = key.find('.', prefix.size());
  return {std::stoi(key.substr(prefix.size(), dot - prefix.size())), key.substr(dot + 1)};
}

// Where the gradient of an MoE parameter lies in its rank's MoEGrads: its buffer and, for an
// expert's weight, the local expert l's block of [local_E, rows, cols]; null for a key that is
// not MoELayer's.
const void* moe_grad_of(const MoEGrads& g, const MoEPlan& P, int h, const std::string& key, std::size_t es) {
  if (key == "mlp.router.weight") return g.router_w;
  if (key == "mlp.shared_experts.linear_fc1.weight") return g.shared_fc1_w;
  if (key == "mlp.shared_experts.linear_fc2.weight") return g.shared_fc2_w;
  if (key == "mlp.shared_experts.gate_weight") return g.shared_gate_w;
  const auto [e, rest] = expert_of_key(key);
  if (e < 0) return nullptr;
  const std::size_t l = std::size_t(e % P.local_E), w1 = std::size_t(P.glu ? 2 : 1) * P.ffn;
  if (rest == "linear_fc1.weight") return static_cast<const char*>(g.fc1_w) + l * w1 * h * es;
  if (rest == "linear_fc2.weight") return static_cast<const char*>(g.fc2_w) + l * std::size_t(P.ffn) * h * es;
  return nullptr;
}

// The experts' rows of one rank's backward (absolute values), expert-major: local expert l's rows
// are [offset_l, offset_l + tokens[l]).
struct ExpertRows {
  std::vector<double> d_out, act_out, d_fc1, in;
  std::vector<std::int64_t> tokens;
};

// The weight magnitude of local expert l's linear `rest` over the rows every part holds of it, one
// part after the other (each part's rows add to the gradient), divided by `scale`.
double expert_weight_magnitude(const std::vector<const ExpertRows*>& parts, int l, const std::string& rest,
                               std::int64_t h, std::int64_t ffn, std::int64_t w1, double scale) {
  std::vector<double> d_out, act_out, d_fc1, in;
  std::int64_t rows = 0;
  auto append = [](std::vector<double>& to, const std::vector<double>& from, std::int64_t first, std::int64_t n,
                   std::int64_t cols) {
    to.insert(to.end(), from.begin() + first * cols, from.begin() + (first + n) * cols);
  };
  for (const ExpertRows* x : parts) {
    std::int64_t first = 0;
    for (int i = 0; i < l; ++i) first += x->tokens[std::size_t(i)];
    const std::int64_t n = x->tokens[std::size_t(l)];
    if (rest == "linear_fc2.weight") {
      append(d_out, x->d_out, first, n, h);
      append(act_out, x->act_out, first, n, ffn);
    } else {
      append(d_fc1, x->d_fc1, first, n, w1);
      append(in, x->in, first, n, h);
    }
    rows += n;
  }
  if (rows == 0) return 0.0;
  if (rest == "linear_fc2.weight") return weight_magnitude(d_out, act_out, rows, h, ffn) / scale;
  if (rest == "linear_fc1.weight") return weight_magnitude(d_fc1, in, rows, w1, h) / scale;
  throw std::logic_error(std::string(kWho) + ": no magnitude rule for the gradient of an expert's " + rest);
}

}  // namespace

// ---- running it ----------------------------------------------------------------------------------
namespace {

constexpr char kBackwardOrder[] =
    " (a backward runs _backward_mlp_postprocess, _backward_mlp_expert_compute, _backward_mlp_router in turn after a "
    "forward run with keep_for_backward)";

}  // namespace

LayerGradients MoETransformerLayer::backward(const Tensor& grad_output, bool with_magnitudes, bool use_graph) {
  _backward_mlp_postprocess(grad_output, use_graph);
  _backward_mlp_expert_compute();
  return _backward_mlp_router(with_magnitudes, use_graph);
}

// One backward phase on every expert-parallel rank (one thread each at ep > 1: the dispatcher's
// collectives pair them): eager, or (postprocess, router, with use_graph) from its graph. If any
// rank throws, every rank drops the backward in flight.
void MoETransformerLayer::run_backward_phase(BackwardPhaseKind kind, bool use_graph,
                                             const std::function<void(Impl&)>& before) {
  const LayerKernels& kernels = layer_kernels(options_.backend);
  try {
    run_ranks_counted(
        static_cast<int>(ranks_.size()),
        [&](int r) {
          Impl& R = *ranks_[std::size_t(r)];
          if (before) before(R);
          const cudaStream_t st = R.stream->handle();
          switch (kind) {
            case BackwardPhaseKind::Postprocess:
              R.backward_postprocess_graph.run(*R.stream, use_graph,
                                               [&] { kernels.moe_backward_postprocess(R.plan, R.grads, st); });
              break;
            case BackwardPhaseKind::ExpertCompute:
              kernels.moe_backward_expert_compute(R.plan, R.grads, st);
              break;
            case BackwardPhaseKind::Router:
              R.backward_router_graph.run(*R.stream, use_graph,
                                          [&] { kernels.moe_backward_router(R.plan, R.grads, st); });
              break;
          }
          R.stream->synchronize();
        },
        options_.processes);
  } catch (...) {
    for (auto& R : ranks_) R->backward_done = Impl::BackwardPhase::None;
    throw;
  }
}

// The postprocess phase's backward: d out to every rank (each holds a replica of the batch), the
// most rows one token was dispatched to (the permute backward's sums), mlp_bda's, the combine's
// and the shared experts' backward.
void MoETransformerLayer::_backward_mlp_postprocess(const Tensor& grad_output, bool use_graph) {
  progress::now("_backward_mlp_postprocess");
  if (const auto why = backward_unsupported()) throw std::logic_error(std::string(kWho) + ": no backward for " + *why);
  Impl& m = local();
  if (!m.kept)
    throw std::logic_error(std::string(kWho) + ": backward needs the last forward run with keep_for_backward" +
                           kBackwardOrder);
  const RankPlan& p = m.plan.attn;
  const std::int64_t T = std::int64_t(p.s_local()) * p.b, E = m.plan.E;
  grad_output.expect({p.s, p.b, m.h}, m.dt, std::string(kWho) + ": grad_output");
  // Each rank's output gradient: its sequence slice at tp > 1 (ep > 1: every rank's replica, the whole).
  const std::size_t slice = grad_output.nbytes() / std::size_t(p.tp);
  run_backward_phase(BackwardPhaseKind::Postprocess, use_graph, [&](Impl& R) {
    const Tensor map = R.download(R.plan.routing_map, DType::BOOL, {T, E});
    int most_rows = 0;
    for (std::int64_t t = 0; t < T; ++t) {
      int rows = 0;
      for (std::int64_t e = 0; e < E; ++e) rows += map.at_f64(t * E + e) != 0.0;
      most_rows = std::max(most_rows, rows);
    }
    R.backward_done = Impl::BackwardPhase::None;
    R.ensure_grad_buffers(options_.backend);
    R.grads.most_rows = most_rows;
    R.dev->copy(const_cast<void*>(R.grads.attn.dout), grad_output.raw() + std::size_t(R.plan.attn.rank) * slice, slice,
                rt::CopyKind::HostToDevice, R.stream->handle());
  });
  for (auto& R : ranks_) R->backward_done = Impl::BackwardPhase::Postprocess;
}

void MoETransformerLayer::_backward_mlp_expert_compute() {
  progress::now("_backward_mlp_expert_compute");
  if (local().backward_done != Impl::BackwardPhase::Postprocess)
    throw std::logic_error(std::string(kWho) + ": _backward_mlp_expert_compute needs _backward_mlp_postprocess first" +
                           kBackwardOrder);
  run_backward_phase(BackwardPhaseKind::ExpertCompute, false);
  for (auto& R : ranks_) R->backward_done = Impl::BackwardPhase::ExpertCompute;
}

// The router phase's backward, then every gradient under its Megatron key: rank 0 holds all but
// the experts' weights', each on its owner rank.
LayerGradients MoETransformerLayer::_backward_mlp_router(bool with_magnitudes, bool use_graph) {
  progress::now("_backward_mlp_router");
  if (local().backward_done != Impl::BackwardPhase::ExpertCompute)
    throw std::logic_error(std::string(kWho) + ": _backward_mlp_router needs _backward_mlp_expert_compute first" +
                           kBackwardOrder);
  run_backward_phase(BackwardPhaseKind::Router, use_graph);
  for (auto& R : ranks_) R->backward_done = Impl::BackwardPhase::None;

  Impl& m = local();
  const RankPlan& p = m.plan.attn;
  const std::size_t es = dtype_size(m.dt);
  LayerGradients out;
  out.hidden_states = gathered([](const Impl& R) -> const void* { return R.grads.attn.dx; }, {p.s_local(), p.b, m.h},
                               p.tp > 1 ? ShardLayout{0, 1} : ShardLayout{}, m.dt);
  for (const std::string& key : moe_layer_param_keys(config_)) {
    const int e = expert_of_key(key).first;
    const int owner = e < 0 ? 0 : e / m.plan.local_E;  // an expert's gradient is its owner's (ep > 1)
    // how the tensor-parallel ranks hold it: the attention half's by its slot, the shared experts'
    // as Megatron shards an MLP, the rest whole on every rank (after the backward's sums)
    ShardLayout layout = p.tp > 1 ? tensor_parallel_layout(config_, key) : ShardLayout{};
    void* RankGrads::*slot = nullptr;
    for (const GradSlot& s : kAttentionHalfGradSlots)
      if (key == s.key) {
        slot = s.slot;
        layout = p.tp > 1 ? ShardLayout{s.shard_dim, 1} : ShardLayout{};
      }
    Shape part = m.full.at(key).shape();
    if (layout.dim >= 0) part[std::size_t(layout.dim)] /= p.tp;
    auto grad_of = [&](const Impl& R) -> const void* {
      return slot ? R.grads.attn.*slot : moe_grad_of(R.grads, R.plan, m.h, key, es);
    };
    if (runs_rank(owner, options_.processes) && !grad_of(*ranks_[std::size_t(owner)]))
      throw std::logic_error(std::string(kWho) + ": the backward computes no gradient of '" + key + "'");
    ParamGradient pg;
    pg.name = key;
    pg.value = gathered(grad_of, part, layout, m.dt, owner);
    out.params.push_back(std::move(pg));
  }
  if (with_magnitudes) set_magnitudes(out);
  return out;
}

// A tensor each tensor-parallel rank holds part of (`part` on each; layout.dim < 0: the rank
// `first`'s is the whole), put back together in the full layer's layout, parts in rank order.
Tensor MoETransformerLayer::gathered(const std::function<const void*(const Impl&)>& ptr_of, const Shape& part,
                                     ShardLayout layout, DType as, int first) const {
  std::vector<Tensor> parts;
  for (int r = layout.dim < 0 ? first : 0; r < (layout.dim < 0 ? first + 1 : options_.tp); ++r) {
    Impl& R = *ranks_[std::size_t(r)];
    parts.push_back(R.download(ptr_of(R), as, part));
  }
  std::vector<const Tensor*> shards;
  for (const Tensor& t : parts) shards.push_back(&t);
  return gather_shards(shards, layout);
}

// The magnitudes: each op's output gradient and input as the run left them, as the full layer's
// tensors (at tp > 1 every rank's parts put together, with the full layer's plan); an expert's rows
// on its owner rank (ep > 1) or on every rank (tp > 1: each rank's rows of the expert in turn).
void MoETransformerLayer::set_magnitudes(LayerGradients& out) const {
  const Impl& m = local();
  const MoEPlan& P = m.plan;
  const RankPlan& p = P.attn;
  const int tp = p.tp;
  const std::int64_t n = std::int64_t(p.s) * p.b, T = std::int64_t(p.s_local()) * p.b, h = m.h, E = P.E, ffn = P.ffn,
                     w1 = (P.glu ? 2 : 1) * ffn, sf = P.shared_ffn, sw1 = (P.glu ? 2 : 1) * sf;
  using PtrOf = std::function<const void*(const Impl&)>;
  // [n, cols] from each rank's rows [T, cols] / columns [n, cols / tp] / rank 0's whole [n, cols]
  auto rows_of = [&](const PtrOf& ptr, std::int64_t cols, DType as) {
    return gathered(ptr, {T, cols}, tp > 1 ? ShardLayout{0, 1} : ShardLayout{}, as);
  };
  auto rows = [&](const PtrOf& ptr, std::int64_t cols) { return rows_of(ptr, cols, m.dt); };
  auto cols_of = [&](const PtrOf& ptr, std::int64_t cols, int blocks = 1) {
    return gathered(ptr, {n, cols / tp}, tp > 1 ? ShardLayout{1, blocks} : ShardLayout{}, m.dt);
  };
  auto whole = [&](const PtrOf& ptr, std::int64_t cols) { return gathered(ptr, {n, cols}, ShardLayout{}, m.dt); };
  auto act = [](auto member) { return [member](const Impl& R) -> const void* { return R.plan.attn.*member; }; };
  RankPlan fp = p;  // the full layer's
  fp.tp = 1;
  fp.sp = false;
  auto of_rank = [](const MlaBufferOf& ptr) {
    return PtrOf([ptr](const Impl& R) { return ptr(R.plan.attn, R.grads.attn); });
  };
  const RankTensorReaders read{[&](const MlaBufferOf& ptr) { return rows(of_rank(ptr), h); },
                               [&](const MlaBufferOf& ptr, std::int64_t cols) { return cols_of(of_rank(ptr), cols); },
                               [&](const MlaBufferOf& ptr, std::int64_t cols) { return whole(of_rank(ptr), cols); }};
  std::map<std::string, AttentionHalfMagnitudes::Source> sources = attention_half_magnitude_sources(fp, read);
  AttentionHalfMagnitudes attention(fp, n, std::move(sources));
  const std::vector<double> x = abs_values(rows(act(&RankPlan::ln2), h));  // MoELayer's input [n, h]
  auto moe = [](auto member) { return [member](const Impl& R) -> const void* { return R.grads.*member; }; };
  // Each rank's expert rows, read once (an expert's rows: its owner's at ep > 1, every rank's at
  // tp > 1; at ep > 1 every rank's replica of each token's row, the weight gradient scaled by 1 / ep).
  std::map<int, ExpertRows> rows_of_rank;
  auto expert_rows = [&](int r) -> const ExpertRows& {
    auto it = rows_of_rank.find(r);
    if (it != rows_of_rank.end()) return it->second;
    Impl& R = *ranks_[std::size_t(r)];
    ExpertRows x;
    x.tokens = P.ep == 1 ? R.plan.tokens_per_expert : R.plan.local_tokens_per_expert;
    std::int64_t rows = 0;
    for (auto t : x.tokens) rows += t;
    auto read = [&](const void* ptr, std::int64_t cols) { return abs_values(R.download(ptr, R.dt, {rows, cols})); };
    x.d_out = read(P.ep == 1 ? R.grads.d_rows : R.grads.ep_d_out, h);
    x.act_out = read(R.plan.act_out, ffn);
    x.d_fc1 = read(R.grads.d_fc1, w1);
    x.in = read(P.ep == 1 ? R.plan.permuted : R.plan.ep_in, h);
    return rows_of_rank.emplace(r, std::move(x)).first->second;
  };
  auto magnitude = [&](const std::string& key) -> double {
    if (const auto a = attention(key)) return *a;
    if (key == "mlp.router.weight")
      return weight_magnitude(abs_values(rows_of(moe(&MoEGrads::dlogits), E, P.rdt)), x, n, E, h);
    if (key == "mlp.shared_experts.linear_fc1.weight")
      return weight_magnitude(abs_values(cols_of(moe(&MoEGrads::d_shared_fc1), sw1, P.glu ? 2 : 1)), x, n, sw1, h);
    if (key == "mlp.shared_experts.linear_fc2.weight")
      return weight_magnitude(
          abs_values(rows(P.shared_gate ? PtrOf(moe(&MoEGrads::d_shared_mlp)) : PtrOf(moe(&MoEGrads::d_output)), h)),
          abs_values(cols_of([](const Impl& R) -> const void* { return R.plan.shared_act; }, sf)), n, h, sf);
    if (key == "mlp.shared_experts.gate_weight")
      return weight_magnitude(abs_values(rows(moe(&MoEGrads::d_gate_logits), 1)), x, n, 1, h);
    if (const auto [e, rest] = expert_of_key(key); e >= 0) {
      // the owner holds every row of its experts at ep > 1, else each rank its tokens' rows
      std::vector<const ExpertRows*> parts;
      for (int r = 0; r < int(ranks_.size()); ++r)
        if (P.ep == 1 || r == e / P.local_E) parts.push_back(&expert_rows(r));
      return expert_weight_magnitude(parts, e % P.local_E, rest, h, ffn, w1,
                                     P.ep_replicas ? P.ep : 1);  // moe_expert_wgrad_scale's
    }
    throw std::logic_error(std::string(kWho) + ": no magnitude rule for the gradient of '" + key + "'");
  };
  for (ParamGradient& pg : out.params) pg.magnitude = magnitude(pg.name);
}

}  // namespace twin::opt
