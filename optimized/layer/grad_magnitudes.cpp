#include "optimized/layer/grad_magnitudes.h"

#include <algorithm>
#include <cmath>

#include <Eigen/Core>

namespace twin::opt {

std::vector<double> abs_values(const Tensor& t) {
  std::vector<double> v(static_cast<std::size_t>(t.numel()));
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = std::fabs(t.at_f64(static_cast<std::int64_t>(i)));
  return v;
}

double weight_magnitude(const std::vector<double>& dy, const std::vector<double>& x, std::int64_t rows,
                        std::int64_t out, std::int64_t in) {
  if (rows == 0 || out == 0 || in == 0) return 0.0;
  using RowMat = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  const Eigen::Map<const RowMat> d(dy.data(), rows, out), xs(x.data(), rows, in);  // [rows, out], [rows, in]
  // |dy|^T |x| [out, in] is a GEMM (a real layer's fc1: 14336 x 4096 x 1024 tokens); in blocks of
  // 256 of its rows, so it never holds the whole [out, in] in double.
  double m = 0.0;
  RowMat block(std::min<std::int64_t>(256, out), in);  // one allocation: the kernel zeroes each fresh page
  for (std::int64_t o = 0; o < out; o += 256) {
    const std::int64_t k = std::min<std::int64_t>(256, out - o);
    block.topRows(k).noalias() = d.middleCols(o, k).transpose() * xs;  // [k, in]
    m = std::max(m, block.topRows(k).maxCoeff());
  }
  return m;
}

double column_magnitude(const std::vector<double>& dy, std::int64_t rows, std::int64_t cols) {
  std::vector<double> acc(static_cast<std::size_t>(cols), 0.0);
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) acc[c] += dy[r * cols + c];
  return cols ? *std::max_element(acc.begin(), acc.end()) : 0.0;
}

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

AttentionHalfMagnitudes::AttentionHalfMagnitudes(const RankPlan& plan, std::int64_t n,
                                                 std::map<std::string, Source> sources)
    : p_(plan), n_(n), sources_(std::move(sources)) {}

const Tensor& AttentionHalfMagnitudes::tensor(const std::string& name) {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) it = tensors_.emplace(name, sources_.at(name)()).first;
  return it->second;
}

const std::vector<double>& AttentionHalfMagnitudes::abs(const std::string& name) {
  auto it = abs_.find(name);
  if (it == abs_.end()) it = abs_.emplace(name, abs_values(tensor(name))).first;
  return it->second;
}

// q_layernorm / k_layernorm: one norm of width hn over every q (k) head's rows.
double AttentionHalfMagnitudes::qk_norm(bool keys, bool bias) {
  const std::vector<double> dy = gather_heads(abs("d_qkv"), n_, p_, keys);
  const std::int64_t rows = std::int64_t(dy.size()) / p_.hn;
  if (bias) return column_magnitude(dy, rows, p_.hn);
  const std::vector<double> xs = gather_heads(tensor("qkv_pre_norm").to_f64(), n_, p_, keys);
  return norm_weight_magnitude(dy, Tensor::from_doubles(DType::F64, {rows, p_.hn}, xs), rows, p_.hn, p_.rms, p_.eps);
}

Tensor AttentionHalfMagnitudes::first_cols(const std::string& name, std::int64_t width, std::int64_t cols) {
  const std::vector<double> all = tensor(name).to_f64();
  std::vector<double> out;
  out.reserve(static_cast<std::size_t>(n_ * cols));
  for (std::int64_t r = 0; r < n_; ++r) out.insert(out.end(), all.begin() + r * width, all.begin() + r * width + cols);
  return Tensor::from_doubles(DType::F64, {n_, cols}, out);
}

