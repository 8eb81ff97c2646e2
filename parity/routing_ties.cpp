#include "parity/routing_ties.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "parity/bounds.h"
#include "reference/moe/router.h"

namespace twin::parity {

namespace {

// The MoE layer's router, as the capture names its taps: probs .0, routing_map .1, logits .logits.
const std::string kMap = "tap.mlp.router.1", kLogits = "tap.mlp.router.logits";

const RecordEntry* entry(const Record& r, const std::string& key) {
  for (const RecordEntry& e : r.entries)
    if (e.key() == key) return &e;
  return nullptr;
}

// One token's scores in the space the top-k compares, each with how far a correct implementation
// may put it (see the header).
struct Scores {
  std::vector<double> value, bound;
};

Scores selection_scores(const TransformerConfig& cfg, const Tensor& logits, const Tolerance& tol,
                        const std::vector<double>& expert_bias, std::int64_t t, std::int64_t E) {
  // The scores are stored in the router dtype, or in fp32 where Megatron keeps them so.
  const double u = unit_roundoff(cfg.megatron.router_scores_fp32 ? DType::F32 : logits.dtype());
  const std::string& fn = cfg.moe_router_score_function;
  Scores s;
  for (std::int64_t e = 0; e < E; ++e) {
    const double l = logits.at_f64(t * E + e), lb = tol.atol + tol.rtol * std::fabs(l);
    if (fn == "sigmoid" || fn == "sqrtsoftplus") {
      // sigmoid's slope is at most 1/4; sqrt(softplus)'s, sigmoid / (2 sqrt(softplus)), below 1/3.
      const double p = fn == "sigmoid" ? 1.0 / (1.0 + std::exp(-l)) : std::sqrt(l > 20.0 ? l : std::log1p(std::exp(l)));
      s.value.push_back(p + (expert_bias.empty() ? 0.0 : expert_bias[static_cast<std::size_t>(e)]));
      s.bound.push_back((fn == "sigmoid" ? 0.25 : 1.0 / 3.0) * lb + u * p);
    } else {
      s.value.push_back(l);
      // softmax keeps the logits' order; pre-softmax scores stored in the router dtype may tie
      // where the logits differ by up to 2u (p_d / p_c = exp(l_d - l_c)), u on each side.
      s.bound.push_back(lb + (cfg.moe_router_pre_softmax ? u : 0.0));
    }
  }
  return s;
}

// Group-limited routing (moe_router_num_groups, moe_router_group_topk) first chooses groups by the
// sum of each group's top m = topk / group_topk scores: a flip between experts of two groups is
// also a near tie when the two groups' sums lie within their bounds. A sum of a group's top m
// scores moves by at most the m largest of its members' bounds (whichever m are the top), plus the
// sum's rounding in the scores' dtype (m terms: m u |sum|).
struct GroupScores {
  std::vector<double> value, bound;
  std::int64_t size = 0;  // experts per group
};
std::optional<GroupScores> group_scores(const TransformerConfig& cfg, const Scores& s, double u) {
  const int groups = cfg.moe_router_num_groups.value_or(0), group_topk = cfg.moe_router_group_topk.value_or(0);
  const std::int64_t E = static_cast<std::int64_t>(s.value.size());
  if (groups <= 1 || group_topk <= 0 || E % groups != 0) return std::nullopt;
  const int m = cfg.moe_router_topk / group_topk;
  GroupScores g;
  g.size = E / groups;
  for (int grp = 0; grp < groups; ++grp) {
    std::vector<double> values(s.value.begin() + grp * g.size, s.value.begin() + (grp + 1) * g.size);
    std::vector<double> bounds(s.bound.begin() + grp * g.size, s.bound.begin() + (grp + 1) * g.size);
    std::sort(values.rbegin(), values.rend());
    std::sort(bounds.rbegin(), bounds.rend());
    double sum = 0.0, bound = 0.0;
    for (int i = 0; i < m && i < g.size; ++i) {
      sum += values[static_cast<std::size_t>(i)];
      bound += bounds[static_cast<std::size_t>(i)];
    }
    g.value.push_back(sum);
    g.bound.push_back(bound + m * u * std::fabs(sum));
  }
  return g;
}

// Training-mode sinkhorn chooses by the top-k of sinkhorn(logits), whose column scaling every
// token's logits set: a logit within its bound may move another token's choice, so no per-token
// score bound holds. A flip is a near tie there when each side's choice is the top-k of the
// sinkhorn of its own logits (the logits themselves are compared against their bound as a tap),
// up to the rounding of Megatron's fp32 iteration: each step's row and column sums round T or E
// terms and exp, the reciprocal and the products a few more, and the scaling contracts (Hilbert's
// metric), so it does not compound: a ratio of two scores is within 2 (T + E + 4) u_fp32.
Eigen::MatrixXd sinkhorn_log_scores(const Tensor& logits, std::int64_t T, std::int64_t E) {
  Eigen::MatrixXd l(T, E);
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t e = 0; e < E; ++e) l(t, e) = static_cast<float>(logits.at_f64(t * E + e));  // .to(float32)
  return reference::moe::sinkhorn(l).array().log().matrix();
}

// Why the twins cannot run on the golden's map ("" when they can): with capacity dropping the
// golden records the map after the drop, not the top-k choice.
std::string why_not_golden_routing(const TransformerConfig& cfg) {
  if (cfg.moe_expert_capacity_factor)
    return "with capacity dropping the golden records the map after the drop, not the top-k choice";
  return "";
}

}  // namespace

