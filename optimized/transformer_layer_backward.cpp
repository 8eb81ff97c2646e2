// Host side of the optimized dense layer's backward at tp 1, one job per part: what it supports
// (backward_unsupported), its buffers (the gradients and the scratch between the ops, RankGrads),
// running it (transformer_layer.cuh rank_backward_impl on the forward's kept buffers) and the
// parameter grads' magnitudes (computed here on the host from the gradients and activations the
// run leaves in its buffers, as the reference's ParamGrad defines them).
#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "optimized/attention_backward.cuh"  // attention_half_backward_unsupported
#include "optimized/transformer_layer_impl.h"

namespace twin::opt {

namespace {

// Each parameter's gradient slot in RankGrads, by its Megatron state-dict key.
struct GradSlot {
  const char* key;
  void* RankGrads::*slot;
};
constexpr GradSlot kGradSlots[] = {
    {"input_layernorm.weight", &RankGrads::ln1_w},
    {"input_layernorm.bias", &RankGrads::ln1_b},
    {"self_attention.linear_qkv.weight", &RankGrads::qkv_w},
    {"self_attention.linear_qkv.bias", &RankGrads::qkv_b},
    {"self_attention.linear_proj.weight", &RankGrads::proj_w},
    {"self_attention.linear_proj.bias", &RankGrads::proj_b},
    {"self_attention.q_layernorm.weight", &RankGrads::qln_w},
    {"self_attention.q_layernorm.bias", &RankGrads::qln_b},
    {"self_attention.k_layernorm.weight", &RankGrads::kln_w},
    {"self_attention.k_layernorm.bias", &RankGrads::kln_b},
    {"pre_mlp_layernorm.weight", &RankGrads::ln2_w},
    {"pre_mlp_layernorm.bias", &RankGrads::ln2_b},
    {"mlp.linear_fc1.weight", &RankGrads::fc1_w},
    {"mlp.linear_fc1.bias", &RankGrads::fc1_b},
    {"mlp.linear_fc2.weight", &RankGrads::fc2_w},
    {"mlp.linear_fc2.bias", &RankGrads::fc2_b},
};

// ---- magnitudes: the sums of absolute terms each parameter grad accumulates ---------------------
// A [rows, cols] device tensor of dt, on the host.
Tensor download(rt::Device& dev, const void* ptr, DType dt, std::int64_t rows, std::int64_t cols, cudaStream_t st) {
  Tensor t = Tensor::empty(dt, {rows, cols});
  dev.copy(t.raw_mut(), ptr, t.nbytes(), rt::CopyKind::DeviceToHost, st);
  dev.synchronize(st);
  return t;
}
// The same as |values| in double.
std::vector<double> abs_values(rt::Device& dev, const void* ptr, DType dt, std::int64_t rows, std::int64_t cols,
                               cudaStream_t st) {
  const Tensor t = download(dev, ptr, dt, rows, cols, st);
  std::vector<double> v(static_cast<std::size_t>(t.numel()));
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = std::fabs(t.at_f64(static_cast<std::int64_t>(i)));
  return v;
}

// A weight's: max over (o, i) of sum_rows |dy[r, o]| |x[r, i]|.
double weight_magnitude(const std::vector<double>& dy, const std::vector<double>& x, std::int64_t rows,
                        std::int64_t out, std::int64_t in) {
  double m = 0.0;
  std::vector<double> acc(static_cast<std::size_t>(in));
  for (std::int64_t o = 0; o < out; ++o) {
    std::fill(acc.begin(), acc.end(), 0.0);
    for (std::int64_t r = 0; r < rows; ++r) {
      const double a = dy[r * out + o];
      if (a == 0.0) continue;
      const double* xr = x.data() + r * in;
      for (std::int64_t i = 0; i < in; ++i) acc[i] += a * xr[i];
    }
    m = std::max(m, *std::max_element(acc.begin(), acc.end()));
  }
  return m;
}

// A bias's (and a LayerNorm bias's): max over columns of sum_rows |dy[r, c]|.
double column_magnitude(const std::vector<double>& dy, std::int64_t rows, std::int64_t cols) {
  std::vector<double> acc(static_cast<std::size_t>(cols), 0.0);
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) acc[c] += dy[r * cols + c];
  return cols ? *std::max_element(acc.begin(), acc.end()) : 0.0;
}

// A norm weight's: max over columns of sum_rows |dy[r, c] x_hat[r, c]|, x_hat the normalised input
// (LayerNorm: (x - mean) rstd; RMSNorm: x rstd), in double.
double norm_weight_magnitude(const std::vector<double>& dy, const Tensor& x, std::int64_t rows, std::int64_t cols,
                             bool rms, double eps) {
  std::vector<double> acc(static_cast<std::size_t>(cols), 0.0);
  for (std::int64_t r = 0; r < rows; ++r) {
    double mean = 0.0, sq = 0.0;
    for (std::int64_t c = 0; c < cols; ++c) mean += x.at_f64(r * cols + c);
    mean = rms ? 0.0 : mean / cols;
    for (std::int64_t c = 0; c < cols; ++c) sq += std::pow(x.at_f64(r * cols + c) - mean, 2);
    const double rstd = 1.0 / std::sqrt(sq / cols + eps);
    for (std::int64_t c = 0; c < cols; ++c)
      acc[c] += dy[r * cols + c] * std::fabs((x.at_f64(r * cols + c) - mean) * rstd);
  }
  return cols ? *std::max_element(acc.begin(), acc.end()) : 0.0;
}

// The q rows or the k rows ([rows, hn], heads in layout order) of a [n, qw] tensor in the fused
// linear_qkv layout: token t, group g holds hpg q heads then k then v, each hn wide.
std::vector<double> gather_heads(const std::vector<double>& full, std::int64_t n, const RankPlan& p, bool keys) {
  const int hpg = p.hpg(), ng = p.ng_local();
  const std::int64_t qw = p.qkv_width(), gs = std::int64_t(hpg + 2) * p.hn;
  std::vector<double> out;
  out.reserve(static_cast<std::size_t>(n * ng * (keys ? 1 : hpg) * p.hn));
  for (std::int64_t t = 0; t < n; ++t)
    for (int g = 0; g < ng; ++g)
      for (int j = keys ? hpg : 0; j < (keys ? hpg + 1 : hpg); ++j) {
        const double* head = full.data() + t * qw + g * gs + std::int64_t(j) * p.hn;
        out.insert(out.end(), head, head + p.hn);
      }
  return out;
}

}  // namespace

