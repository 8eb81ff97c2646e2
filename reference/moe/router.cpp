#include "reference/moe/router.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <vector>

namespace twin::reference::moe {

namespace {

// Counter-based uniform in [0, 1): splitmix64 of (seed, call, element), 53 bits.
double uniform01(std::uint64_t seed, std::uint64_t call, std::uint64_t i) {
  std::uint64_t z = seed ^ (call * 0x9E3779B97F4A7C15ull) ^ (i * 0xD1B54A32D192ED03ull);
  for (int r = 0; r < 2; ++r) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
  }
  return static_cast<double>(z >> 11) * 0x1.0p-53;
}

// The top-k choice a recorded post-drop routing map implies: each token's recorded experts, then
// its experts of `routed` (the top-k's choice) by probability, largest first, up to k. Megatron's
// choice where a (near) tie at a token's top-k cut flipped, ours elsewhere (the experts capacity
// dropping removed come back from ours).
BoolMat recorded_selection(const BoolMat& recorded, const Routing& routed, int k) {
  BoolMat s = recorded;  // [T, E]
  for (Index t = 0; t < s.rows(); ++t) {
    if (s.row(t).count() > k)
      throw MoEError("recorded routing map gives token " + std::to_string(t) + " " + std::to_string(s.row(t).count()) +
                     " experts, moe_router_topk is " + std::to_string(k));
    std::vector<Index> ours;
    for (Index e = 0; e < s.cols(); ++e)
      if (routed.routing_map(t, e) && !s(t, e)) ours.push_back(e);
    std::stable_sort(ours.begin(), ours.end(),
                     [&](Index a, Index b) { return routed.probs(t, a) > routed.probs(t, b); });
    for (std::size_t i = 0; i < ours.size() && s.row(t).count() < k; ++i) s(t, ours[i]) = true;
  }
  return s;
}

}  // namespace

TopKRouter::TopKRouter(const TransformerConfig& config, Precision precision) : config_(config), precision_(precision) {
  if (!config.num_moe_experts || *config.num_moe_experts <= 0)
    throw MoEError("TopKRouter: num_moe_experts must be set and positive");
  num_experts_ = *config.num_moe_experts;
  topk_ = config.moe_router_topk;
  // gating(): router_dtype = input dtype unless moe_router_dtype asks for fp32 / fp64.
  if (config.moe_router_dtype == std::optional<std::string>("fp32"))
    router_dtype_ = precision.fp32_storage_dtype();
  else if (config.moe_router_dtype == std::optional<std::string>("fp64"))
    router_dtype_ = DType::F64;
  else if (!config.moe_router_dtype)
    router_dtype_ = precision.storage_dtype();
  else
    throw MoEError("moe_router_dtype must be None, 'fp32' or 'fp64', got '" + *config.moe_router_dtype + "'");
  local_tokens_per_expert.assign(num_experts_, 0.0);
  global_tokens_per_expert.assign(num_experts_, 0.0);
}

void TopKRouter::load_state_dict(const StateDict& sd, const std::string& prefix) {
  const Rounding rnd = Rounding::of(precision_);
  weight = sd.matrix(prefix + "weight", num_experts_, config_.hidden_size);  // [E, h]
  if (config_.add_bias_linear) bias = sd.vector(prefix + "bias", num_experts_);
  if (config_.moe_router_enable_expert_bias) {
    std::vector<double> eb(num_experts_, 0.0);  // a zero buffer until trained
    if (sd.has(prefix + "expert_bias")) {
      const RowVec v = sd.vector(prefix + "expert_bias", num_experts_);
      for (int e = 0; e < num_experts_; ++e) eb[e] = rnd(DType::F32, v[e]);  // _maintain_float32_expert_bias
    }
    expert_bias = eb;
  }
}

Mat TopKRouter::apply_input_jitter(const Mat& input) {
  if (!config_.moe_input_jitter_eps) return input;
  const double eps = *config_.moe_input_jitter_eps;
  const Rounding rnd = Rounding::of(precision_);
  const DType dt = precision_.storage_dtype();
  const std::uint64_t call = jitter_calls++;
  Mat out(input.rows(), input.cols());
  for (Index i = 0; i < input.size(); ++i) {
    // Uniform(1 - eps, 1 + eps).rsample in the input dtype, then input * noise.
    const double noise =
        rnd(dt, rnd(dt, 1.0 - eps) + uniform01(jitter_seed, call, i) * (rnd(dt, 1.0 + eps) - rnd(dt, 1.0 - eps)));
    out.data()[i] = rnd(dt, input.data()[i] * noise);
  }
  return out;
}