std::string RoutingFlips::describe() const {
  if (!all_near()) return fmt::format("differs on {} tokens; {}", tokens, far);
  std::string list;
  for (std::size_t i = 0; i < near.size() && i < 8; ++i) list += (i ? ", " : "") + std::to_string(near[i]);
  if (near.size() > 8) list += fmt::format(" and {} more", near.size() - 8);
  return fmt::format("differs on {} near-tie token{} ({})", near.size(), near.size() == 1 ? "" : "s", list);
}

std::optional<RoutingFlips> routing_flips(const Fixture& f, const Record& twin) {
  const RecordEntry* mine = entry(twin, kMap);
  const RecordEntry* my_logits = entry(twin, kLogits);
  if (!mine || !my_logits || !f.has(kMap) || !f.has(kLogits)) return std::nullopt;
  const Tensor &golden = f.tensor(kMap), &logits = f.tensor(kLogits);
  const Tensor& map = mine->value;
  if (map.shape() != golden.shape() || golden.dim() != 2 || logits.numel() != golden.numel())
    throw FixtureError(fmt::format("{}: the twin's routing map is {}, the golden's {} (logits {})", f.path,
                                   shape_str(map.shape()), shape_str(golden.shape()), shape_str(logits.shape())));
  const std::int64_t T = golden.shape()[0], E = golden.shape()[1];
  const Tolerance tol = golden_bound(*my_logits, logits);
  std::vector<double> bias;
  if (f.config.moe_router_enable_expert_bias && f.has("param.mlp.router.expert_bias"))
    bias = f.tensor("param.mlp.router.expert_bias").to_f64();

  const bool sinkhorn = f.config.moe_router_load_balancing_type == "sinkhorn" && f.training;
  Eigen::MatrixXd mine_sk, golden_sk;
  if (sinkhorn) {
    mine_sk = sinkhorn_log_scores(my_logits->value, T, E);
    golden_sk = sinkhorn_log_scores(logits, T, E);
  }
  const double sk_slack = 2.0 * static_cast<double>(T + E + 4) * unit_roundoff(DType::F32);

  RoutingFlips r;
  for (std::int64_t t = 0; t < T; ++t) {
    std::vector<std::int64_t> chosen, displaced;  // by the twin alone, by the golden alone
    for (std::int64_t e = 0; e < E; ++e) {
      const bool a = map.at_f64(t * E + e) != 0.0, g = golden.at_f64(t * E + e) != 0.0;
      if (a && !g) chosen.push_back(e);
      if (g && !a) displaced.push_back(e);
    }
    if (chosen.empty() && displaced.empty()) continue;
    ++r.tokens;
    const Scores s = selection_scores(f.config, logits, tol, bias, t, E);
    const std::optional<GroupScores> grouped =
        group_scores(f.config, s, unit_roundoff(f.config.megatron.router_scores_fp32 ? DType::F32 : logits.dtype()));
    std::string why = chosen.size() != displaced.size()
                          ? fmt::format("token {}: the twin chose {} experts where the golden chose {}", t,
                                        chosen.size(), displaced.size())
                          : "";
    for (std::int64_t c : chosen)
      for (std::int64_t d : displaced) {
        if (sinkhorn) {
          const double mine_gap = mine_sk(t, d) - mine_sk(t, c), golden_gap = golden_sk(t, c) - golden_sk(t, d);
          if (why.empty() && mine_gap > sk_slack)
            why = fmt::format(
                "token {} is far from a tie: the twin chose expert {} over expert {}, which the sinkhorn of the twin's "
                "logits ranks higher by {:.3g} (log) > {:.3g}",
                t, c, d, mine_gap, sk_slack);
          if (why.empty() && golden_gap > sk_slack)
            why = fmt::format(
                "token {} is far from a tie: the golden chose expert {} over expert {}, which the sinkhorn of the "
                "golden's logits ranks higher by {:.3g} (log) > {:.3g}",
                t, d, c, golden_gap, sk_slack);
          continue;
        }
        const auto ci = static_cast<std::size_t>(c), di = static_cast<std::size_t>(d);
        const double gap = s.value[di] - s.value[ci], bound = s.bound[ci] + s.bound[di];
        if (grouped && c / grouped->size != d / grouped->size) {
          const auto gc = static_cast<std::size_t>(c / grouped->size), gd = static_cast<std::size_t>(d / grouped->size);
          if (std::fabs(grouped->value[gd] - grouped->value[gc]) <= grouped->bound[gc] + grouped->bound[gd]) continue;
        }
        if (why.empty() && std::fabs(gap) > bound)
          why = fmt::format(
              "token {} is far from a tie: the twin chose expert {} (score {:.6g}) over the golden's expert {} "
              "(score {:.6g}): gap {:.3g} > bound {:.3g}",
              t, c, s.value[ci], d, s.value[di], gap, bound);
      }
    if (why.empty())
      r.near.push_back(t);
    else if (r.far.empty())
      r.far = why;
  }
  if (r.tokens == 0) return std::nullopt;
  r.why_not = why_not_golden_routing(f.config);
  r.takes_golden_routing = r.why_not.empty();
  return r;
}

}  // namespace twin::parity
