#include "optimized/layer/grad_magnitudes.h"

#include <algorithm>
#include <cmath>

namespace twin::opt {

std::vector<double> abs_values(const Tensor& t) {
  std::vector<double> v(static_cast<std::size_t>(t.numel()));
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = std::fabs(t.at_f64(static_cast<std::int64_t>(i)));
  return v;
}

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

std::optional<double> AttentionHalfMagnitudes::operator()(const std::string& key) {
  const std::int64_t n = n_, h = p_.h, qw = p_.qkv_width(), cw = std::int64_t(p_.np_local()) * p_.hn;
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