Mat TopKRouter::gating(const Mat& input) const {
  if (input.cols() != config_.hidden_size)
    throw ShapeError("TopKRouter.gating: input has " + std::to_string(input.cols()) + " features, hidden_size is " +
                     std::to_string(config_.hidden_size));
  // router_gating_linear: mm(inp.to(router_dtype), weight.to(router_dtype).t()) (+ bias), stored in router dtype.
  Mat logits = input * weight.transpose();  // [T, E]
  if (bias) logits.rowwise() += *bias;
  return Rounding::of(precision_)(router_dtype_, logits);
}

double TopKRouter::get_aux_loss_coeff(const std::string& aux_loss_type) const {
  return config_.moe_router_load_balancing_type == aux_loss_type ? config_.moe_aux_loss_coeff : 0.0;
}

RoutingOptions TopKRouter::routing_options() const {
  RoutingOptions opt;
  opt.topk = topk_;
  opt.use_pre_softmax = config_.moe_router_pre_softmax;
  opt.num_groups = config_.moe_router_num_groups;
  opt.group_topk = config_.moe_router_group_topk;
  opt.scaling_factor = config_.moe_router_topk_scaling_factor;
  opt.score_function = config_.moe_router_score_function;
  opt.scores_fp32 = config_.megatron.router_scores_fp32;
  return opt;
}

bool TopKRouter::is_aux_loss_enabled() const {
  for (const char* t : {"aux_loss", "seq_aux_loss", "global_aux_loss"})
    if (get_aux_loss_coeff(t) > 0) return true;
  return false;
}

Mat sinkhorn(const Mat& cost_in, double tol) {
  const Mat cost = cost_in.array().exp();
  Eigen::VectorXd d0 = Eigen::VectorXd::Ones(cost.rows());
  Eigen::RowVectorXd d1 = Eigen::RowVectorXd::Ones(cost.cols());
  const double eps = 0.00000001;
  double error = 1e9;
  Eigen::RowVectorXd d1_old = d1;
  while (error > tol) {
    d0 = ((cost * d1.transpose()).array() + eps).inverse() / static_cast<double>(d0.size());
    d1 = ((d0.transpose() * cost).array() + eps).inverse() / static_cast<double>(d1.size());
    error = (d1_old - d1).array().abs().mean();
    d1_old = d1;
  }
  return (d0.asDiagonal() * cost) * d1.asDiagonal();
}

Routing TopKRouter::sinkhorn_load_balancing(const Mat& logits, const BoolMat* selection) const {
  const Rounding rnd = Rounding::of(precision_);
  auto activation = [&](const Mat& x) -> Mat {
    if (topk_ == 1) return rnd(router_dtype_, x.unaryExpr([](double v) { return 1.0 / (1.0 + std::exp(-v)); }));
    Mat y(x.rows(), x.cols());  // softmax in fp32, .type_as(logits)
    for (Index r = 0; r < x.rows(); ++r) {
      const Eigen::RowVectorXd e = (x.row(r).array() - x.row(r).maxCoeff()).exp();
      y.row(r) = e / e.sum();
    }
    return rnd(router_dtype_, rnd(DType::F32, y));
  };
  const Mat act = activation(logits);
  Routing r;
  if (selection) {  // a given choice (a golden's): k experts per token
    check_given_selection(*selection, logits.rows(), logits.cols(), topk_);
    r.routing_map = *selection;
  } else {
    const TopK top = training ? topk_rows(sinkhorn(rnd(DType::F32, logits)), topk_) : topk_rows(act, topk_);
    r.routing_map = BoolMat::Constant(logits.rows(), logits.cols(), false);
    for (Index t = 0; t < top.indices.rows(); ++t)
      for (Index j = 0; j < top.indices.cols(); ++j) r.routing_map(t, top.indices(t, j)) = true;
  }
  r.probs = act.array() * r.routing_map.cast<double>().array();
  return r;
}