// MLA's projections and latent norms: each linear's from its output gradient and input, each
// norm's from its output gradient and input (kv_layernorm's: the first kv_lora columns of the
// [n, kv_lora + pe] latent).
std::optional<double> AttentionHalfMagnitudes::mla(const std::string& key) {
  const MlaShape& m = p_.mla;
  const std::int64_t n = n_, h = p_.h, np = p_.np, ql = m.q_lora, kvl = m.kv_lora, kvw = m.kv_width();
  const std::int64_t q_out = np * m.q_head(), kv_out = np * (m.qk + m.v);
  const std::string sa = "self_attention.";
  if (key == sa + "linear_q_down_proj.weight") return weight_magnitude(abs("d_q_compressed"), abs("ln1"), n, ql, h);
  if (key == sa + "linear_q_up_proj.weight") return weight_magnitude(abs("d_query"), abs("q_normed"), n, q_out, ql);
  if (key == sa + "linear_q_proj.weight") return weight_magnitude(abs("d_query"), abs("ln1"), n, q_out, h);
  if (key == sa + "linear_kv_down_proj.weight") return weight_magnitude(abs("d_kv_combined"), abs("ln1"), n, kvw, h);
  if (key == sa + "linear_kv_up_proj.weight")
    return weight_magnitude(abs("d_kv"), abs_values(first_cols("kv_normed", kvw, kvl)), n, kv_out, kvl);
  if (key == sa + "q_layernorm.weight")
    return norm_weight_magnitude(abs("d_q_normed"), tensor("q_compressed"), n, ql, p_.rms, p_.eps);
  if (key == sa + "q_layernorm.bias") return column_magnitude(abs("d_q_normed"), n, ql);
  const std::vector<double> d_kv_normed = abs_values(first_cols("d_kv_latent", kvw, kvl));
  if (key == sa + "kv_layernorm.weight")
    return norm_weight_magnitude(d_kv_normed, first_cols("kv_combined", kvw, kvl), n, kvl, p_.rms, p_.eps);
  if (key == sa + "kv_layernorm.bias") return column_magnitude(d_kv_normed, n, kvl);
  return std::nullopt;
}

void add_mla_magnitude_sources(const RankPlan& fp, const MlaRead& read,
                               std::map<std::string, AttentionHalfMagnitudes::Source>& sources) {
  const MlaShape& m = fp.mla;
  const std::int64_t np = fp.np, ql = m.q_lora, kvw = m.kv_width();
  auto add = [&](const char* name, MlaBufferOf ptr, std::int64_t cols, bool per_head) {
    sources[name] = [read, ptr = std::move(ptr), cols, per_head] { return read(ptr, cols, per_head); };
  };
  add(
      "d_query", [](const RankPlan&, const RankGrads& g) { return g.mla.d_query; }, np * m.q_head(), true);
  add(
      "d_kv", [](const RankPlan&, const RankGrads& g) { return g.mla.d_kv; }, np * (m.qk + m.v), true);
  add(
      "q_compressed", [](const RankPlan& p, const RankGrads&) { return p.mla_acts.q_compressed; }, ql, false);
  add(
      "q_normed", [](const RankPlan& p, const RankGrads&) { return p.mla_acts.q_normed; }, ql, false);
  add(
      "d_q_normed", [](const RankPlan&, const RankGrads& g) { return g.mla.d_q_normed; }, ql, false);
  add(
      "d_q_compressed", [](const RankPlan&, const RankGrads& g) { return g.mla.d_q_compressed; }, ql, false);
  add(
      "kv_combined", [](const RankPlan& p, const RankGrads&) { return p.mla_acts.kv_combined; }, kvw, false);
  add(
      "kv_normed", [](const RankPlan& p, const RankGrads&) { return p.mla_acts.kv_normed; }, kvw, false);
  add(
      "d_kv_latent", [](const RankPlan&, const RankGrads& g) { return g.mla.d_kv_latent; }, kvw, false);
  add(
      "d_kv_combined", [](const RankPlan&, const RankGrads& g) { return g.mla.d_kv_combined; }, kvw, false);
}

