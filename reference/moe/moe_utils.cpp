#include "reference/moe/moe_utils.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

namespace twin::reference::moe {

namespace {

// torch.softmax over each row (max subtracted first).
Mat softmax_rows(const Mat& x) {
  Mat y(x.rows(), x.cols());
  for (Index r = 0; r < x.rows(); ++r) {
    const double m = x.row(r).maxCoeff();
    double sum = 0;
    for (Index c = 0; c < x.cols(); ++c) sum += (y(r, c) = std::exp(x(r, c) - m));
    y.row(r) /= sum;
  }
  return y;
}

Mat sigmoid(const Mat& x) {
  return x.unaryExpr([](double v) { return 1.0 / (1.0 + std::exp(-v)); });
}

// torch.nn.functional.softplus (beta 1, threshold 20: the input itself above it).
Mat softplus(const Mat& x) {
  return x.unaryExpr([](double v) { return v > 20.0 ? v : std::log1p(std::exp(v)); });
}

// The sigmoid path's scores, fp32 until stored in `sdt`: sigmoid(logits.float()), or
// softplus(logits.float()).sqrt() (two fp32 ops).
Mat sigmoid_path_scores(const Mat& logits, const std::string& score_function, DType sdt, const Rounding& rnd) {
  const Mat x = rnd(DType::F32, logits);
  if (score_function == "sqrtsoftplus") return rnd(sdt, rnd(DType::F32, rnd(DType::F32, softplus(x)).cwiseSqrt()));
  return rnd(sdt, rnd(DType::F32, sigmoid(x)));
}

// d logits of the sigmoid path's scores from d scores (both [T, E]): the score function's backward
// in fp32, then .float()'s backward to the router dtype.
Mat sigmoid_path_backward(const Mat& logits, const Mat& dscores, const std::string& score_function, DType rdt,
                          const Rounding& rnd) {
  const Mat x = rnd(DType::F32, logits);
  Mat dlogits(x.rows(), x.cols());
  if (score_function == "sqrtsoftplus") {
    const Mat y = rnd(DType::F32, rnd(DType::F32, softplus(x)).cwiseSqrt());  // the forward's output
    for (Index i = 0; i < x.size(); ++i) {
      const double dsp = rnd(DType::F32, dscores.data()[i] / (2.0 * y.data()[i]));  // rounds: sqrt's backward
      const double v = x.data()[i];
      const double d = v > 20.0 ? dsp : dsp * (1.0 / (1.0 + std::exp(-v)));  // softplus's backward
      dlogits.data()[i] = rnd(rdt, rnd(DType::F32, d));                      // rounds: fp32, then to rdt
    }
    return dlogits;
  }
  const Mat y = rnd(DType::F32, sigmoid(x));  // the fp32 sigmoid output
  for (Index i = 0; i < x.size(); ++i) {
    const double v = y.data()[i];
    dlogits.data()[i] = rnd(rdt, rnd(DType::F32, dscores.data()[i] * v * (1.0 - v)));  // rounds: fp32, then to rdt
  }
  return dlogits;
}

bool is_sigmoid_path(const std::string& score_function) {
  return score_function == "sigmoid" || score_function == "sqrtsoftplus";
}

[[noreturn]] void invalid_score_function(const std::string& score_function) {
  throw MoEError("Invalid score_function: " + score_function + " (softmax | sigmoid | sqrtsoftplus)");
}

// Result dtype of `a (dtype a) + b (dtype b)` in torch for the float dtypes used here.
DType promote(DType a, DType b) {
  if (a == DType::F64 || b == DType::F64) return DType::F64;
  if (a == DType::F32 || b == DType::F32) return DType::F32;
  return a;
}

// scatter(1, indices, values) into zeros [T, E], and the matching map.
Routing scatter_rows(const IndexMat& indices, const Mat& values, Index num_experts) {
  Routing r;
  r.probs = Mat::Zero(indices.rows(), num_experts);
  r.routing_map = BoolMat::Constant(indices.rows(), num_experts, false);
  for (Index t = 0; t < indices.rows(); ++t)
    for (Index j = 0; j < indices.cols(); ++j) {
      r.probs(t, indices(t, j)) = values(t, j);
      r.routing_map(t, indices(t, j)) = true;
    }
  return r;
}

}  // namespace

Tensor to_tensor(const Mat& m, DType dt, Shape shape) {
  if (shape_numel(shape) != m.size())
    throw ShapeError("to_tensor: " + std::to_string(m.size()) + " values for shape " + shape_str(shape));
  return Tensor::from_doubles(dt, std::move(shape), std::vector<double>(m.data(), m.data() + m.size()));
}

BoolMat to_bool_mat(const Tensor& t, Index rows, Index cols) {
  if (t.numel() != rows * cols)
    throw ShapeError("to_bool_mat: tensor " + t.describe() + " cannot be viewed as [" + std::to_string(rows) + ", " +
                     std::to_string(cols) + "]");
  BoolMat m(rows, cols);
  for (Index i = 0; i < rows * cols; ++i) m.data()[i] = t.at_f64(i) != 0.0;
  return m;
}

Tensor to_tensor(const BoolMat& m) {
  return Tensor::from_vector<bool>({m.rows(), m.cols()}, std::vector<bool>(m.data(), m.data() + m.size()));
}

std::vector<Index> topk_indices(const Eigen::Ref<const Eigen::RowVectorXd>& v, Index k) {
  const Index n = v.size();
  if (k < 0 || k > n)
    throw MoEError("topk: k = " + std::to_string(k) + " out of range for " + std::to_string(n) + " values");
  std::vector<Index> idx(static_cast<std::size_t>(n));
  std::iota(idx.begin(), idx.end(), Index{0});
  auto greater = [&](Index a, Index b) {
    const double x = v[a], y = v[b];
    if (std::isnan(x)) return !std::isnan(y);
    if (std::isnan(y)) return false;
    return x > y;
  };
  std::stable_sort(idx.begin(), idx.end(), greater);  // stable: equal values keep index order
  idx.resize(static_cast<std::size_t>(k));
  return idx;
}

double switch_load_balancing_loss_func(const Mat& probs, const std::vector<double>& tokens_per_expert,
                                       double total_num_tokens, int topk, int num_experts, double moe_aux_loss_coeff) {
  if (static_cast<Index>(tokens_per_expert.size()) != probs.cols())
    throw MoEError("switch_load_balancing_loss_func: tokens_per_expert has " +
                   std::to_string(tokens_per_expert.size()) + " entries, probs has " + std::to_string(probs.cols()) +
                   " columns");
  const Eigen::RowVectorXd aggregated_probs_per_expert = probs.colwise().sum();  // [E']
  double s = 0;
  for (Index e = 0; e < probs.cols(); ++e) s += aggregated_probs_per_expert[e] * tokens_per_expert[e];
  return s * (num_experts * moe_aux_loss_coeff / (topk * total_num_tokens * total_num_tokens));
}

double z_loss_func(const Mat& logits, double z_loss_coeff, const std::vector<bool>* padding_mask) {
  double sum = 0, count = 0;
  for (Index t = 0; t < logits.rows(); ++t) {
    if (padding_mask && (*padding_mask)[t]) continue;  // padding rows do not count
    const double m = logits.row(t).maxCoeff();
    const double logsum = m + std::log((logits.row(t).array() - m).exp().sum());
    sum += logsum * logsum;
    count += 1;
  }
  if (padding_mask) return sum / std::max(count, 1.0) * z_loss_coeff;
  return sum / static_cast<double>(logits.rows()) * z_loss_coeff;
}

Index get_capacity(Index num_tokens, Index num_experts, double capacity_factor) {
  return static_cast<Index>(std::ceil((static_cast<double>(num_tokens) / num_experts) * capacity_factor));
}

TokenCounts get_tokens_per_expert_and_token_count(const BoolMat& routing_map, int topk, bool with_padding_mask) {
  TokenCounts c;
  c.global_tokens_per_expert.resize(static_cast<std::size_t>(routing_map.cols()));
  double routed = 0;
  for (Index e = 0; e < routing_map.cols(); ++e) {
    c.global_tokens_per_expert[e] = static_cast<double>(routing_map.col(e).count());
    routed += c.global_tokens_per_expert[e];
  }
  if (with_padding_mask) {
    c.local_num_tokens = routed / topk;
    c.total_num_tokens = routed / topk;
  } else {
    c.local_num_tokens = static_cast<double>(routing_map.rows());
    c.total_num_tokens = c.local_num_tokens;  // one rank: the reduce group has size 1
  }
  return c;
}

TopK topk_rows(const Mat& scores, int k) {
  TopK r;
  r.values.resize(scores.rows(), k);
  r.indices.resize(scores.rows(), k);
  for (Index t = 0; t < scores.rows(); ++t) {
    const auto idx = topk_indices(scores.row(t), k);
    for (int j = 0; j < k; ++j) {
      r.indices(t, j) = idx[j];
      r.values(t, j) = scores(t, idx[j]);
    }
  }
  return r;
}

TopK group_limited_topk(const Mat& scores, int topk, int num_groups, int group_topk, DType rdt, const Rounding& rnd) {
  const Index T = scores.rows(), E = scores.cols(), per_group = E / num_groups;
  // group_scores: sum of the top (topk / group_topk) scores inside each group, stored in rdt.
  Mat group_scores(T, num_groups);  // [T, G]
  for (Index t = 0; t < T; ++t)
    for (Index g = 0; g < num_groups; ++g) {
      const Eigen::RowVectorXd in_group = scores.row(t).segment(g * per_group, per_group);
      double s = 0;
      for (Index i : topk_indices(in_group, topk / group_topk)) s += in_group[i];
      group_scores(t, g) = rnd(rdt, s);
    }
  // Mask the experts outside the selected groups with -inf, then top-k.
  Mat masked_scores = Mat::Constant(T, E, -std::numeric_limits<double>::infinity());  // [T, E]
  for (Index t = 0; t < T; ++t)
    for (Index g : topk_indices(group_scores.row(t), group_topk))
      masked_scores.row(t).segment(g * per_group, per_group) = scores.row(t).segment(g * per_group, per_group);
  return topk_rows(masked_scores, topk);
}

void check_given_selection(const BoolMat& selection, Index T, Index E, int k) {
  if (selection.rows() != T || selection.cols() != E)
    throw MoEError("a given top-k selection is [" + std::to_string(selection.rows()) + ", " +
                   std::to_string(selection.cols()) + "], the logits [" + std::to_string(T) + ", " + std::to_string(E) +
                   "]");
  for (Index t = 0; t < T; ++t)
    if (selection.row(t).count() != k)
      throw MoEError("a given top-k selection gives token " + std::to_string(t) + " " +
                     std::to_string(selection.row(t).count()) + " experts, moe_router_topk is " + std::to_string(k));
}

Routing topk_routing_with_score_function(const Mat& logits, const RoutingOptions& opt,
                                         const std::vector<double>* expert_bias, DType rdt, const Rounding& rnd) {
  const Index T = logits.rows(), E = logits.cols();
  const int k = opt.topk;
  if (k < 1 || k > E)
    throw MoEError("moe_router_topk (" + std::to_string(k) + ") must be in [1, num_moe_experts (" + std::to_string(E) +
                   ")]");
  if (opt.selection) check_given_selection(*opt.selection, T, E, k);
  // Scores are stored in sdt until the final cast (the pin: the router dtype throughout).
  const DType sdt = opt.scores_fp32 ? DType::F32 : rdt;
  // top-k over scores held in dtype `dt` (a group's score sum is stored in it).
  auto compute_topk = [&](const Mat& scores, DType dt) {
    if (opt.selection) {  // the given experts, largest score first as torch.topk orders them
      Mat given = Mat::Constant(T, E, -std::numeric_limits<double>::infinity());
      for (Index t = 0; t < T; ++t) {
        for (Index e = 0; e < E; ++e)
          if ((*opt.selection)(t, e)) given(t, e) = scores(t, e);
      }
      return topk_rows(given, k);
    }
    if (opt.group_topk && *opt.group_topk)
      return group_limited_topk(scores, k, opt.num_groups.value_or(0), *opt.group_topk, dt, rnd);
    return topk_rows(scores, k);
  };
  // softmax(x, dtype=float32) casts x to fp32, computes in fp32; the pin's .type_as(logits) stores in rdt.
  auto softmax_fp32 = [&](const Mat& x) { return rnd(sdt, rnd(DType::F32, softmax_rows(rnd(DType::F32, x)))); };

  TopK top;
  Mat probs;  // [T, k]
  if (opt.score_function == "softmax") {
    if (opt.use_pre_softmax) {
      const Mat scores = softmax_fp32(logits);  // [T, E]
      top = compute_topk(scores, sdt);
      probs = top.values;
    } else {
      top = compute_topk(logits, rdt);
      probs = softmax_fp32(top.values);  // softmax over the k chosen logits
    }
  } else if (is_sigmoid_path(opt.score_function)) {
    const Mat scores = sigmoid_path_scores(logits, opt.score_function, sdt, rnd);  // [T, E]
    if (expert_bias) {
      // The bias (fp32) only chooses the experts; the probabilities stay unbiased.
      Mat scores_for_routing = scores;
      for (Index t = 0; t < T; ++t)
        for (Index e = 0; e < E; ++e) scores_for_routing(t, e) += (*expert_bias)[e];
      top = compute_topk(rnd(promote(sdt, DType::F32), scores_for_routing), promote(sdt, DType::F32));
      probs.resize(T, k);
      for (Index t = 0; t < T; ++t)
        for (int j = 0; j < k; ++j) probs(t, j) = scores(t, top.indices(t, j));
    } else {
      top = compute_topk(scores, sdt);
      probs = top.values;
    }
    if (k > 1) {  // renormalise over the k selected
      for (Index t = 0; t < T; ++t) {
        const double denom = rnd(sdt, rnd(sdt, probs.row(t).sum()) + 1e-20);
        for (int j = 0; j < k; ++j) probs(t, j) = rnd(sdt, probs(t, j) / denom);
      }
    }
  } else {
    invalid_score_function(opt.score_function);
  }
  if (opt.scaling_factor && *opt.scaling_factor != 0.0) probs = rnd(sdt, Mat(probs * *opt.scaling_factor));
  return scatter_rows(top.indices, rnd(rdt, probs), E);  // probs.type_as(logits)
}

AuxScores compute_routing_scores_for_aux_loss(const Mat& logits, int topk, const std::string& score_function,
                                              bool scores_fp32, const std::vector<bool>* padding_mask, DType rdt,
                                              const Rounding& rnd) {
  AuxScores a;
  if (score_function == "softmax") {
    a.scores = rnd(DType::F32, softmax_rows(rnd(DType::F32, logits)));  // fp32, no type_as
  } else if (is_sigmoid_path(score_function)) {
    // The pin: torch.sigmoid(logits) in rdt; now the score function of logits.float().
    const DType adt = scores_fp32 ? DType::F32 : rdt;
    a.scores = scores_fp32 ? sigmoid_path_scores(logits, score_function, adt, rnd) : rnd(adt, sigmoid(logits));
    for (Index t = 0; t < a.scores.rows(); ++t) {  // / (sum + 1e-20), in adt
      const double denom = rnd(adt, rnd(adt, a.scores.row(t).sum()) + 1e-20);
      for (Index e = 0; e < a.scores.cols(); ++e) a.scores(t, e) = rnd(adt, a.scores(t, e) / denom);
    }
  } else {
    invalid_score_function(score_function);
  }
  const TopK top = topk_rows(a.scores, topk);
  a.routing_map = scatter_rows(top.indices, top.values, logits.cols()).routing_map;
  if (padding_mask) {
    for (Index t = 0; t < logits.rows(); ++t)
      if ((*padding_mask)[t]) {
        a.routing_map.row(t).setConstant(false);
        a.scores.row(t).setZero();
      }
  }
  return a;
}

// softmax's backward from its output y (fp32): dx = y (dy - sum(dy y)), stored in fp32.
static Eigen::RowVectorXd softmax_backward_row(const Eigen::RowVectorXd& y, const Eigen::RowVectorXd& dy,
                                               const Rounding& rnd) {
  const double dot = (y.array() * dy.array()).sum();
  Eigen::RowVectorXd dx(y.size());
  for (Index i = 0; i < y.size(); ++i) dx[i] = rnd(DType::F32, y[i] * (dy[i] - dot));
  return dx;
}

Mat topk_routing_backward(const Mat& logits, const Mat& dprobs_in, const BoolMat& selected, const RoutingOptions& opt,
                          DType rdt, const Rounding& rnd) {
  const Index T = logits.rows(), E = logits.cols();
  if (dprobs_in.rows() != T || dprobs_in.cols() != E || selected.rows() != T || selected.cols() != E)
    throw ShapeError("topk_routing_backward: logits [" + std::to_string(T) + ", " + std::to_string(E) + "], dprobs [" +
                     std::to_string(dprobs_in.rows()) + ", " + std::to_string(dprobs_in.cols()) + "], routing_map [" +
                     std::to_string(selected.rows()) + ", " + std::to_string(selected.cols()) + "]");
  // The scatter's backward: only the chosen entries carry a gradient.
  Mat dprobs = dprobs_in.array() * selected.cast<double>().array();
  const DType sdt = opt.scores_fp32 ? DType::F32 : rdt;  // the forward's scores dtype
  if (opt.scaling_factor && *opt.scaling_factor != 0.0)
    dprobs = rnd(sdt, Mat(dprobs * *opt.scaling_factor));  // rounds: probs * scaling_factor's backward
  Mat dlogits = Mat::Zero(T, E);
  if (opt.score_function == "softmax") {
    for (Index t = 0; t < T; ++t) {
      // The softmax's input: the whole row (pre-softmax) or the k chosen logits.
      std::vector<Index> cols;
      for (Index e = 0; e < E; ++e)
        if (opt.use_pre_softmax || selected(t, e)) cols.push_back(e);
      const Index n = static_cast<Index>(cols.size());
      Eigen::RowVectorXd x(n), dy(n);
      for (Index i = 0; i < n; ++i) {
        x[i] = rnd(DType::F32, logits(t, cols[i]));
        dy[i] = dprobs(t, cols[i]);  // .type_as's backward: to fp32, exact
      }
      const Eigen::RowVectorXd y = rnd(DType::F32, softmax_rows(Mat(x))).row(0);  // the fp32 softmax output
      const Eigen::RowVectorXd dx = softmax_backward_row(y, dy, rnd);
      for (Index i = 0; i < n; ++i) dlogits(t, cols[i]) = rnd(rdt, dx[i]);  // rounds: .float()'s backward, to rdt
    }
  } else if (is_sigmoid_path(opt.score_function)) {
    const Mat scores = sigmoid_path_scores(logits, opt.score_function, sdt, rnd);
    Mat dscores = dprobs;
    if (opt.topk > 1) {  // probs = scores / (scores.sum(-1) + 1e-20) over the k chosen
      for (Index t = 0; t < T; ++t) {
        double sum = 0.0, dot = 0.0;
        for (Index e = 0; e < E; ++e)
          if (selected(t, e)) sum += scores(t, e);
        const double denom = rnd(sdt, rnd(sdt, sum) + 1e-20);
        for (Index e = 0; e < E; ++e)
          if (selected(t, e)) dot += dprobs(t, e) * scores(t, e);
        const double ddenom = rnd(sdt, -dot / (denom * denom));  // rounds: the division's backward for the denominator
        for (Index e = 0; e < E; ++e)
          dscores(t, e) =
              selected(t, e) ? rnd(sdt, rnd(sdt, dprobs(t, e) / denom) + ddenom) : 0.0;  // rounds: / denom, + d denom
      }
    }
    dlogits = sigmoid_path_backward(logits, dscores, opt.score_function, rdt, rnd);
  } else {
    invalid_score_function(opt.score_function);
  }
  return dlogits;
}

Mat aux_scores_backward(const Mat& logits, const Mat& dscores, const std::string& score_function, bool scores_fp32,
                        DType rdt, const Rounding& rnd) {
  const Index T = logits.rows(), E = logits.cols();
  Mat dlogits(T, E);
  if (score_function == "softmax") {  // torch.softmax(logits, dtype=float32): fp32 output, no type_as
    const Mat y = rnd(DType::F32, softmax_rows(rnd(DType::F32, logits)));
    for (Index t = 0; t < T; ++t) {
      const Eigen::RowVectorXd dx = softmax_backward_row(y.row(t), dscores.row(t), rnd);
      for (Index e = 0; e < E; ++e) dlogits(t, e) = rnd(rdt, dx[e]);  // rounds: to the logits' dtype
    }
  } else if (is_sigmoid_path(score_function)) {  // the scores, / (sum + 1e-20), in adt
    const DType adt = scores_fp32 ? DType::F32 : rdt;
    const Mat s = scores_fp32 ? sigmoid_path_scores(logits, score_function, adt, rnd) : rnd(adt, sigmoid(logits));
    Mat ds(T, E);
    for (Index t = 0; t < T; ++t) {
      const double denom = rnd(adt, rnd(adt, s.row(t).sum()) + 1e-20);
      double dot = 0.0;
      for (Index e = 0; e < E; ++e) dot += dscores(t, e) * s(t, e);
      const double ddenom = rnd(adt, -dot / (denom * denom));
      for (Index e = 0; e < E; ++e) ds(t, e) = rnd(adt, rnd(adt, dscores(t, e) / denom) + ddenom);
    }
    if (scores_fp32) return sigmoid_path_backward(logits, ds, score_function, rdt, rnd);
    for (Index t = 0; t < T; ++t)  // the pin: sigmoid's backward in rdt
      for (Index e = 0; e < E; ++e) dlogits(t, e) = rnd(rdt, ds(t, e) * s(t, e) * (1.0 - s(t, e)));
  } else {
    invalid_score_function(score_function);
  }
  return dlogits;
}

Mat z_loss_backward(const Mat& logits, double z_loss_coeff, const std::vector<bool>* padding_mask, DType rdt,
                    const Rounding& rnd) {
  const Index T = logits.rows(), E = logits.cols();
  double count = static_cast<double>(T);
  if (padding_mask) {
    count = 0;
    for (Index t = 0; t < T; ++t) count += (*padding_mask)[t] ? 0.0 : 1.0;
    count = std::max(count, 1.0);
  }
  const double dvalue = rnd(rdt, rnd(rdt, z_loss_coeff) / count);  // rounds: mean's (sum / count's) backward
  Mat dlogits = Mat::Zero(T, E);
  for (Index t = 0; t < T; ++t) {
    if (padding_mask && (*padding_mask)[t]) continue;
    const double m = logits.row(t).maxCoeff();
    const double lse = rnd(rdt, m + std::log((logits.row(t).array() - m).exp().sum()));  // the forward's logsumexp
    const double dlse = rnd(rdt, 2.0 * lse * dvalue);                                    // rounds: square's backward
    for (Index e = 0; e < E; ++e)
      dlogits(t, e) = rnd(rdt, dlse * std::exp(logits(t, e) - lse));  // rounds: logsumexp's backward
  }
  return dlogits;
}

Routing apply_router_token_dropping(const Routing& routing, int router_topk, double capacity_factor,
                                    const std::string& drop_policy, bool pad_to_capacity) {
  const Index T = routing.probs.rows(), E = routing.probs.cols();
  const Index expert_capacity = get_capacity(T * router_topk, E, capacity_factor);

  BoolMat capacity_mask = BoolMat::Constant(T, E, true);  // [T, E]
  if (expert_capacity <= T) {                             // otherwise no expert can overflow
    Mat key(T, E);
    if (drop_policy == "probs")
      key = routing.probs;  // highest prob wins
    else if (drop_policy == "position")
      key = routing.routing_map.cast<double>();  // routed, earliest first
    else
      throw MoEError("Invalid drop_policy: " + drop_policy + " (probs | position)");
    capacity_mask.setConstant(false);
    for (Index e = 0; e < E; ++e) {
      const Eigen::RowVectorXd column = key.col(e).transpose();
      for (Index t : topk_indices(column, expert_capacity)) capacity_mask(t, e) = true;
    }
  }
  Routing out;
  out.routing_map = pad_to_capacity ? capacity_mask : BoolMat(routing.routing_map.array() && capacity_mask.array());
  out.probs = routing.probs.array() * out.routing_map.cast<double>().array();
  return out;
}

Permuted permute(const Mat& tokens, const BoolMat& routing_map, const Mat* probs, std::optional<Index> num_out_tokens,
                 bool drop_and_pad) {
  const Index T = tokens.rows(), E = routing_map.cols();
  if (routing_map.rows() != T)
    throw ShapeError("permute: routing_map has " + std::to_string(routing_map.rows()) + " rows, tokens " +
                     std::to_string(T));
  Permuted p;
  if (drop_and_pad && num_out_tokens) {
    // Each expert takes `capacity` rows: its routed tokens in token order (a stable descending
    // argsort of the map column), then, if short, the earliest unrouted tokens.
    const Index capacity = *num_out_tokens / E;
    for (Index e = 0; e < E; ++e) {
      const Eigen::RowVectorXd column = routing_map.col(e).cast<double>().transpose();
      for (Index t : topk_indices(column, std::min(capacity, T))) p.sorted_indices.push_back(t);
    }
  } else {
    for (Index e = 0; e < E; ++e)
      for (Index t = 0; t < T; ++t)
        if (routing_map(t, e)) p.sorted_indices.push_back(t);
  }
  const Index N = static_cast<Index>(p.sorted_indices.size());
  p.tokens.resize(N, tokens.cols());
  if (probs) p.probs.resize(static_cast<std::size_t>(N));
  // sorted_indices is expert-major, so the expert of row i follows from the per-expert counts.
  Index i = 0;
  for (Index e = 0; e < E; ++e) {
    const Index count =
        (drop_and_pad && num_out_tokens) ? std::min(*num_out_tokens / E, T) : routing_map.col(e).count();
    for (Index j = 0; j < count; ++j, ++i) {
      const Index t = p.sorted_indices[i];
      p.tokens.row(i) = tokens.row(t);
      if (probs) p.probs[i] = (*probs)(t, e);
    }
  }
  return p;
}

Mat unpermute(const Mat& permuted_tokens_in, const std::vector<Index>& sorted_indices, Index restore_rows, DType dt,
              const Rounding& rnd, const Mat* probs, const BoolMat* routing_map) {
  if (static_cast<Index>(sorted_indices.size()) != permuted_tokens_in.rows())
    throw ShapeError("unpermute: " + std::to_string(sorted_indices.size()) + " indices for " +
                     std::to_string(permuted_tokens_in.rows()) + " rows");
  Mat permuted_tokens = permuted_tokens_in;  // [N, H]
  if (probs) {
    if (!routing_map) throw MoEError("unpermute: Mask must be provided to permute the probs.");
    // permuted_probs = probs.T.masked_select(routing_map.T): expert-major, token order.
    std::vector<double> permuted_probs;
    for (Index e = 0; e < routing_map->cols(); ++e)
      for (Index t = 0; t < routing_map->rows(); ++t)
        if ((*routing_map)(t, e)) permuted_probs.push_back((*probs)(t, e));
    if (static_cast<Index>(permuted_probs.size()) != permuted_tokens.rows())
      throw ShapeError("unpermute: routing_map selects " + std::to_string(permuted_probs.size()) + " probs for " +
                       std::to_string(permuted_tokens.rows()) + " rows");
    for (Index i = 0; i < permuted_tokens.rows(); ++i)
      for (Index h = 0; h < permuted_tokens.cols(); ++h)
        permuted_tokens(i, h) = rnd(dt, permuted_tokens(i, h) * permuted_probs[i]);
  }
  Mat output_tokens = Mat::Zero(restore_rows, permuted_tokens.cols());  // [T, H]
  for (Index i = 0; i < permuted_tokens.rows(); ++i) {                  // scatter_add_, one row at a time
    const Index t = sorted_indices[i];
    for (Index h = 0; h < permuted_tokens.cols(); ++h)
      output_tokens(t, h) = rnd(dt, output_tokens(t, h) + permuted_tokens(i, h));
  }
  return output_tokens;
}

Mat sort_chunks_by_idxs(const Mat& input, const std::vector<Index>& split_sizes, const std::vector<Index>& sorted_idxs,
                        std::vector<double>* probs) {
  std::vector<Index> starts(split_sizes.size() + 1, 0);
  for (std::size_t i = 0; i < split_sizes.size(); ++i) starts[i + 1] = starts[i] + split_sizes[i];
  if (starts.back() != input.rows())
    throw ShapeError("sort_chunks_by_idxs: split sizes sum to " + std::to_string(starts.back()) + ", input has " +
                     std::to_string(input.rows()) + " rows");
  Mat output(input.rows(), input.cols());
  std::vector<double> permuted_probs;
  Index r = 0;
  for (Index c : sorted_idxs) {
    output.middleRows(r, split_sizes[c]) = input.middleRows(starts[c], split_sizes[c]);
    if (probs) permuted_probs.insert(permuted_probs.end(), probs->begin() + starts[c], probs->begin() + starts[c + 1]);
    r += split_sizes[c];
  }
  if (probs) *probs = std::move(permuted_probs);
  return output;
}

}  // namespace twin::reference::moe