void TopKRouter::use_recorded_routing_map(RouterOutput& r, const RouterOutput& before_drop, const BoolMat& rec) const {
  if (rec.rows() != r.routing_map.rows() || rec.cols() != r.routing_map.cols())
    throw MoEError("recorded routing map is [" + std::to_string(rec.rows()) + ", " + std::to_string(rec.cols()) +
                   "], the router produced [" + std::to_string(r.routing_map.rows()) + ", " +
                   std::to_string(r.routing_map.cols()) + "]");
  // A valid tie resolution keeps the same number of tokens per expert and, unless padding to
  // capacity, only (token, expert) pairs the top-k chose.
  for (Index e = 0; e < rec.cols(); ++e) {
    if (rec.col(e).count() != r.routing_map.col(e).count())
      throw MoEError("recorded routing map gives expert " + std::to_string(e) + " " +
                     std::to_string(rec.col(e).count()) + " tokens, the capacity rule gives " +
                     std::to_string(r.routing_map.col(e).count()));
    if (!config_.moe_pad_expert_input_to_capacity)
      for (Index t = 0; t < rec.rows(); ++t)
        if (rec(t, e) && !before_drop.routing_map(t, e))
          throw MoEError("recorded routing map routes token " + std::to_string(t) + " to expert " + std::to_string(e) +
                         ", which its top-k did not choose");
  }
  r.routing_map = rec;
  r.probs = before_drop.probs.array() * rec.cast<double>().array();
}

Mat TopKRouter::apply_load_balancing_losses(const Mat& logits, Index seq_length, Index bsz,
                                            const std::vector<bool>* padding_mask, AuxLosses* aux_losses) {
  const Rounding rnd = Rounding::of(precision_);
  const bool with_padding_mask = padding_mask != nullptr;
  const AuxScores aux =
      compute_routing_scores_for_aux_loss(logits, topk_, config_.moe_router_score_function,
                                          config_.megatron.aux_loss_scores_fp32, padding_mask, router_dtype_, rnd);
  const Mat& scores_for_aux_loss = aux.scores;                // [T, E]
  const BoolMat& routing_map_for_aux_loss = aux.routing_map;  // [T, E]
  const DType loss_dt = precision_.fp32_storage_dtype();      // the losses are fp32 tensors
  auto log = [&](const std::string& name, double loss, double coeff) {
    if (aux_losses) (*aux_losses)[name] += rnd(loss_dt, rnd(loss_dt, loss) / coeff);  // loss / coeff
  };
  // The backward's gradient of a loss sum_e (sum_t scores[t, e]) tokens[e] scale, for the
  // autoscaler's gradient 1.0: tokens[e] scale on every non-padding row (padding rows' scores were
  // zeroed by the valid mask). The loss is in the scores' dtype: fp32 for softmax (dtype=float32),
  // for the sigmoid path the router dtype at the pin, fp32 since.
  const DType aux_dt = aux_scores_dtype();
  auto add_grad = [&](const std::vector<double>& tokens, double scale, Index cols_per_row_block) {
    if (!saving_) return;
    Mat& g = saving_->aux_scores_grad ? *saving_->aux_scores_grad
                                      : saving_->aux_scores_grad.emplace(Mat::Zero(logits.rows(), num_experts_));
    const double sc = rnd(aux_dt, scale);
    for (Index t = 0; t < logits.rows(); ++t) {
      if (padding_mask && (*padding_mask)[t]) continue;
      // seq_aux_loss views [T, E] as [s, b * E]: token t = s_idx * b + b_idx uses column b_idx * E + e.
      const Index block = cols_per_row_block ? (t % cols_per_row_block) * num_experts_ : 0;
      for (int e = 0; e < num_experts_; ++e) g(t, e) = rnd(aux_dt, g(t, e) + rnd(aux_dt, sc * tokens[block + e]));
    }
  };

  // _apply_aux_loss
  if (const double coeff = get_aux_loss_coeff("aux_loss"); coeff != 0) {
    const TokenCounts c = get_tokens_per_expert_and_token_count(routing_map_for_aux_loss, topk_, with_padding_mask);
    log("load_balancing_loss",
        switch_load_balancing_loss_func(scores_for_aux_loss, c.global_tokens_per_expert, c.total_num_tokens, topk_,
                                        num_experts_, coeff),
        coeff);
    add_grad(c.global_tokens_per_expert, num_experts_ * coeff / (topk_ * c.total_num_tokens * c.total_num_tokens), 0);
  }
  // _apply_seq_aux_loss: [T, E] viewed as [s, b * E], so every sequence counts on its own.
  if (const double coeff = get_aux_loss_coeff("seq_aux_loss"); coeff != 0) {
    const Index cols = bsz * num_experts_;
    const Mat scores = Eigen::Map<const Mat>(scores_for_aux_loss.data(), seq_length, cols);  // [s, b*E]
    const BoolMat routing_map =
        Eigen::Map<const BoolMat>(routing_map_for_aux_loss.data(), seq_length, cols);  // [s, b*E]
    const TokenCounts c =
        get_tokens_per_expert_and_token_count(routing_map, topk_ * static_cast<int>(bsz), with_padding_mask);
    log("seq_load_balancing_loss",
        switch_load_balancing_loss_func(scores, c.global_tokens_per_expert, c.total_num_tokens, topk_, num_experts_,
                                        coeff) /
            static_cast<double>(bsz),
        coeff);
    add_grad(c.global_tokens_per_expert,
             num_experts_ * coeff / (topk_ * c.total_num_tokens * c.total_num_tokens) / static_cast<double>(bsz), bsz);
  }
  // _apply_global_aux_loss: tokens per expert averaged over the forwards since the last reset.
  if (const double coeff = get_aux_loss_coeff("global_aux_loss"); coeff != 0) {
    const TokenCounts c = get_tokens_per_expert_and_token_count(routing_map_for_aux_loss, topk_, with_padding_mask);
    ga_steps += 1;
    std::vector<double> averaged_tokens_per_expert(num_experts_);
    for (int e = 0; e < num_experts_; ++e) {
      global_tokens_per_expert[e] += c.global_tokens_per_expert[e];
      averaged_tokens_per_expert[e] = global_tokens_per_expert[e] / ga_steps;
    }
    log("global_load_balancing_loss",
        switch_load_balancing_loss_func(scores_for_aux_loss, averaged_tokens_per_expert, c.total_num_tokens, topk_,
                                        num_experts_, coeff),
        coeff);
    add_grad(averaged_tokens_per_expert, num_experts_ * coeff / (topk_ * c.total_num_tokens * c.total_num_tokens), 0);
  }
  return scores_for_aux_loss;
}

