// Host side of the optimized dense layer: its parameter keys, its plan binding (each rank's
// shards in the RankPlan, layer/sharding.h) and its forward's steps: inputs checked, buffers,
// streams, the ranks run (layer/rank_runner.h), taps gathered across the ranks into the
// reference's full tensors. The kernel sequence is transformer_layer.cuh; what is shared with the
// other layer kinds is in layer/.
#include "optimized/transformer_layer.h"

#include <cstring>
#include <stdexcept>

#include "optimized/layer/attention_half.h"
#include "optimized/layer/kernels.h"
#include "optimized/layer/rank_exchange.h"
#include "optimized/layer/rank_runner.h"
#include "optimized/layer/sharding.h"
#include "optimized/runtime/collectives.h"
#include "optimized/transformer_layer_impl.h"

namespace twin::opt {

namespace {

constexpr char kWho[] = "optimized dense layer";

void reject(bool bad, const std::string& what) {
  if (bad) throw ConfigError(std::string(kWho) + ": " + what);
}

// The MLP's weight slots in the plan (the attention half's are kAttentionHalfWeights).
constexpr PlanWeight kMlpWeights[] = {
    {"mlp.linear_fc1.weight", &RankPlan::fc1_w},
    {"mlp.linear_fc1.bias", &RankPlan::fc1_b},
    {"mlp.linear_fc2.weight", &RankPlan::fc2_w},
    {"mlp.linear_fc2.bias", &RankPlan::fc2_b},
};

}  // namespace

std::vector<std::string> dense_layer_param_keys(const TransformerConfig& c) {
  std::vector<std::string> k = attention_half_param_keys(c);
  k.push_back("mlp.linear_fc1.weight");
  if (c.add_bias_linear) k.push_back("mlp.linear_fc1.bias");
  k.push_back("mlp.linear_fc2.weight");
  if (c.add_bias_linear) k.push_back("mlp.linear_fc2.bias");
  return k;
}

DenseTransformerLayer::~DenseTransformerLayer() = default;

DenseTransformerLayer::DenseTransformerLayer(const TransformerConfig& c, const std::map<std::string, Tensor>& params,
                                             LayerOptions o)
    : config_(c), options_(o), impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.dt = params_dtype(c);
  m.h = c.hidden_size;
  m.np = c.num_attention_heads;
  m.ng = c.query_groups();
  m.hn = c.head_dim();
  m.ffn = c.ffn();
  const int tp = o.tp;
  // ---- what this twin implements (everything else is rejected, never silently ignored)
  if (const std::string why = layer_unsupported(LayerKind::Dense, c, o); !why.empty())
    reject(true, "unsupported: " + why);
  check_tensor_parallel_sizes(kWho, c, tp, "tp");
  reject(o.sp && tp == 1, "sequence parallelism needs tp > 1");
  reject(o.attn_mask_type != "causal" && o.attn_mask_type != "no_mask" && o.attn_mask_type != "padding" &&
             o.attn_mask_type != "arbitrary" && o.attn_mask_type != "padding_causal",
         "attn_mask_type '" + o.attn_mask_type + "' (causal, no_mask, padding, padding_causal, arbitrary)");
  act_from_name(c.activation_func);  // invalid_argument for an activation without a kernel
  m.dev = &rt::device(o.backend);

  // ---- params: every key present, right shape and dtype
  const std::int64_t fc1_rows = (c.gated_linear_unit ? 2 : 1) * std::int64_t(m.ffn);
  std::map<std::string, Shape> shapes = attention_half_param_shapes(c);
  shapes.insert({{"mlp.linear_fc1.weight", {fc1_rows, m.h}},
                 {"mlp.linear_fc1.bias", {fc1_rows}},
                 {"mlp.linear_fc2.weight", {m.h, m.ffn}},
                 {"mlp.linear_fc2.bias", {m.h}}});
  m.full = checked_params(kWho, params, dense_layer_param_keys(c), shapes, m.dt);

  // ---- the plan binding: each rank's shards, as Megatron's tensor-parallel layers hold them
  m.comms = make_rank_communicators(kWho, tp, o.processes, o.backend);
  m.processes = o.processes;
  m.ranks.resize(tp);
  for (int r = 0; r < tp; ++r) {
    Impl::Rank& R = m.ranks[r];
    R.stream.emplace(*m.dev);
    if (o.processes) R.stream->set_process(r);
    if (!m.here(r)) {  // its process holds its weights and buffers
      R.weights.set_elsewhere();
      R.acts.set_elsewhere();
      R.grad_bufs.set_elsewhere();
    }
    RankPlan& p = R.plan;
    plan_attention_half(p, c, o.layer_number);
    p.ffn = m.ffn;
    p.tp = tp;
    p.rank = r;
    p.sp = o.sp;
    auto bind = [&](const PlanWeight& w) {
      if (m.full.count(w.key)) p.*w.slot = m.upload(R, tensor_parallel_shard(c, w.key, m.full.at(w.key), r, tp));
    };
    for (const PlanWeight& w : kAttentionHalfWeights) bind(w);
    for (const PlanWeight& w : kMlpWeights) bind(w);
  }
}