// ---- what it supports ----------------------------------------------------------------------------
std::optional<std::string> DenseTransformerLayer::backward_unsupported() const {
  const RankPlan& p = impl_->ranks.at(0).plan;
  const std::string why = sim::attention_half_backward_unsupported(p.post_ln_residual, p.tp, p.sp);
  if (!why.empty()) return why;
  return std::nullopt;
}

// ---- its buffers: the gradients and the scratch for the current (s, b) ------------------------------
void DenseTransformerLayer::Impl::ensure_grad_buffers(const RankPlan& p, rt::Backend backend) {
  Impl& m = *this;
  if (m.grads_s == p.s && m.grads_b == p.b) return;
  m.grads_s = m.grads_b = -1;
  m.backward_graph.reset();  // it wrote into the buffers released here
  m.grad_bufs.clear();
  m.grad_bufs.reserve(32);
  const std::size_t es = dtype_size(m.dt), n = std::size_t(p.s) * p.b;
  auto buf = [&](std::size_t bytes) {
    m.grad_bufs.emplace_back(*m.dev, std::max<std::size_t>(bytes, 1));
    return m.grad_bufs.back().get();
  };
  RankGrads g;
  g.dout = buf(n * m.h * es);
  g.dx = buf(n * m.h * es);
  for (const GradSlot& s : kGradSlots)
    g.*s.slot = m.full.count(s.key) ? buf(std::size_t(m.full.at(s.key).numel()) * es) : nullptr;
  g.dh1 = buf(n * m.h * es);
  g.d_mlp = buf(n * m.h * es);
  g.d_act = buf(n * m.ffn * es);
  g.d_fc1 = buf(n * (p.glu ? 2 : 1) * m.ffn * es);
  g.d_ln2 = buf(n * m.h * es);
  g.d_proj = buf(n * m.h * es);
  g.d_ctx = buf(n * std::size_t(m.np) * m.hn * es);
  g.d_qkv = buf(n * std::size_t(p.qkv_width()) * es);
  g.d_qkv_pre = p.qk_layernorm ? buf(n * std::size_t(p.qkv_width()) * es) : nullptr;
  g.d_ln1 = buf(n * m.h * es);
#if TWIN_HAVE_CUDA
  g.workspace_bytes =
      backend == rt::Backend::Cuda ? cuda::rank_backward_workspace_bytes(p) : sim::rank_backward_workspace_bytes(p);
#else
  (void)backend;
  g.workspace_bytes = sim::rank_backward_workspace_bytes(p);
#endif
  g.workspace = buf(g.workspace_bytes);
  m.grads = g;
  m.grads_s = p.s;
  m.grads_b = p.b;
}