DType TopKRouter::scores_dtype() const { return config_.megatron.router_scores_fp32 ? DType::F32 : router_dtype_; }

DType TopKRouter::aux_scores_dtype() const {
  return config_.moe_router_score_function == "softmax" || config_.megatron.aux_loss_scores_fp32 ? DType::F32
                                                                                                 : router_dtype_;
}

void TopKRouter::count_score_rounding() const {
  // The score function in fp32 (a reduction over the row for softmax; softplus, then sqrt for
  // sqrtsoftplus), stored in the scores' dtype; the sigmoid path's renormalisation for top-k > 1
  // (sum, + 1e-20, division) and the scaling factor are stores of their own; then the final cast.
  const std::string& fn = config_.moe_router_score_function;
  precision_.count_reduce(num_experts_);
  precision_.count_f32();
  if (fn == "sqrtsoftplus") precision_.count_f32();
  const DType sdt = scores_dtype();
  precision_.count_store(sdt, 1 + (fn != "softmax" && topk_ > 1 ? 3 : 0) +
                                  (config_.moe_router_topk_scaling_factor.value_or(0.0) != 0.0 ? 1 : 0));
  if (sdt != router_dtype_) precision_.count_store(router_dtype_);  // probs.type_as(logits)
}

RouterOutput TopKRouter::routing(const Mat& logits, Index seq_length, Index bsz, const std::vector<bool>* padding_mask,
                                 AuxLosses* aux_losses, const BoolMat* recorded_routing_map) {
  if (logits.rows() != seq_length * bsz || logits.cols() != num_experts_)
    throw ShapeError("TopKRouter.routing: logits [" + std::to_string(logits.rows()) + ", " +
                     std::to_string(logits.cols()) + "], expected [" + std::to_string(seq_length * bsz) + ", " +
                     std::to_string(num_experts_) + "]");
  if (padding_mask && static_cast<Index>(padding_mask->size()) != logits.rows())
    throw ShapeError("TopKRouter.routing: padding_mask has " + std::to_string(padding_mask->size()) +
                     " tokens, logits " + std::to_string(logits.rows()));
  const Rounding rnd = Rounding::of(precision_);

  // apply_z_loss (logged as z_loss / coeff)
  if (config_.moe_z_loss_coeff && training) {
    if (saving_) saving_->z_loss = true;
    const double moe_z_loss_coeff = *config_.moe_z_loss_coeff;  // / tp_cp size (1)
    const DType loss_dt = router_dtype_;
    const double z_loss = rnd(loss_dt, z_loss_func(logits, moe_z_loss_coeff, padding_mask));
    if (aux_losses) (*aux_losses)["z_loss"] += rnd(loss_dt, z_loss / moe_z_loss_coeff);
  }

  RouterOutput r;
  r.logits = logits;
  // A recorded map without capacity dropping is Megatron's top-k choice itself (a golden whose
  // choice flipped on a near tie): it chooses instead of the top-k.
  const BoolMat* selection = config_.moe_expert_capacity_factor ? nullptr : recorded_routing_map;
  std::function<Routing(const BoolMat*)> route;
  RoutingOptions opt = routing_options();
  if (config_.moe_router_load_balancing_type == "sinkhorn") {
    route = [&](const BoolMat* chosen) { return sinkhorn_load_balancing(logits, chosen); };
  } else {
    route = [&](const BoolMat* chosen) {
      opt.selection = chosen;
      return topk_routing_with_score_function(logits, opt, expert_bias ? &*expert_bias : nullptr, router_dtype_, rnd);
    };
  }
  Routing routed = route(selection);
  // With capacity dropping, a recorded (post-drop) map still shows where a token's choice flipped
  // on a (near) tie: route with that choice, then drop (checked below). Not when padding to
  // capacity: the padded map holds pairs no choice made.
  if (config_.moe_expert_capacity_factor && !config_.moe_pad_expert_input_to_capacity && recorded_routing_map &&
      recorded_routing_map->rows() == routed.routing_map.rows() &&
      recorded_routing_map->cols() == routed.routing_map.cols()) {
    const BoolMat chosen = recorded_selection(*recorded_routing_map, routed, topk_);
    if (chosen != routed.routing_map) routed = route(&chosen);
  }
  r.probs = routed.probs;
  r.routing_map = routed.routing_map;
  if (saving_) saving_->selected = r.routing_map;

  // Token dropping under the expert capacity.
  if (config_.moe_expert_capacity_factor) {
    const RouterOutput before_drop = r;
    const Routing dropped =
        apply_router_token_dropping(Routing{r.probs, r.routing_map}, topk_, *config_.moe_expert_capacity_factor,
                                    config_.moe_token_drop_policy, config_.moe_pad_expert_input_to_capacity);
    r.probs = dropped.probs;
    r.routing_map = dropped.routing_map;
    if (recorded_routing_map) use_recorded_routing_map(r, before_drop, *recorded_routing_map);
  }

  // Load-balancing losses (they leave probs unchanged in the forward).
  if (training && is_aux_loss_enabled()) apply_load_balancing_losses(logits, seq_length, bsz, padding_mask, aux_losses);

  if (saving_) saving_->routing_map = r.routing_map;
  // _apply_expert_bias: count the routed non-padding tokens per expert.
  if (expert_bias) {
    for (Index t = 0; t < r.routing_map.rows(); ++t) {
      if (padding_mask && (*padding_mask)[t]) continue;
      for (int e = 0; e < num_experts_; ++e) local_tokens_per_expert[e] += r.routing_map(t, e) ? 1.0 : 0.0;
    }
  }
  return r;
}