// ---- the forward's steps -------------------------------------------------------------------------
// (Re)allocates every rank's activations when the input's shape changes; graphs are recorded
// against these buffers.
void DenseTransformerLayer::Impl::ensure_activations(const AttentionInputs& in, std::size_t mask_bytes) {
  const BufferShape shape{in.s, in.b, in.rot, mask_bytes, false};
  if (shape == buffer_shape) return;
  buffer_shape = shape;
  inputs.clear();
  const int tp = static_cast<int>(ranks.size());
  for (Rank& R : ranks) {
    R.graph.reset();
    R.acts.clear();
    RankPlan& p = R.plan;
    p.s = in.s;
    p.b = in.b;
    const std::int64_t tok = std::int64_t(p.s) * p.b, tok_l = std::int64_t(p.s_local()) * p.b;
    add_attention_half_buffers(R.acts, *dev, p);
    p.fc1 = R.acts.add(*dev, "fc1", dt, tok, p.glu ? 2 : 1, p.ffn_local());
    p.act_out = R.acts.add(*dev, "act_out", dt, tok, p.ffn_local());
    p.fc2_partial = tp > 1 ? R.acts.add(*dev, "fc2_partial", dt, tok, h) : nullptr;
    p.fc2 = R.acts.add(*dev, "fc2", dt, tok_l, h);
    inputs.push_back(here(int(&R - ranks.data())) ? rt::DeviceBuffer(*dev, std::size_t(tok_l) * h * dtype_size(dt))
                                                  : rt::DeviceBuffer());
    p.x = inputs.back().get();
    p.comm = tp > 1 ? comms[&R - ranks.data()].get() : nullptr;
  }
  freqs = in.rot ? rt::DeviceBuffer(*dev, std::size_t(in.s) * in.rot * sizeof(float)) : rt::DeviceBuffer();
  mask = mask_bytes ? rt::DeviceBuffer(*dev, mask_bytes) : rt::DeviceBuffer();
}

// Rank r's plan for this forward: its slice of hidden_states, the dropout streams and mask, RoPE,
// and what the backward reads kept when asked (graphs bake these in: a change re-records).
void DenseTransformerLayer::Impl::set_rank_inputs(int r, const Tensor& hidden_states, const ForwardOptions& fo,
                                                  MaskMode mask_mode, const AttentionInputs& in, bool has_mask,
                                                  bool rotary_interleaved) {
  Rank& R = ranks[r];
  RankPlan& p = R.plan;
  const std::size_t es = dtype_size(dt), slice = std::size_t(p.s_local()) * p.b * h * es;
  // What only the backward reads, kept when asked: `buf` sized to `bytes`, or null.
  auto kept_buffer = [&](rt::DeviceBuffer& buf, std::size_t bytes, bool keep) -> void* {
    if (!keep || !here(r)) return nullptr;
    if (buf.bytes() != bytes) buf = rt::DeviceBuffer(*dev, bytes);
    return buf.get();
  };
  // The softmax statistics [b, np_local, s, 2] fp32 (also read by the core_attention tap's
  // magnitude); qk-layernorm works in place on linear_qkv's output, so its backward reads a copy
  // from before [s, b, qkv_width].
  float* const stats =
      static_cast<float*>(kept_buffer(R.softmax_stats, sizeof(float) * 2 * std::size_t(p.b) * p.np_local() * p.s,
                                      fo.keep_for_backward || fo.record_taps));
  void* const pre_norm = kept_buffer(R.qkv_pre_norm, std::size_t(p.s) * p.b * std::size_t(p.qkv_width()) * es,
                                     fo.keep_for_backward && p.qk_layernorm && !p.mla.on);
  const bool changed = set_forward_streams(p, fo, mask_mode, in.mask_b, in.mask_h) || p.softmax_stats != stats ||
                       p.qkv_pre_norm != pre_norm;
  if (changed) R.graph.reset();
  p.softmax_stats = stats;
  p.qkv_pre_norm = pre_norm;
  p.mask = has_mask ? static_cast<const std::uint8_t*>(mask.get()) : nullptr;
  p.rot_dim = in.rot;
  p.rope_interleaved = rotary_interleaved;
  p.freqs = in.rot ? static_cast<const float*>(freqs.get()) : nullptr;
  if (here(r)) inputs[r].upload(hidden_states.raw() + (p.sp ? std::size_t(r) * slice : 0), slice);
  p.on_tap = nullptr;
}

