// Host side of the optimized dense layer's backward, one job per part: what it supports
// (backward_unsupported), its buffers (each rank's gradients and the scratch between the ops,
// RankGrads), running the ranks (transformer_layer.cuh rank_backward_impl on the forward's kept
// buffers, one thread per simulated rank), putting the ranks' shards of each gradient back into
// Megatron's full tensor, and the parameter grads' magnitudes (computed here on the host from the
// gradients and activations the run leaves in its buffers, as the reference's ParamGrad defines
// them).
#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "optimized/layer/attention_half.h"
#include "optimized/layer/grad_magnitudes.h"
#include "optimized/layer/kernels.h"
#include "optimized/layer/rank_runner.h"
#include "optimized/transformer_layer_impl.h"

namespace twin::opt {

namespace {

// The attention half's gradient slots (layer/attention_half.h), then the MLP's.
constexpr GradSlot kMlpGradSlots[] = {
    {"mlp.linear_fc1.weight", &RankGrads::fc1_w, 0},
    {"mlp.linear_fc1.bias", &RankGrads::fc1_b, 0},
    {"mlp.linear_fc2.weight", &RankGrads::fc2_w, 1},
    {"mlp.linear_fc2.bias", &RankGrads::fc2_b, -1},
};

const GradSlot* find_grad_slot(const std::string& key) {
  for (const GradSlot& s : kAttentionHalfGradSlots)
    if (key == s.key) return &s;
  for (const GradSlot& s : kMlpGradSlots)
    if (key == s.key) return &s;
  return nullptr;
}

ShardLayout shard_layout(const GradSlot& s, bool glu) {
  const bool fc1 = s.slot == &RankGrads::fc1_w || s.slot == &RankGrads::fc1_b;
  return ShardLayout{s.shard_dim, fc1 && glu ? 2 : 1};
}

}  // namespace

// ---- what it supports ----------------------------------------------------------------------------
std::optional<std::string> DenseTransformerLayer::backward_unsupported() const {
  const std::string why = attention_half_backward_unsupported(impl_->ranks.at(0).plan.post_ln_residual);
  if (!why.empty()) return why;
  return std::nullopt;
}

// ---- its buffers: each rank's gradients and scratch for the current (s, b) --------------------------
void DenseTransformerLayer::Impl::ensure_grad_buffers(rt::Backend backend) {
  Impl& m = *this;
  const RankPlan& p0 = m.ranks.at(0).plan;
  if (m.grads_s == p0.s && m.grads_b == p0.b) return;
  m.grads_s = m.grads_b = -1;
  for (Rank& R : m.ranks) R.backward_graph.reset();  // it wrote into the buffers released here
  for (Rank& R : m.ranks) {
    const RankPlan& p = R.plan;
    const std::int64_t n = std::int64_t(p.s) * p.b, nl = std::int64_t(p.s_local()) * p.b;
    BufferArena& A = R.grad_bufs;
    A.clear();
    auto buf_if = [&](bool want, const char* name, std::int64_t rows, std::int64_t cols) {
      return want ? A.add(*m.dev, name, m.dt, rows, cols) : nullptr;
    };
    RankGrads g;
    g.dout = A.add(*m.dev, "dout", m.dt, nl, m.h);
    g.dx = A.add(*m.dev, "dx", m.dt, nl, m.h);
    for (const auto& [key, full] : m.full)
      if (const GradSlot* s = find_grad_slot(key))
        g.*s->slot = A.add(*m.dev, s->key, m.dt, full.numel() / (s->shard_dim < 0 ? 1 : p.tp));
    g.dh1 = A.add(*m.dev, "dh1", m.dt, nl, m.h);
    g.d_mlp = A.add(*m.dev, "d_mlp", m.dt, nl, m.h);
    g.d_mlp_full = buf_if(p.sp, "d_mlp_full", n, m.h);
    g.d_act = A.add(*m.dev, "d_act", m.dt, n, p.ffn_local());
    g.d_fc1 = A.add(*m.dev, "d_fc1", m.dt, n, (p.glu ? 2 : 1) * p.ffn_local());
    g.d_ln2_partial = buf_if(p.tp > 1, "d_ln2_partial", n, m.h);
    g.d_ln2 = A.add(*m.dev, "d_ln2", m.dt, nl, m.h);
    g.d_proj = A.add(*m.dev, "d_proj", m.dt, nl, m.h);
    g.d_proj_full = buf_if(p.sp, "d_proj_full", n, m.h);
    add_attention_half_grad_scratch(A, *m.dev, p, g);
    g.d_ln1_partial = buf_if(p.tp > 1, "d_ln1_partial", n, m.h);
    g.d_ln1 = A.add(*m.dev, "d_ln1", m.dt, nl, m.h);
    g.workspace_bytes = layer_kernels(backend).rank_backward_workspace_bytes(p);
    g.workspace = A.add<std::byte>(*m.dev, "workspace", g.workspace_bytes);
    R.grads = g;
  }
  m.grads_s = p0.s;
  m.grads_b = p0.b;
}

// ---- running it ----------------------------------------------------------------------------------
LayerGradients DenseTransformerLayer::backward(const Tensor& grad_output, bool with_magnitudes, bool use_graph) {
  if (const auto why = backward_unsupported()) throw std::logic_error("optimized dense layer: no backward for " + *why);
  Impl& m = *impl_;
  if (!m.kept)
    throw std::logic_error("optimized dense layer: backward() needs the last forward run with keep_for_backward");
  const int tp = options_.tp;
  check_graph_ranks("optimized dense layer: the backward's", use_graph, tp, options_.backend);
  const RankPlan& p = m.local().plan;
  const std::int64_t n = std::int64_t(p.s) * p.b, n_local = std::int64_t(p.s_local()) * p.b;
  const std::size_t es = dtype_size(m.dt), slice_bytes = std::size_t(n_local) * m.h * es;
  grad_output.expect({p.s, p.b, m.h}, m.dt, "optimized dense layer: grad_output");
  m.ensure_grad_buffers(options_.backend);
  rt::Device& dev = *m.dev;
  // Each rank's output gradient: with SP its sequence slice, else the whole of it.
  for (int r = 0; r < tp; ++r)
    if (m.here(r))
      dev.copy(const_cast<void*>(m.ranks[r].grads.dout), grad_output.raw() + (p.sp ? r * slice_bytes : 0), slice_bytes,
               rt::CopyKind::HostToDevice, m.ranks[r].stream->handle());
  const LayerKernels& kernels = layer_kernels(options_.backend);
  run_ranks_counted(
      tp,
      [&](int r) {
        Impl::Rank& R = m.ranks[r];
        R.backward_graph.run(*R.stream, use_graph, [&] { kernels.rank_backward(R.plan, R.grads, R.stream->handle()); });
        R.stream->synchronize();
      },
      options_.processes);

  // A tensor each rank holds part of ([rows, cols] per rank, `layout`; dim < 0: rank 0's is the
  // whole), put back together in the full layer's layout, shards in rank order.
  auto gathered = [&](auto ptr_of, std::int64_t rows, std::int64_t cols, ShardLayout layout) {
    std::vector<Tensor> parts;
    for (int r = 0; r < (layout.dim < 0 ? 1 : tp); ++r)
      parts.push_back(download_tensor(dev, *m.ranks[r].stream, ptr_of(m.ranks[r]), m.dt, {rows, cols}));
    std::vector<const Tensor*> shards;
    for (const Tensor& t : parts) shards.push_back(&t);
    return gather_shards(shards, layout);
  };
  const ShardLayout by_rows = p.sp ? ShardLayout{0, 1} : ShardLayout{};
  // A rank's RankGrads / RankPlan buffer, by member, for `gathered`.
  auto grad_buf = [](auto member) { return [member](const Impl::Rank& R) -> const void* { return R.grads.*member; }; };
  auto plan_buf = [](auto member) { return [member](const Impl::Rank& R) -> const void* { return R.plan.*member; }; };

  LayerGradients out;
  out.hidden_states = gathered(grad_buf(&RankGrads::dx), n_local, m.h, by_rows);
  out.hidden_states = out.hidden_states.reshape({p.s, p.b, m.h});
  for (const std::string& key : dense_layer_param_keys(config_)) {
    const GradSlot* s = find_grad_slot(key);
    if (!s || !(m.local().grads.*s->slot))
      throw std::logic_error("optimized dense layer: the backward computes no gradient of '" + key + "'");
    const Tensor& full = m.full.at(key);
    const ShardLayout layout = shard_layout(*s, p.glu);
    const int parts = layout.dim < 0 ? 1 : tp;
    // the rank's shard as a [rows, cols] matrix (a bias: [numel, 1])
    const std::int64_t rows = full.dim() == 1 ? full.numel() / parts : full.size(0) / (layout.dim == 0 ? parts : 1),
                       cols = full.dim() == 1 ? 1 : full.size(1) / (layout.dim == 1 ? parts : 1);
    ParamGradient pg;
    pg.name = key;
    pg.value = gathered(grad_buf(s->slot), rows, cols, layout).reshape(full.shape());
    out.params.push_back(std::move(pg));
  }
  if (!with_magnitudes) return out;

  // The magnitudes: each op's output gradient and input as the run left them, as full tensors,
  // with the full layer's plan (its qkv layout is the ranks' query groups side by side).
  RankPlan fp = p;
  fp.tp = 1;
  fp.sp = false;
  const std::int64_t h = m.h, w = (p.glu ? 2 : 1) * std::int64_t(m.ffn);
  auto rows_of = [&](auto ptr_of) { return gathered(ptr_of, n_local, h, by_rows); };
  auto cols_of = [&](auto ptr_of, std::int64_t cols, int blocks = 1) {
    return gathered(ptr_of, n, cols / tp, ShardLayout{1, blocks});
  };
  auto whole = [&](auto ptr_of, std::int64_t cols) { return gathered(ptr_of, n, cols, ShardLayout{}); };
  // a rank's buffer for `gathered`, picked from its plan and gradients
  auto of_rank = [](const MlaBufferOf& ptr) { return [ptr](const Impl::Rank& R) { return ptr(R.plan, R.grads); }; };
  const RankTensorReaders read{[&](const MlaBufferOf& ptr) { return rows_of(of_rank(ptr)); },
                               [&](const MlaBufferOf& ptr, std::int64_t cols) { return cols_of(of_rank(ptr), cols); },
                               [&](const MlaBufferOf& ptr, std::int64_t cols) { return whole(of_rank(ptr), cols); }};
  std::map<std::string, AttentionHalfMagnitudes::Source> sources = attention_half_magnitude_sources(fp, read);
  AttentionHalfMagnitudes attention(fp, n, std::move(sources));
  std::vector<double> d_fc1, d_mlp;  // read once, for the MLP's weights and biases
  auto mlp_grads = [&] {
    if (!d_fc1.empty()) return;
    d_fc1 = abs_values(cols_of(grad_buf(&RankGrads::d_fc1), w, p.glu ? 2 : 1));
    d_mlp = abs_values(rows_of(grad_buf(&RankGrads::d_mlp)));
  };
  auto magnitude = [&](const std::string& key) -> double {
    if (const auto a = attention(key)) return *a;
    mlp_grads();
    if (key == "mlp.linear_fc1.weight")
      return weight_magnitude(d_fc1, abs_values(whole(plan_buf(&RankPlan::ln2_full), h)), n, w, h);
    if (key == "mlp.linear_fc1.bias") return column_magnitude(d_fc1, n, w);
    if (key == "mlp.linear_fc2.weight")
      return weight_magnitude(d_mlp, abs_values(cols_of(plan_buf(&RankPlan::act_out), m.ffn)), n, h, m.ffn);
    if (key == "mlp.linear_fc2.bias") return column_magnitude(d_mlp, n, h);
    throw std::logic_error("optimized dense layer: no magnitude rule for the gradient of '" + key + "'");
  };
  for (ParamGradient& pg : out.params) pg.magnitude = magnitude(pg.name);
  return out;
}

// ---- timing it -----------------------------------------------------------------------------------
double DenseTransformerLayer::time_backward_ms(int iters) {
  Impl::Rank& R = impl_->ranks.at(0);
  return R.backward_graph.time_ms(*impl_->dev, *R.stream, iters,
                                  "time_backward_ms: call backward() with use_graph first (tp = 1)");
}

}  // namespace twin::opt