RouterOutput TopKRouter::forward(const Mat& input, Index seq_length, Index bsz, const std::vector<bool>* padding_mask,
                                 const Taps& taps, AuxLosses* aux_losses, const BoolMat* recorded_routing_map,
                                 RouterSaved* saved) {
  if (saved) {
    if (const auto why = backward_unsupported()) throw MoEError("TopKRouter has no backward: " + *why);
    *saved = RouterSaved{};
    if (padding_mask) saved->padding_mask = *padding_mask;
  }
  struct Reset {
    RouterSaved*& p;
    ~Reset() { p = nullptr; }
  } reset{saving_};
  saving_ = saved;
  if (config_.moe_router_force_load_balancing)
    throw MoEError("moe_router_force_load_balancing (random benchmark logits) is not supported by the reference");
  const Mat jittered = apply_input_jitter(input);            // [T, h]
  if (config_.moe_input_jitter_eps) precision_.count_act();  // input * noise
  const DType rdt = router_dtype_;
  const Mat gated = gating(jittered);            // [T, E]
  precision_.count_reduce(config_.hidden_size);  // the gating GEMM, stored in the router dtype
  precision_.count_store(rdt);
  const Mat logits = taps.record("logits", gated, {seq_length, bsz, num_experts_}, rdt);
  if (saved) {
    saved->input = jittered;
    saved->logits = logits;
  }
  AuxLosses logged;  // this call's losses, recorded below and added to *aux_losses
  RouterOutput r = routing(logits, seq_length, bsz, padding_mask, &logged, recorded_routing_map);
  if (aux_losses)
    for (const auto& [name, v] : logged) (*aux_losses)[name] += v;
  count_score_rounding();
  // Probabilities move with the logits' absolute error (softmax and sigmoid are 1-Lipschitz).
  double max_logit = 0.0;
  for (Index i = 0; i < logits.size(); ++i) max_logit = std::max(max_logit, std::abs(logits.data()[i]));
  r.probs = taps.record("0", r.probs, {r.probs.rows(), r.probs.cols()}, rdt);
  taps.set_magnitude(1.0 + max_logit);
  if (taps.enabled())
    r.routing_map = to_bool_mat(taps.record("1", to_tensor(r.routing_map)), r.routing_map.rows(), r.routing_map.cols());
  // The losses, computed from the logits above, each with its own rounding points (later tensors
  // do not inherit them), at most in the router dtype: z_loss stores logsumexp, its square, their
  // mean over the tokens, x coeff and the logged / coeff; a load-balancing loss the sum over the
  // tokens, x tokens_per_expert, the sum over the experts, x its scale and / coeff. Megatron logs
  // them into an fp32 tracker tensor (save_to_aux_losses_tracker): one fp32 store more. Their
  // error follows the logits' (softmax and sigmoid are 1-Lipschitz) or, for z_loss, their own size.
  const RoundingCount before_log = rounding_now();
  for (const auto& [name, v] : logged) {
    const bool z = name == "z_loss";
    // The aux losses' stores: in the router dtype or, where coarser, in the aux scores' (fp32 with fp64 logits).
    precision_.count_store(z || rdt != DType::F64 ? rdt : aux_scores_dtype(), z ? 5 : 4);
    precision_.count_reduce(logits.rows() + (z ? 0 : num_experts_));
    precision_.count_f32();
    taps.record_aux(name, Tensor::from_doubles(precision_.fp32_storage_dtype(), {}, {v}));  // rounds: fp32 tracker
    taps.set_magnitude(std::max(1.0 + max_logit, std::abs(v)));
    rounding_set(before_log);
  }
  if (expert_bias)
    taps.record_state("local_tokens_per_expert_after",
                      Tensor::from_doubles(DType::F64, {num_experts_}, local_tokens_per_expert));
  return r;
}