// ---- taps: the attention half's as every kind records them (layer/attention_half.h); the MLP's
//   linear_fc1.0 [s, b, f_l] or with GLU [s, b, 2 * f_l] = [this rank's gate columns | its
//     linear columns]: the full tensor is [all gate columns | all linear columns];
//   linear_fc2 as a row-parallel linear.
void DenseTransformerLayer::Impl::record_tap(int r, TapPoint t, std::vector<RankTap>& taps) {
  Rank& R = ranks[r];
  const RankPlan& p = R.plan;
  RankTapRecorder rec{
      p, full,
      [&](const void* ptr, DType type, Shape shape) { return download_tensor(*dev, *R.stream, ptr, type, shape); },
      taps};
  if (rec.attention_half(t)) return;
  auto download = [&](const void* ptr, Shape shape) { return rec.get(ptr, std::move(shape)); };
  if (t == TapPoint::LinearFc1) {
    rec.add("mlp.linear_fc1.0", download(p.fc1, {p.s, p.b, (p.glu ? 2 : 1) * std::int64_t(p.ffn_local())}),
            ShardLayout{2, p.glu ? 2 : 1});
    rec.bias("mlp.linear_fc1.1", "mlp.linear_fc1.bias");
  } else if (t == TapPoint::LinearFc2) {
    rec.row_parallel(p.fc2, "mlp", "linear_fc2");
  }
}

// The output: rank 0's full tensor, or (SP) the ranks' sequence slices in rank order.
Tensor DenseTransformerLayer::Impl::download_output(bool sp) {
  const RankPlan& p0 = ranks.at(0).plan;
  const std::size_t slice = std::size_t(p0.s_local()) * p0.b * h * dtype_size(dt);
  Tensor out = Tensor::empty(dt, {p0.s, p0.b, h});
  for (std::size_t r = 0; r < (sp ? ranks.size() : 1); ++r) {
    const Tensor part = download_tensor(*dev, *ranks[r].stream, ranks[r].plan.out, dt, {p0.s_local(), p0.b, h});
    std::memcpy(out.raw_mut() + r * slice, part.raw(), slice);
  }
  return out;
}

LayerOutput DenseTransformerLayer::forward(const Tensor& hidden_states, const Tensor* attention_mask,
                                           const Tensor* rotary_pos_emb, const ForwardOptions& fo) {
  Impl& m = *impl_;
  const int tp = options_.tp;
  const bool sp = options_.sp;
  const AttentionInputsWithAngles in =
      check_attention_inputs(kWho, config_, hidden_states, attention_mask, rotary_pos_emb);
  if (sp && in.s % tp != 0)
    throw ShapeError(std::string(kWho) + ": sequence length " + std::to_string(in.s) + " not divisible by tp " +
                     std::to_string(tp) + " with sequence parallelism");
  if (fo.use_graph && fo.record_taps) throw std::invalid_argument(std::string(kWho) + ": graph replay records no taps");
  check_graph_ranks(std::string(kWho) + ":", fo.use_graph, tp, options_.backend);

  m.ensure_activations(in, attention_mask ? attention_mask->nbytes() : 0);
  if (attention_mask) m.mask.upload(attention_mask->raw(), attention_mask->nbytes());  // BOOL: one byte per element
  if (in.rot) m.freqs.upload(in.angles.raw(), in.angles.nbytes());                     // [s, 1, 1, rot] == [s, rot]
  m.kept = false;                                    // set again once this forward has run
  for (auto& R : m.ranks) R.backward_graph.reset();  // captured against the buffers and plan of the forward before
  const MaskMode mask_mode = self_attention_mask_mode(attention_mask != nullptr, options_.attn_mask_type, in.s);
  for (int r = 0; r < tp; ++r)
    m.set_rank_inputs(r, hidden_states, fo, mask_mode, in, attention_mask != nullptr, config_.rotary_interleaved);

  std::vector<std::vector<RankTap>> rank_taps(tp);
  if (fo.record_taps)
    for (int r = 0; r < tp; ++r)
      m.ranks[r].plan.on_tap = [&m, &rank_taps, r](TapPoint t) { m.record_tap(r, t, rank_taps[r]); };
  const LayerKernels& kernels = layer_kernels(options_.backend);
  run_ranks_counted(
      tp,
      [&](int r) {
        Impl::Rank& R = m.ranks[r];
        R.graph.run(*R.stream, fo.use_graph, [&] { kernels.rank_forward(R.plan, R.stream->handle()); });
        R.stream->synchronize();
      },
      options_.processes);
  share_ranks(rank_taps, options_.processes);

  LayerOutput result;
  result.hidden_states = m.download_output(sp);
  for (auto& R : m.ranks) R.plan.on_tap = nullptr;
  result.record = gather_rank_taps(rank_taps, kWho);
  m.kept = fo.keep_for_backward;
  return result;
}

double DenseTransformerLayer::time_forward_ms(int iters) {
  Impl::Rank& R = impl_->ranks.at(0);
  return R.graph.time_ms(*impl_->dev, *R.stream, iters,
                         "time_forward_ms: call forward() with use_graph first (tp = 1)");
}

}  // namespace twin::opt