std::map<std::string, AttentionHalfMagnitudes::Source> attention_half_magnitude_sources(const RankPlan& fp,
                                                                                        const RankTensorReaders& read) {
  const std::int64_t qw = fp.qkv_width(), cw = fp.ctx_width();
  auto rows = [&](const MlaBufferOf& ptr) { return [&read, ptr] { return read.rows(ptr); }; };
  auto heads = [&](const MlaBufferOf& ptr, std::int64_t cols) {
    return [&read, ptr, cols] { return read.heads(ptr, cols); };
  };
  std::map<std::string, AttentionHalfMagnitudes::Source> sources = {
      {"d_ln1", rows([](const RankPlan&, const RankGrads& g) { return g.d_ln1; })},
      {"d_qkv", heads([](const RankPlan&, const RankGrads& g) { return g.d_qkv; }, qw)},
      {"d_qkv_pre", heads([](const RankPlan&, const RankGrads& g) { return g.d_qkv_pre; }, qw)},
      {"d_proj", rows([](const RankPlan&, const RankGrads& g) { return g.d_proj; })},
      {"d_ln2", rows([](const RankPlan&, const RankGrads& g) { return g.d_ln2; })},
      {"x", rows([](const RankPlan& p, const RankGrads&) { return p.x; })},
      {"h1", rows([](const RankPlan& p, const RankGrads&) { return p.h1; })},
      {"ln1",
       [&read, h = std::int64_t(fp.h)] {
         return read.whole([](const RankPlan& p, const RankGrads&) { return p.ln1_full; }, h);
       }},
      {"ctx", heads([](const RankPlan& p, const RankGrads&) { return p.ctx; }, cw)},
      {"qkv_pre_norm", heads([](const RankPlan& p, const RankGrads&) { return p.qkv_pre_norm; }, qw)}};
  if (fp.mla.on)
    add_mla_magnitude_sources(
        fp,
        [&read](const MlaBufferOf& ptr, std::int64_t cols, bool per_head) {
          return per_head ? read.heads(ptr, cols) : read.whole(ptr, cols);
        },
        sources);
  return sources;
}

std::optional<double> AttentionHalfMagnitudes::operator()(const std::string& key) {
  if (p_.mla.on)  // MLA's q_layernorm shares its key with SelfAttention's
    if (const std::optional<double> m = mla(key)) return m;
  const std::int64_t n = n_, h = p_.h, qw = p_.qkv_width(), cw = p_.ctx_width();
  // linear_qkv's output gradient: after the qk-norms' backward when the layer has them
  const char* d_lin = p_.qk_layernorm ? "d_qkv_pre" : "d_qkv";
  if (key == "input_layernorm.weight") return norm_weight_magnitude(abs("d_ln1"), tensor("x"), n, h, p_.rms, p_.eps);
  if (key == "input_layernorm.bias") return column_magnitude(abs("d_ln1"), n, h);
  if (key == "self_attention.linear_qkv.weight") return weight_magnitude(abs(d_lin), abs("ln1"), n, qw, h);
  if (key == "self_attention.linear_qkv.bias") return column_magnitude(abs(d_lin), n, qw);
  if (key == "self_attention.linear_proj.weight") return weight_magnitude(abs("d_proj"), abs("ctx"), n, h, cw);
  if (key == "self_attention.linear_proj.bias") return column_magnitude(abs("d_proj"), n, h);
  if (key == "self_attention.q_layernorm.weight") return qk_norm(false, false);
  if (key == "self_attention.q_layernorm.bias") return qk_norm(false, true);
  if (key == "self_attention.k_layernorm.weight") return qk_norm(true, false);
  if (key == "self_attention.k_layernorm.bias") return qk_norm(true, true);
  if (key == "pre_mlp_layernorm.weight") return norm_weight_magnitude(abs("d_ln2"), tensor("h1"), n, h, p_.rms, p_.eps);
  if (key == "pre_mlp_layernorm.bias") return column_magnitude(abs("d_ln2"), n, h);
  return std::nullopt;
}

}  // namespace twin::opt