// sinkhorn_load_balancing's backward: the choice is made under no_grad, so only the activation
// carries a gradient: scores = act(logits) * map. top-1: torch.sigmoid in the router dtype, whose
// backward computes g (1 - y) y from its stored output y and stores it in that dtype; top-k > 1:
// softmax(dtype=float32).type_as(logits), the pre-softmax top-k's (topk_routing_backward's).
Mat TopKRouter::sinkhorn_backward(const Mat& logits, const Mat& dscores, const BoolMat& selected) const {
  const Rounding rnd = Rounding::of(precision_);
  const DType rdt = router_dtype_;
  if (topk_ > 1) {
    RoutingOptions opt;
    opt.topk = topk_;
    opt.use_pre_softmax = true;
    opt.score_function = "softmax";
    return topk_routing_backward(logits, dscores, selected, opt, rdt, rnd);
  }
  Mat d(logits.rows(), logits.cols());
  for (Index i = 0; i < logits.size(); ++i) {
    const double y = rnd(rdt, 1.0 / (1.0 + std::exp(-logits.data()[i])));  // the forward's stored sigmoid
    d.data()[i] = selected.data()[i] ? rnd(rdt, dscores.data()[i] * (1.0 - y) * y) : 0.0;  // rounds: sigmoid's grad
  }
  return d;
}