// ---- running it ----------------------------------------------------------------------------------
LayerGradients DenseTransformerLayer::backward(const Tensor& grad_output, bool with_magnitudes, bool use_graph) {
  if (const auto why = backward_unsupported()) throw std::logic_error("optimized dense layer: no backward for " + *why);
  Impl& m = *impl_;
  if (!m.kept)
    throw std::logic_error("optimized dense layer: backward() needs the last forward run with keep_for_backward");
  Impl::Rank& R = m.ranks.at(0);
  const RankPlan& p = R.plan;
  const std::int64_t n = std::int64_t(p.s) * p.b;
  grad_output.expect({p.s, p.b, m.h}, m.dt, "optimized dense layer: grad_output");
  m.ensure_grad_buffers(p, options_.backend);
  const RankGrads& g = m.grads;
  const cudaStream_t st = R.stream->handle();
  m.dev->copy(const_cast<void*>(g.dout), grad_output.raw(), grad_output.nbytes(), rt::CopyKind::HostToDevice, st);
  auto run = [&] {
#if TWIN_HAVE_CUDA
    if (options_.backend == rt::Backend::Cuda) return cuda::rank_backward(p, g, st);
#endif
    sim::rank_backward(p, g, st);
  };
  if (use_graph) {
    if (!m.backward_graph) {
      R.stream->begin_capture();
      run();
      m.backward_graph.emplace(R.stream->end_capture());
    }
    m.backward_graph->launch(*R.stream);
  } else {
    run();
  }
  R.stream->synchronize();

  LayerGradients out;
  out.hidden_states = Tensor::empty(m.dt, {p.s, p.b, m.h});
  m.dev->copy(out.hidden_states.raw_mut(), g.dx, out.hidden_states.nbytes(), rt::CopyKind::DeviceToHost, st);
  R.stream->synchronize();

  // The magnitudes (when asked): each op's output gradient and input as the run left them.
  rt::Device& dev = *m.dev;
  const std::int64_t h = m.h, w = (p.glu ? 2 : 1) * std::int64_t(m.ffn), cw = std::int64_t(m.np) * m.hn,
                     qw = p.qkv_width();
  auto abs_of = [&](const void* ptr, std::int64_t cols) { return abs_values(dev, ptr, m.dt, n, cols, st); };
  auto abs_if = [&](const void* ptr, std::int64_t cols) {
    return with_magnitudes ? abs_of(ptr, cols) : std::vector<double>();
  };
  // d_qkv: core attention's q, k, v gradient (the qk-norms' dy); d_lin: linear_qkv's output gradient.
  const auto d_ln1 = abs_if(g.d_ln1, h), d_qkv = abs_if(g.d_qkv, qw),
             d_lin = p.qk_layernorm ? abs_if(g.d_qkv_pre, qw) : d_qkv, d_proj = abs_if(g.d_proj, h),
             d_ln2 = abs_if(g.d_ln2, h), d_fc1 = abs_if(g.d_fc1, w), d_mlp = abs_if(g.d_mlp, h);
  auto norm_magnitude = [&](const std::vector<double>& dy, const void* x) {
    return norm_weight_magnitude(dy, download(dev, x, m.dt, n, h, st), n, h, p.rms, p.eps);
  };
  // q_layernorm / k_layernorm: one norm of width hn over every q (k) head's rows.
  auto qk_norm_magnitude = [&](bool keys, bool bias) {
    const std::vector<double> dy = gather_heads(d_qkv, n, p, keys);
    const std::int64_t rows = std::int64_t(dy.size()) / p.hn;
    if (bias) return column_magnitude(dy, rows, p.hn);
    const Tensor pre = download(dev, p.qkv_pre_norm, m.dt, n, qw, st);
    const std::vector<double> x = gather_heads(pre.to_f64(), n, p, keys);
    return norm_weight_magnitude(dy, Tensor::from_doubles(DType::F64, {rows, p.hn}, x), rows, p.hn, p.rms, p.eps);
  };
  auto magnitude = [&](const std::string& key) -> double {
    if (key == "input_layernorm.weight") return norm_magnitude(d_ln1, p.x);
    if (key == "input_layernorm.bias") return column_magnitude(d_ln1, n, h);
    if (key == "self_attention.linear_qkv.weight") return weight_magnitude(d_lin, abs_of(p.ln1, h), n, qw, h);
    if (key == "self_attention.linear_qkv.bias") return column_magnitude(d_lin, n, qw);
    if (key == "self_attention.linear_proj.weight") return weight_magnitude(d_proj, abs_of(p.ctx, cw), n, h, cw);
    if (key == "self_attention.linear_proj.bias") return column_magnitude(d_proj, n, h);
    if (key == "self_attention.q_layernorm.weight") return qk_norm_magnitude(false, false);
    if (key == "self_attention.q_layernorm.bias") return qk_norm_magnitude(false, true);
    if (key == "self_attention.k_layernorm.weight") return qk_norm_magnitude(true, false);
    if (key == "self_attention.k_layernorm.bias") return qk_norm_magnitude(true, true);
    if (key == "pre_mlp_layernorm.weight") return norm_magnitude(d_ln2, p.h1);
    if (key == "pre_mlp_layernorm.bias") return column_magnitude(d_ln2, n, h);
    if (key == "mlp.linear_fc1.weight") return weight_magnitude(d_fc1, abs_of(p.ln2, h), n, w, h);
    if (key == "mlp.linear_fc1.bias") return column_magnitude(d_fc1, n, w);
    if (key == "mlp.linear_fc2.weight") return weight_magnitude(d_mlp, abs_of(p.act_out, m.ffn), n, h, m.ffn);
    if (key == "mlp.linear_fc2.bias") return column_magnitude(d_mlp, n, h);
    throw std::logic_error("optimized dense layer: no magnitude rule for the gradient of '" + key + "'");
  };
  for (const std::string& key : dense_layer_param_keys(config_)) {
    const GradSlot* s = nullptr;
    for (const GradSlot& c : kGradSlots)
      if (key == c.key) s = &c;
    if (!s || !(g.*s->slot))
      throw std::logic_error("optimized dense layer: the backward computes no gradient of '" + key + "'");
    ParamGradient pg;
    pg.name = key;
    pg.value = Tensor::empty(m.dt, m.full.at(key).shape());
    dev.copy(pg.value.raw_mut(), g.*s->slot, pg.value.nbytes(), rt::CopyKind::DeviceToHost, st);
    out.params.push_back(std::move(pg));
  }
  R.stream->synchronize();  // one wait for every parameter's copy
  if (with_magnitudes)
    for (ParamGradient& pg : out.params) pg.magnitude = magnitude(pg.name);
  return out;
}

// ---- timing it -----------------------------------------------------------------------------------
double DenseTransformerLayer::time_backward_ms(int iters) {
  return impl_->time_graph_ms(impl_->backward_graph, iters,
                              "time_backward_ms: call backward() with use_graph first (tp = 1)");
}

}  // namespace twin::opt
