// Host side of the optimized dense layer: validation, sharding of the full Megatron state dict,
// device buffers per rank, simulated ranks, taps (at tp > 1 gathered across the ranks into the
// reference's full tensors). The kernel sequence is transformer_layer.cuh.
#include "optimized/transformer_layer.h"

#include <cmath>
#include <cstring>
#include <mutex>
#include <optional>
#include <stdexcept>

#include "optimized/activations.cuh"            // Act (the same enum values in both backends)
#include "optimized/dot_product_attention.cuh"  // MaskMode
#include "optimized/runtime/collectives.h"
#include "optimized/transformer_layer_impl.h"

namespace twin::opt {

static_assert(sim::kAttnMaxHeadDim == kMaxHeadDim, "the feature table's head-dim limit is the attention kernel's");

namespace {

void reject(bool bad, const std::string& what) {
  if (bad) throw ConfigError("optimized dense layer: " + what);
}

bool qkv_has_bias(const TransformerConfig& c) { return c.add_bias_linear || c.add_qkv_bias; }

// Row r of a [rows, cols] tensor, rows picked by `pick`, into a new [pick.size(), cols] tensor.
Tensor take_rows(const Tensor& t, const std::vector<std::int64_t>& pick) {
  const std::int64_t cols = t.dim() == 1 ? 1 : t.size(1);
  const std::size_t row_bytes = static_cast<std::size_t>(cols) * dtype_size(t.dtype());
  Shape shape = t.shape();
  shape[0] = static_cast<std::int64_t>(pick.size());
  Tensor out = Tensor::empty(t.dtype(), shape);
  for (std::size_t i = 0; i < pick.size(); ++i)
    std::memcpy(out.raw_mut() + i * row_bytes, t.raw() + static_cast<std::size_t>(pick[i]) * row_bytes, row_bytes);
  return out;
}
std::vector<std::int64_t> range(std::int64_t a, std::int64_t b) {
  std::vector<std::int64_t> r;
  for (std::int64_t i = a; i < b; ++i) r.push_back(i);
  return r;
}
// Columns [c0, c1) of a [rows, cols] tensor.
Tensor take_cols(const Tensor& t, std::int64_t c0, std::int64_t c1) {
  const std::int64_t rows = t.size(0), cols = t.size(1);
  const std::size_t es = dtype_size(t.dtype());
  Tensor out = Tensor::empty(t.dtype(), {rows, c1 - c0});
  for (std::int64_t r = 0; r < rows; ++r)
    std::memcpy(out.raw_mut() + static_cast<std::size_t>(r * (c1 - c0)) * es,
                t.raw() + static_cast<std::size_t>(r * cols + c0) * es, static_cast<std::size_t>(c1 - c0) * es);
  return out;
}

}  // namespace

std::map<std::string, Shape> attention_half_param_shapes(std::int64_t h, std::int64_t np, std::int64_t ng,
                                                         std::int64_t hn) {
  const std::int64_t qkv_rows = (np + 2 * ng) * hn;
  return {{"input_layernorm.weight", {h}},
          {"input_layernorm.bias", {h}},
          {"self_attention.linear_qkv.weight", {qkv_rows, h}},
          {"self_attention.linear_qkv.bias", {qkv_rows}},
          {"self_attention.q_layernorm.weight", {hn}},
          {"self_attention.q_layernorm.bias", {hn}},
          {"self_attention.k_layernorm.weight", {hn}},
          {"self_attention.k_layernorm.bias", {hn}},
          {"self_attention.linear_proj.weight", {h, np * hn}},
          {"self_attention.linear_proj.bias", {h}},
          {"pre_mlp_layernorm.weight", {h}},
          {"pre_mlp_layernorm.bias", {h}}};
}

std::vector<std::string> dense_layer_param_keys(const TransformerConfig& c) {
  const bool ln = c.normalization == "LayerNorm";
  std::vector<std::string> k = {"input_layernorm.weight"};
  if (ln) k.push_back("input_layernorm.bias");
  k.push_back("self_attention.linear_qkv.weight");
  if (qkv_has_bias(c)) k.push_back("self_attention.linear_qkv.bias");
  if (c.qk_layernorm) {
    k.push_back("self_attention.q_layernorm.weight");
    if (ln) k.push_back("self_attention.q_layernorm.bias");
    k.push_back("self_attention.k_layernorm.weight");
    if (ln) k.push_back("self_attention.k_layernorm.bias");
  }
  k.push_back("self_attention.linear_proj.weight");
  if (c.add_bias_linear) k.push_back("self_attention.linear_proj.bias");
  k.push_back("pre_mlp_layernorm.weight");
  if (ln) k.push_back("pre_mlp_layernorm.bias");
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
  reject(m.h <= 0 || m.np <= 0 || m.ng <= 0 || m.hn <= 0 || m.ffn <= 0,
         "hidden_size, heads, query groups, kv_channels and ffn must be > 0");
  reject(m.np % m.ng != 0,
         "num_attention_heads " + std::to_string(m.np) + " not divisible by num_query_groups " + std::to_string(m.ng));
  reject(tp < 1, "tp must be >= 1");
  reject(m.np % tp != 0 || m.ng % tp != 0, "tp " + std::to_string(tp) + " must divide num_attention_heads " +
                                               std::to_string(m.np) + " and num_query_groups " + std::to_string(m.ng));
  reject(m.ffn % tp != 0, "tp " + std::to_string(tp) + " must divide ffn_hidden_size " + std::to_string(m.ffn));
  reject(o.sp && tp == 1, "sequence parallelism needs tp > 1");
  reject(o.attn_mask_type != "causal" && o.attn_mask_type != "no_mask" && o.attn_mask_type != "padding" &&
             o.attn_mask_type != "arbitrary" && o.attn_mask_type != "padding_causal",
         "attn_mask_type '" + o.attn_mask_type + "' (causal, no_mask, padding, padding_causal, arbitrary)");
  const int act = static_cast<int>(sim::act_from_name(c.activation_func));
  m.dev = &rt::device(o.backend);

  // ---- params: every key present, right shape and dtype
  const bool ln = c.normalization == "LayerNorm";
  const std::int64_t fc1_rows = (c.gated_linear_unit ? 2 : 1) * std::int64_t(m.ffn);
  std::map<std::string, Shape> shapes = attention_half_param_shapes(m.h, m.np, m.ng, m.hn);
  shapes.insert({{"mlp.linear_fc1.weight", {fc1_rows, m.h}},
                 {"mlp.linear_fc1.bias", {fc1_rows}},
                 {"mlp.linear_fc2.weight", {m.h, m.ffn}},
                 {"mlp.linear_fc2.bias", {m.h}}});
  for (const auto& key : dense_layer_param_keys(c)) {
    auto it = params.find(key);
    if (it == params.end()) throw ShapeError("optimized dense layer: missing parameter '" + key + "'");
    it->second.expect(shapes.at(key), m.dt, "optimized dense layer: parameter '" + key + "'");
    m.full[key] = it->second;
  }

  // ---- shard per rank, as Megatron's tensor-parallel layers hold them
  const int ng_l = m.ng / tp, np_l = m.np / tp, f_l = m.ffn / tp;
  const std::int64_t group_rows = std::int64_t(m.np / m.ng + 2) * m.hn;
  m.ranks.resize(tp);
  for (int r = 0; r < tp; ++r) {
    Impl::Rank& R = m.ranks[r];
    R.weights.reserve(32);
    R.stream.emplace(*m.dev);
    RankPlan& p = R.plan;
    p.h = m.h;
    p.np = m.np;
    p.ng = m.ng;
    p.hn = m.hn;
    p.ffn = m.ffn;
    p.tp = tp;
    p.rank = r;
    p.sp = o.sp;
    p.dt = m.dt;
    p.rms = !ln;
    p.eps = c.layernorm_epsilon;
    p.zero_centered_gamma = c.layernorm_zero_centered_gamma;
    p.qk_layernorm = c.qk_layernorm;
    p.glu = c.gated_linear_unit;
    p.act = act;
    // Megatron-Core's TransformerLayer reads neither apply_residual_connection_post_layernorm nor
    // fp32_residual_connection at this commit (reference/transformer_layer.h): the residual is
    // always the layer input, in the params dtype.
    p.post_ln_residual = false;
    double scale = c.softmax_scale ? *c.softmax_scale : 1.0 / std::sqrt(static_cast<double>(m.hn));
    if (c.apply_query_key_layer_scaling) {
      p.coeff = static_cast<float>(std::max(1, o.layer_number));
      scale /= std::max(1, o.layer_number);
    }
    p.alpha = static_cast<float>(scale);
    // TransformerConfig.__post_init__: apply_query_key_layer_scaling sets attention_softmax_in_fp32.
    p.softmax_fp32 = !(c.fp16 || c.bf16) || c.attention_softmax_in_fp32 || c.apply_query_key_layer_scaling;
    p.hidden_dropout = c.hidden_dropout;
    p.attention_dropout = c.attention_dropout;

    auto opt_up = [&](const std::string& key, const Tensor& t) -> const void* {
      return m.full.count(key) ? m.upload(R, t) : nullptr;
    };
    auto full_or_null = [&](const std::string& key) -> const void* {
      return m.full.count(key) ? m.upload(R, m.full.at(key)) : nullptr;
    };
    p.ln1_w = full_or_null("input_layernorm.weight");
    p.ln1_b = full_or_null("input_layernorm.bias");
    // linear_qkv: the rows of query groups [r * ng_l, (r + 1) * ng_l), contiguous in the grouped layout
    const auto qkv_pick = range(r * ng_l * group_rows, (r + 1) * ng_l * group_rows);
    p.qkv_w = m.upload(R, take_rows(m.full.at("self_attention.linear_qkv.weight"), qkv_pick));
    if (m.full.count("self_attention.linear_qkv.bias"))
      p.qkv_b =
          opt_up("self_attention.linear_qkv.bias", take_rows(m.full.at("self_attention.linear_qkv.bias"), qkv_pick));
    p.qln_w = full_or_null("self_attention.q_layernorm.weight");
    p.qln_b = full_or_null("self_attention.q_layernorm.bias");
    p.kln_w = full_or_null("self_attention.k_layernorm.weight");
    p.kln_b = full_or_null("self_attention.k_layernorm.bias");
    // linear_proj: row parallel, the input columns of this rank's heads
    p.proj_w = m.upload(R, take_cols(m.full.at("self_attention.linear_proj.weight"), std::int64_t(r) * np_l * m.hn,
                                     std::int64_t(r + 1) * np_l * m.hn));
    p.proj_b = full_or_null("self_attention.linear_proj.bias");
    p.ln2_w = full_or_null("pre_mlp_layernorm.weight");
    p.ln2_b = full_or_null("pre_mlp_layernorm.bias");
    // linear_fc1: column parallel; with GLU this rank's columns of BOTH halves, [glu part | linear part]
    std::vector<std::int64_t> fc1_pick = range(std::int64_t(r) * f_l, std::int64_t(r + 1) * f_l);
    if (c.gated_linear_unit) {
      const auto second = range(m.ffn + std::int64_t(r) * f_l, m.ffn + std::int64_t(r + 1) * f_l);
      fc1_pick.insert(fc1_pick.end(), second.begin(), second.end());
    }
    p.fc1_w = m.upload(R, take_rows(m.full.at("mlp.linear_fc1.weight"), fc1_pick));
    if (m.full.count("mlp.linear_fc1.bias"))
      p.fc1_b = m.upload(R, take_rows(m.full.at("mlp.linear_fc1.bias"), fc1_pick));
    // linear_fc2: row parallel
    p.fc2_w =
        m.upload(R, take_cols(m.full.at("mlp.linear_fc2.weight"), std::int64_t(r) * f_l, std::int64_t(r + 1) * f_l));
    p.fc2_b = full_or_null("mlp.linear_fc2.bias");
  }
  if (tp > 1) m.comms = rt::make_threaded_group(tp);
}

LayerOutput DenseTransformerLayer::forward(const Tensor& hidden_states, const Tensor* attention_mask,
                                           const Tensor* rotary_pos_emb, const ForwardOptions& fo) {
  Impl& m = *impl_;
  const int tp = options_.tp;
  const bool sp = options_.sp;
  if (hidden_states.dim() != 3 || hidden_states.size(2) != m.h)
    throw ShapeError("optimized dense layer: hidden_states expected [s, b, " + std::to_string(m.h) + "], got " +
                     shape_str(hidden_states.shape()));
  if (hidden_states.dtype() != m.dt)
    throw ShapeError(std::string("optimized dense layer: hidden_states dtype ") + dtype_name(hidden_states.dtype()) +
                     " differs from the params dtype " + dtype_name(m.dt));
  const int s = static_cast<int>(hidden_states.size(0)), b = static_cast<int>(hidden_states.size(1));
  if (s <= 0 || b <= 0)
    throw ShapeError("optimized dense layer: empty hidden_states " + shape_str(hidden_states.shape()));
  if (sp && s % tp != 0)
    throw ShapeError("optimized dense layer: sequence length " + std::to_string(s) + " not divisible by tp " +
                     std::to_string(tp) + " with sequence parallelism");
  if (fo.use_graph && (tp != 1 || fo.record_taps))
    throw std::invalid_argument("optimized dense layer: graph replay is for tp = 1 without taps");
  int mask_b = 1, mask_h = 1;
  if (attention_mask) {
    const Shape& ms = attention_mask->shape();
    const bool ok = attention_mask->dtype() == DType::BOOL && ms.size() == 4 && (ms[0] == 1 || ms[0] == b) &&
                    (ms[1] == 1 || ms[1] == m.np) && ms[2] == s && ms[3] == s;
    if (!ok)
      throw ShapeError("optimized dense layer: attention_mask expected BOOL [" + std::to_string(b) + ", 1, " +
                       std::to_string(s) + ", " + std::to_string(s) + "] (dims 0/1 may be 1/np), got " +
                       attention_mask->describe());
    mask_b = static_cast<int>(ms[0]);
    mask_h = static_cast<int>(ms[1]);
  }
  int rot = 0;
  if (rotary_pos_emb) {
    const Shape& rs = rotary_pos_emb->shape();
    if (rs.size() != 4 || rs[0] != s || rs[1] != 1 || rs[2] != 1 || rotary_pos_emb->dtype() != DType::F32)
      throw ShapeError("optimized dense layer: rotary_pos_emb expected F32 [" + std::to_string(s) +
                       ", 1, 1, rot_dim], got " + rotary_pos_emb->describe());
    rot = static_cast<int>(rs[3]);
    if (rot <= 0 || rot % 2 || rot > m.hn)
      throw ShapeError("optimized dense layer: rot_dim " + std::to_string(rot) +
                       " must be even, > 0 and <= kv_channels " + std::to_string(m.hn));
  }

  const std::size_t es = dtype_size(m.dt);
  const int s_l = sp ? s / tp : s;
  const std::size_t tok_l = std::size_t(s_l) * b, tok = std::size_t(s) * b;
  // (Re)allocate activations when the shape changes; graphs are recorded against these buffers.
  if (s != m.cur_s || b != m.cur_b || rot != m.cur_rot || (attention_mask != nullptr) != m.cur_mask) {
    m.cur_s = s;
    m.cur_b = b;
    m.cur_rot = rot;
    m.cur_mask = attention_mask != nullptr;
    m.inputs.clear();
    for (auto& R : m.ranks) {
      R.graph.reset();
      R.acts.clear();
      RankPlan& p = R.plan;
      auto buf = [&](std::size_t elems, std::size_t esize) {
        R.acts.emplace_back(*m.dev, std::max<std::size_t>(elems * esize, 1));
        return R.acts.back().get();
      };
      R.acts.reserve(20);
      p.s = s;
      p.b = b;
      p.ln1 = buf(tok_l * m.h, es);
      p.ln1_full = sp ? buf(tok * m.h, es) : p.ln1;
      p.qkv = buf(tok * p.qkv_width(), es);
      p.ctx = buf(tok * p.np_local() * m.hn, es);
      p.proj_partial = tp > 1 ? buf(tok * m.h, es) : nullptr;
      p.proj = buf(tok_l * m.h, es);
      p.h1 = buf(tok_l * m.h, es);
      p.ln2 = buf(tok_l * m.h, es);
      p.ln2_full = sp ? buf(tok * m.h, es) : p.ln2;
      p.fc1 = buf(tok * (p.glu ? 2 : 1) * p.ffn_local(), es);
      p.act_out = buf(tok * p.ffn_local(), es);
      p.fc2_partial = tp > 1 ? buf(tok * m.h, es) : nullptr;
      p.fc2 = buf(tok_l * m.h, es);
      p.out = buf(tok_l * m.h, es);
      m.inputs.emplace_back(*m.dev, tok_l * m.h * es);
      p.x = m.inputs.back().get();
      p.comm = tp > 1 ? m.comms[&R - m.ranks.data()].get() : nullptr;
    }
    m.freqs = rot ? rt::DeviceBuffer(*m.dev, std::size_t(s) * rot * sizeof(float)) : rt::DeviceBuffer();
  }
  if (attention_mask) {
    if (m.mask.bytes() != attention_mask->nbytes()) {
      for (auto& R : m.ranks) R.graph.reset();
      m.mask = rt::DeviceBuffer(*m.dev, attention_mask->nbytes());
    }
    m.mask.upload(attention_mask->raw(), attention_mask->nbytes());  // BOOL is one byte per element
  }
  if (rot) m.freqs.upload(rotary_pos_emb->raw(), rotary_pos_emb->nbytes());  // [s, 1, 1, rot] == [s, rot]
  // What only the backward reads, kept when asked: `buf` sized to `bytes`, or null.
  auto kept_buffer = [&](rt::DeviceBuffer& buf, std::size_t bytes, bool keep) -> void* {
    if (!keep) return nullptr;
    if (buf.bytes() != bytes) buf = rt::DeviceBuffer(*m.dev, bytes);
    return buf.get();
  };
  m.kept = false;            // set again once this forward has run
  m.backward_graph.reset();  // captured against the buffers and plan of the forward before

  const int mask_mode = attention_mask                                   ? static_cast<int>(sim::MaskMode::Explicit)
                        : (options_.attn_mask_type == "causal" && s > 1) ? static_cast<int>(sim::MaskMode::Causal)
                                                                         : static_cast<int>(sim::MaskMode::None);
  LayerOutput result;
  for (int r = 0; r < tp; ++r) {
    Impl::Rank& R = m.ranks[r];
    RankPlan& p = R.plan;
    // The softmax statistics [b, np_local, s, 2] fp32; qk-layernorm works in place on linear_qkv's
    // output, so its backward reads a copy from before [s, b, qkv_width].
    float* const stats = static_cast<float*>(
        kept_buffer(R.softmax_stats, sizeof(float) * 2 * std::size_t(b) * p.np_local() * s, fo.keep_for_backward));
    void* const pre_norm = kept_buffer(R.qkv_pre_norm, std::size_t(s) * b * std::size_t(p.qkv_width()) * es,
                                       fo.keep_for_backward && config_.qk_layernorm);
    // graphs bake these values in: a change re-records
    const bool changed = p.training != fo.training || p.seed != fo.seed || p.offset_attention != fo.offset ||
                         p.mask_mode != mask_mode || p.mask_b != mask_b || p.mask_h != mask_h ||
                         p.softmax_stats != stats || p.qkv_pre_norm != pre_norm;
    if (changed) R.graph.reset();
    p.training = fo.training;
    p.seed = fo.seed;
    p.offset_attention = fo.offset;
    p.offset_self_attn_bda = fo.offset + 1;
    p.offset_mlp_bda = fo.offset + 4;  // + 2, + 3: the cross-attention calls a dense layer lacks
    p.mask_mode = mask_mode;
    p.mask_b = mask_b;
    p.mask_h = mask_h;
    p.softmax_stats = stats;
    p.qkv_pre_norm = pre_norm;
    p.mask = attention_mask ? static_cast<const std::uint8_t*>(m.mask.get()) : nullptr;
    p.rot_dim = rot;
    p.rope_interleaved = config_.rotary_interleaved;
    p.freqs = rot ? static_cast<const float*>(m.freqs.get()) : nullptr;
    m.inputs[r].upload(hidden_states.raw() + (sp ? std::size_t(r) * tok_l * m.h * es : 0), tok_l * m.h * es);
    p.on_tap = nullptr;
  }

  // ---- taps. Each rank records, in its own thread, the part of each tap it holds, with the
  // rounding points its thread counted; after the ranks finish, the host puts every tap back
  // together in the reference's full logical shape, shards in rank order (gather_shards), so the
  // one comparison applies at any tp. What each rank holds, as Megatron shards it:
  //   input_layernorm, pre_mlp_layernorm, the row-parallel outputs after their reduction
  //     [s_local, b, h]: with SP each rank's sequence slice, else the same tensor on every rank
  //     (rank 0's is recorded, as a rank-0 hook in Megatron records it);
  //   linear_qkv.0 [s, b, ng_l * (hpg + 2) * hn]: this rank's query groups, contiguous in the
  //     grouped layout; q/k_layernorm [s, b, np_l | ng_l, hn] and core_attention [s, b, np_l * hn]:
  //     this rank's heads;
  //   linear_fc1.0 [s, b, f_l] or with GLU [s, b, 2 * f_l] = [this rank's gate columns | its
  //     linear columns]: the full tensor is [all gate columns | all linear columns];
  //   biases (skip_bias_add outputs): the full parameter, no rounding point.
  struct RankTap {
    std::string name;
    Tensor value;
    RoundingCount rounding;  // this rank's thread, when the tap was produced
    ShardLayout layout;
  };
  std::vector<std::vector<RankTap>> rank_taps(tp);
  const ShardLayout seq_layout = sp ? ShardLayout{0, 1} : ShardLayout{};
  auto tap_handler = [&](int r) {
    return [&, r](TapPoint t) {
      Impl::Rank& R = m.ranks[r];
      const RankPlan& p = R.plan;
      std::vector<RankTap>& taps = rank_taps[r];
      const std::int64_t S = s, S_l = p.s_local(), B = b, H = m.h;
      auto download = [&](const void* ptr, Shape shape) {
        Tensor v = Tensor::empty(m.dt, std::move(shape));
        m.dev->copy(v.raw_mut(), ptr, v.nbytes(), rt::CopyKind::DeviceToHost, R.stream->handle());
        R.stream->synchronize();
        return v;
      };
      auto add = [&](std::string name, Tensor v, ShardLayout layout) {
        taps.push_back({std::move(name), std::move(v), rounding_now(), layout});
      };
      auto bias = [&](const std::string& name, const std::string& key) {
        if (m.full.count(key)) taps.push_back({name, m.full.at(key).clone(), RoundingCount{}, ShardLayout{}});
      };
      // A row-parallel linear's output (after the reduction) and bias (<module>.<linear>.0 / .1),
      // which are also its module's (<module>.0 / .1): the bias is added later, in the
      // bias-dropout-add.
      auto row_parallel = [&](const void* y_dev, const std::string& module, const std::string& linear) {
        const Tensor y = download(y_dev, {S_l, B, H});  // [s_local, b, h]
        const std::string bias_key = module + "." + linear + ".bias";
        add(module + "." + linear + ".0", y, seq_layout);
        bias(module + "." + linear + ".1", bias_key);
        add(module + ".0", y, seq_layout);
        bias(module + ".1", bias_key);
      };
      switch (t) {
        case TapPoint::InputLayernorm:
          add("input_layernorm", download(p.ln1, {S_l, B, H}), seq_layout);
          break;
        case TapPoint::LinearQkv:
          add("self_attention.linear_qkv.0", download(p.qkv, {S, B, p.qkv_width()}), ShardLayout{2, 1});
          break;
        case TapPoint::QkLayernorm: {
          // q [s, b, np_l, hn] and k [s, b, ng_l, hn] out of this rank's grouped qkv rows
          const Tensor qkv = download(p.qkv, {S * B, p.qkv_width()});
          const int hpg = p.hpg(), ng_l = p.ng_local(), np_l = p.np_local();
          Tensor q = Tensor::empty(m.dt, {S, B, np_l, m.hn}), k = Tensor::empty(m.dt, {S, B, ng_l, m.hn});
          const std::size_t head = std::size_t(m.hn) * es;
          for (std::int64_t t2 = 0; t2 < S * B; ++t2)
            for (int g = 0; g < ng_l; ++g) {
              const std::byte* grp =
                  qkv.raw() + (std::size_t(t2) * p.qkv_width() + std::size_t(g) * (hpg + 2) * m.hn) * es;
              std::memcpy(q.raw_mut() + (std::size_t(t2) * np_l + std::size_t(g) * hpg) * head, grp, hpg * head);
              std::memcpy(k.raw_mut() + (std::size_t(t2) * ng_l + g) * head, grp + hpg * head, head);
            }
          add("self_attention.q_layernorm", q, ShardLayout{2, 1});
          add("self_attention.k_layernorm", k, ShardLayout{2, 1});
          break;
        }
        case TapPoint::CoreAttention:
          add("self_attention.core_attention", download(p.ctx, {S, B, std::int64_t(p.np_local()) * m.hn}),
              ShardLayout{2, 1});
          break;
        case TapPoint::LinearProj:
          row_parallel(p.proj, "self_attention", "linear_proj");
          break;
        case TapPoint::PreMlpLayernorm:
          add("pre_mlp_layernorm", download(p.ln2, {S_l, B, H}), seq_layout);
          break;
        case TapPoint::LinearFc1:
          add("mlp.linear_fc1.0", download(p.fc1, {S, B, (p.glu ? 2 : 1) * std::int64_t(p.ffn_local())}),
              ShardLayout{2, p.glu ? 2 : 1});
          bias("mlp.linear_fc1.1", "mlp.linear_fc1.bias");
          break;
        case TapPoint::LinearFc2:
          row_parallel(p.fc2, "mlp", "linear_fc2");
          break;
      }
    };
  };
  if (fo.record_taps)
    for (int r = 0; r < tp; ++r) m.ranks[r].plan.on_tap = tap_handler(r);

  m.run_ranks_counted([&](int r) {
    Impl::Rank& R = m.ranks[r];
    Impl::run_on_stream(R, R.graph, fo.use_graph, [&] {
#if TWIN_HAVE_CUDA
      if (options_.backend == rt::Backend::Cuda) return cuda::rank_forward(R.plan, R.stream->handle());
#endif
      sim::rank_forward(R.plan, R.stream->handle());
    });
  });

  // ---- output: rank 0's full tensor, or (SP) the ranks' sequence slices in rank order
  Tensor out = Tensor::empty(m.dt, {s, b, m.h});
  for (int r = 0; r < (sp ? tp : 1); ++r) {
    m.dev->copy(out.raw_mut() + std::size_t(r) * tok_l * m.h * es, m.ranks[r].plan.out, tok_l * m.h * es,
                rt::CopyKind::DeviceToHost, m.ranks[r].stream->handle());
    m.ranks[r].stream->synchronize();
  }
  for (auto& R : m.ranks) R.plan.on_tap = nullptr;

  // Every rank recorded the same taps in the same order; each becomes one full tensor.
  for (std::size_t i = 0; i < rank_taps[0].size(); ++i) {
    const RankTap& first = rank_taps[0][i];
    std::vector<const Tensor*> shards;
    RoundingCount rounding = first.rounding;
    for (int r = 0; r < tp; ++r) {
      const RankTap& t = rank_taps[r].at(i);
      if (t.name != first.name)
        throw std::logic_error("optimized dense layer: rank " + std::to_string(r) + " recorded tap '" + t.name +
                               "' where rank 0 recorded '" + first.name + "'");
      shards.push_back(&t.value);
      rounding.join(t.rounding);
    }
    RecordEntry& e = result.record.add(Role::Tap, first.name, gather_shards(shards, first.layout));
    e.rounding = rounding;
  }
  m.kept = fo.keep_for_backward;
  result.hidden_states = out;
  return result;
}

double DenseTransformerLayer::time_forward_ms(int iters) {
  return impl_->time_graph_ms(impl_->ranks.at(0).graph, iters,
                              "time_forward_ms: call forward() with use_graph first (tp = 1)");
}

}  // namespace twin::opt