std::optional<std::string> TopKRouter::backward_unsupported() const {
  if (config_.moe_input_jitter_eps) return std::string("moe_input_jitter_eps (the jitter's backward)");
  if (config_.moe_router_force_load_balancing) return std::string("moe_router_force_load_balancing");
  if (config_.calculate_per_token_loss)
    return std::string("calculate_per_token_loss (the losses scaled by the token count)");
  if (config_.add_bias_linear) return std::string("a router bias (add_bias_linear)");
  return std::nullopt;
}

RouterGrads TopKRouter::backward(const Mat& dprobs, const RouterSaved& saved) const {
  if (const auto why = backward_unsupported()) throw MoEError("TopKRouter has no backward: " + *why);
  const Index T = saved.logits.rows();
  if (T == 0 || saved.routing_map.rows() != T || saved.selected.rows() != T)
    throw std::logic_error("TopKRouter::backward: `saved` was not filled by forward(..., saved)");
  if (dprobs.rows() != T || dprobs.cols() != num_experts_)
    throw ShapeError("TopKRouter backward: dprobs is [" + std::to_string(dprobs.rows()) + ", " +
                     std::to_string(dprobs.cols()) + "], probs [" + std::to_string(T) + ", " +
                     std::to_string(num_experts_) + "]");
  const Rounding rnd = Rounding::of(precision_);
  const DType rdt = router_dtype_;
  const std::vector<bool>* padding_mask = saved.padding_mask ? &*saved.padding_mask : nullptr;
  // Token dropping: probs * routing_map; its backward masks the gradient the same way.
  const Mat dkept = dprobs.array() * saved.routing_map.cast<double>().array();
  Mat dlogits;  // [T, E]
  if (config_.moe_router_load_balancing_type == "sinkhorn") {
    dlogits = sinkhorn_backward(saved.logits, dkept, saved.selected);
  } else {
    dlogits = topk_routing_backward(saved.logits, dkept, saved.selected, routing_options(), rdt, rnd);
  }
  count_score_rounding();
  // The losses' gradients, accumulated into the logits' gradient (autograd's sum, in rdt).
  if (saved.aux_scores_grad) {
    const Mat d = aux_scores_backward(saved.logits, *saved.aux_scores_grad, config_.moe_router_score_function,
                                      config_.megatron.aux_loss_scores_fp32, rdt, rnd);
    dlogits = rnd(rdt, Mat(dlogits + d));  // rounds: the accumulated gradient
    precision_.count_reduce(num_experts_);
    precision_.count_store(rdt, 3);
  }
  if (saved.z_loss) {
    const Mat d = z_loss_backward(saved.logits, *config_.moe_z_loss_coeff, padding_mask, rdt, rnd);
    dlogits = rnd(rdt, Mat(dlogits + d));  // rounds: the accumulated gradient
    precision_.count_store(rdt, 4);
  }
  // RouterGatingLinearFunction.backward: mm(grad, weight.to(rdt)).to(input dtype),
  // mm(grad.t(), input.to(rdt)).to(weight dtype).
  RouterGrads g;
  const DType act_dt = precision_.storage_dtype();
  g.input = rnd(act_dt, rnd(rdt, Mat(dlogits * weight)));  // rounds: dgrad GEMM in rdt, to the input dtype
  const Mat dweight = rnd(act_dt, rnd(rdt, Mat(dlogits.transpose() * saved.input)));  // rounds: wgrad GEMM
  const double magnitude = (dlogits.cwiseAbs().transpose() * saved.input.cwiseAbs()).maxCoeff();
  precision_.count_reduce(std::max<Index>(num_experts_, T));
  precision_.count_store(rdt);
  precision_.count_act();
  g.params.push_back({"weight", dweight, {num_experts_, config_.hidden_size}, magnitude});
  return g;
}

}  // namespace twin::reference::moe
