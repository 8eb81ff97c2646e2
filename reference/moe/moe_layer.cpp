#include "reference/moe/moe_layer.h"

#include "core/progress.h"
#include "reference/transformer_config.h"

namespace twin::reference::moe {

void validate_moe_layer_config(const TransformerConfig& c) {
  auto reject = [](const std::string& m) { throw MoEError("MoE config: " + m); };
  if (!c.num_moe_experts) reject("num_moe_experts is not set");
  const int E = *c.num_moe_experts;
  if (c.expert_model_parallel_size != 1)
    reject("expert_model_parallel_size=" + std::to_string(c.expert_model_parallel_size) +
           ": the reference runs one expert-parallel rank holding every expert");
  if (c.moe_token_dispatcher_type != "allgather" && c.moe_token_dispatcher_type != "alltoall")
    reject("moe_token_dispatcher_type '" + c.moe_token_dispatcher_type + "' (allgather | alltoall)");
  const std::string& fn = c.moe_router_score_function;
  if (fn != "softmax" && fn != "sigmoid" && !(c.megatron.sqrtsoftplus && fn == "sqrtsoftplus"))
    reject("moe_router_score_function '" + fn + "' (softmax | sigmoid" +
           (c.megatron.sqrtsoftplus ? " | sqrtsoftplus)" : "; sqrtsoftplus came after Megatron-Core 93ddc247)"));
  if (c.moe_token_drop_policy != "probs" && c.moe_token_drop_policy != "position")
    reject("moe_token_drop_policy '" + c.moe_token_drop_policy + "' (probs | position)");
  const std::string& lb = c.moe_router_load_balancing_type;
  if (lb != "aux_loss" && lb != "seq_aux_loss" && lb != "global_aux_loss" && lb != "sinkhorn" && lb != "none")
    reject("moe_router_load_balancing_type '" + lb + "' (aux_loss | seq_aux_loss | global_aux_loss | sinkhorn | none)");
  if (lb == "sinkhorn" && c.moe_aux_loss_coeff != 0)
    reject("Sinkhorn routing does not support aux loss (moe_aux_loss_coeff=" + std::to_string(c.moe_aux_loss_coeff) +
           ")");
  if (c.moe_grouped_gemm)
    reject("moe_grouped_gemm (GroupedMLP / TEGroupedMLP) is not implemented; the reference is SequentialMLP");
  if (c.moe_latent_size) reject("moe_latent_size needs Transformer Engine's latent projections");
  if (c.moe_apply_probs_on_input && c.moe_router_topk != 1)
    reject("`moe_apply_probs_on_input` only works with `moe_router_topk`=1 (moe_router_topk=" +
           std::to_string(c.moe_router_topk) + ")");
  if (c.moe_shared_expert_intermediate_size && c.add_bias_linear)
    reject(
        "bias is not supported in the shared experts (add_bias_linear=True with moe_shared_expert_intermediate_size)");
  if (c.moe_router_group_topk && *c.moe_router_group_topk != 0 && c.moe_router_num_groups &&
      *c.moe_router_num_groups > 0) {
    // Megatron would pick -inf scores outside the chosen groups (NaN or zero probabilities).
    const int reachable = *c.moe_router_group_topk * (E / *c.moe_router_num_groups);
    if (c.moe_router_topk > reachable)
      reject("moe_router_topk (" + std::to_string(c.moe_router_topk) + ") exceeds the " + std::to_string(reachable) +
             " experts of the moe_router_group_topk (" + std::to_string(*c.moe_router_group_topk) +
             ") selected groups");
  }
}

std::vector<bool> padding_mask_tokens(const Tensor& padding_mask, Index seq_length, Index bsz) {
  if (padding_mask.shape() != Shape{bsz, seq_length})
    throw ShapeError("padding_mask: expected shape [b, s] = " + shape_str({bsz, seq_length}) + ", got " +
                     padding_mask.describe());
  // [b, s] -> [s, b]: token t = s_idx * b + b_idx
  std::vector<bool> tokens(static_cast<std::size_t>(seq_length * bsz));
  for (Index s = 0; s < seq_length; ++s)
    for (Index b = 0; b < bsz; ++b) tokens[s * bsz + b] = padding_mask.at_f64(b * seq_length + s) != 0.0;
  return tokens;
}

namespace {
const TransformerConfig& validated(const TransformerConfig& c) {
  validate_transformer_config(c);
  validate_moe_layer_config(c);
  return c;
}
}  // namespace

MoELayer::MoELayer(const TransformerConfig& config, Precision p, int layer_number)
    : router(validated(config), p),
      token_dispatcher(make_token_dispatcher(config, p)),
      experts(*config.num_moe_experts / config.expert_model_parallel_size, config, p, router.router_dtype()),
      config_(config),
      p_(p),
      layer_number_(layer_number) {
  if (config.moe_shared_expert_intermediate_size) shared_experts.emplace(config, p, config.moe_shared_expert_gate);
}

void MoELayer::load_state_dict(const StateDict& sd, const std::string& prefix) {
  router.load_state_dict(sd, prefix + "router.");
  experts.load_state_dict(sd, prefix + "experts.");
  if (shared_experts) shared_experts->load_state_dict(sd, prefix + "shared_experts.");
}

std::optional<Mat> MoELayer::shared_experts_compute(const Mat& hidden_states, const Shape& lead,
                                                    const Taps& taps) const {
  if (!shared_experts) return std::nullopt;
  SharedExpertSaved* saved = nullptr;
  if (saving_) saved = &saving_->shared_experts.emplace();
  const Mat shared_expert_output = shared_experts->forward(hidden_states, lead, taps.child("shared_experts"), saved);
  Shape shape = lead;
  shape.push_back(shared_expert_output.cols());
  return taps.record("shared_experts", shared_expert_output, shape, p_);
}

RouterOutput MoELayer::route(const Mat& hidden_states, Index seq_length, Index bsz,
                             const std::vector<bool>* padding_mask, const Taps& taps,
                             const BoolMat* recorded_routing_map) {
  return router.forward(hidden_states, seq_length, bsz, padding_mask, taps.child("router"), &aux_losses,
                        recorded_routing_map, saving_ ? &saving_->router : nullptr);
}

DispatchTensors MoELayer::preprocess(const Mat& hidden_states, Index seq_length, Index bsz, const Mat& probs,
                                     const BoolMat& routing_map) {
  return token_dispatcher->dispatch_preprocess(hidden_states, seq_length, bsz, routing_map, probs);
}

DispatchTensors MoELayer::dispatch(DispatchTensors x) { return token_dispatcher->token_dispatch(std::move(x)); }

OutputWithBias MoELayer::routed_experts_compute(DispatchTensors x, const Taps& taps) {
  const double probs_magnitude = x.probs_magnitude;
  ExpertInputs in = token_dispatcher->dispatch_postprocess(std::move(x));
  const Taps experts_taps = taps.child("experts");
  if (taps.enabled()) {  // the experts' inputs (fixtures: tap_in.mlp.experts.*), continued with as the taps return
    const Index n = in.dispatched_input.rows(), h = in.dispatched_input.cols();
    in.dispatched_input =
        to_mat(experts_taps.record_input("dispatched_input", p_.to_tensor(in.dispatched_input, {n, h})), n, h,
               "dispatched_input");
    // Both floating inputs reach the experts: the count goes on with the larger of what each carries.
    const RoundingCount dispatched_input_rounding = rounding_now();
    // The split follows the twin's own counts (from the routing map, itself given in isolation):
    // counts that disagree with the rows of a given dispatched input would make no expert batch.
    experts_taps.record_input("tokens_per_expert",
                              Tensor::from_vector<std::int64_t>(
                                  {static_cast<Index>(in.tokens_per_expert.size())},
                                  std::vector<std::int64_t>(in.tokens_per_expert.begin(), in.tokens_per_expert.end())));
    in.permuted_probs =
        experts_taps
            .record_input("permuted_probs",
                          Tensor::from_doubles(router.router_dtype(), {static_cast<Index>(in.permuted_probs.size())},
                                               in.permuted_probs))
            .to_f64();
    experts_taps.set_magnitude(probs_magnitude);
    rounding_join(dispatched_input_rounding);
  }
  if (saving_) {
    const std::vector<Index>& rows = token_dispatcher->state.reversed_local_input_permutation_mapping;
    if (static_cast<Index>(rows.size()) != in.dispatched_input.rows())
      throw std::logic_error("MoELayer: the dispatcher's permutation maps " + std::to_string(rows.size()) +
                             " rows, the experts get " + std::to_string(in.dispatched_input.rows()));
    saving_->row_tokens = rows;
    saving_->row_experts.clear();
    for (std::size_t e = 0; e < in.tokens_per_expert.size(); ++e)
      saving_->row_experts.insert(saving_->row_experts.end(), static_cast<std::size_t>(in.tokens_per_expert[e]),
                                  static_cast<Index>(e));
  }
  const Mat expert_output = experts.forward(in.dispatched_input, in.tokens_per_expert, in.permuted_probs, experts_taps,
                                            saving_ ? &saving_->experts : nullptr);
  OutputWithBias out;  // mlp_bias is None: expert biases are added inside the experts
  out.output = token_dispatcher->combine_preprocess(expert_output);
  return out;
}

Mat MoELayer::combine(Mat output) {
  Mat combined = token_dispatcher->token_combine(std::move(output));
  p_.count_act(config_.moe_router_topk);  // unpermute: each token's top-k expert outputs summed, one store each
  return combined;
}

Mat MoELayer::postprocess(Mat output, const std::optional<Mat>& shared_expert_output) {
  output = token_dispatcher->combine_postprocess(std::move(output));
  if (shared_expert_output) {
    output += *shared_expert_output;
    p_.act_inplace(output);  // rounds: output + shared_expert_output
    p_.count_act();
  }
  return output;
}

MoERouteOutput MoELayer::forward_route(const Mat& hidden_states, const MlpArgs& args, const Taps& taps) {
  Index seq_length = hidden_states.rows(), bsz = 1;
  if (args.lead.size() == 2) {
    seq_length = args.lead[0];
    bsz = args.lead[1];
  }
  if (seq_length * bsz != hidden_states.rows())
    throw ShapeError("MoELayer: hidden_states has " + std::to_string(hidden_states.rows()) + " rows, lead " +
                     shape_str(args.lead) + " says " + std::to_string(seq_length * bsz));
  if (hidden_states.cols() != config_.hidden_size)
    throw ShapeError("MoELayer: hidden_states last dimension " + std::to_string(hidden_states.cols()) +
                     " != hidden_size " + std::to_string(config_.hidden_size));
  std::optional<std::vector<bool>> padding_mask;
  if (args.padding_mask) padding_mask = padding_mask_tokens(*args.padding_mask, seq_length, bsz);
  router.training = args.training;
  aux_losses.clear();

  MoERouteOutput r;
  r.shared_expert_output = shared_experts_compute(hidden_states, {seq_length, bsz}, taps);
  std::optional<BoolMat> recorded;
  if (args.recorded_routing_map) {
    const Tensor& m = *args.recorded_routing_map;
    if (m.shape() != Shape{seq_length * bsz, *config_.num_moe_experts})
      throw ShapeError("recorded routing map: expected [T, E] = " +
                       shape_str({seq_length * bsz, *config_.num_moe_experts}) + ", got " + m.describe());
    recorded = to_bool_mat(m, m.size(0), m.size(1));
  }
  const RoundingCount hidden_states_rounding = rounding_now();
  const RouterOutput routed = route(hidden_states, seq_length, bsz, padding_mask ? &*padding_mask : nullptr, taps,
                                    recorded ? &*recorded : nullptr);
  // The tokens dispatched are hidden_states, which did not come through the router's taps (a no-op
  // end to end, where the count only grows; in isolation the router's taps reset it).
  rounding_join(hidden_states_rounding);
  r.hidden_states_and_probs = preprocess(hidden_states, seq_length, bsz, routed.probs, routed.routing_map);
  r.hidden_states_and_probs.probs_magnitude = 1.0 + (routed.logits.size() ? routed.logits.cwiseAbs().maxCoeff() : 0.0);
  r.token_dispatcher_attrs = token_dispatcher->state;
  return r;
}

OutputWithBias MoELayer::forward_expert_compute(const DispatchTensors& hidden_states_and_probs,
                                                const DispatcherState& token_dispatcher_attrs, const Taps& taps) {
  token_dispatcher->state = token_dispatcher_attrs;  // restore the attributes (setattr in Megatron)
  DispatchTensors dispatched_input = dispatch(hidden_states_and_probs);
  OutputWithBias out = routed_experts_compute(std::move(dispatched_input), taps);
  out.output = combine(std::move(out.output));
  return out;
}

Mat MoELayer::forward_postprocess(const Mat& output, const std::optional<Mat>& shared_expert_output, const Taps& taps) {
  Mat result = postprocess(output, shared_expert_output);  // [T, h]
  const DispatcherState& st = token_dispatcher->state;
  return taps.record("0", result, {st.seq_length, st.bsz, result.cols()}, p_);
}

OutputWithBias MoELayer::forward(const Mat& hidden_states, const MlpArgs& args, const Taps& taps,
                                 MoELayerSaved* saved) {
  if (saved) {
    if (const auto why = backward_unsupported()) throw MoEError("MoELayer has no backward: " + *why);
    *saved = MoELayerSaved{};
    saved->tokens = hidden_states.rows();
  }
  struct Reset {
    MoELayerSaved*& p;
    ~Reset() { p = nullptr; }
  } reset{saving_};
  saving_ = saved;
  return forward(hidden_states, args, taps);
}

OutputWithBias MoELayer::forward(const Mat& hidden_states, const MlpArgs& args, const Taps& taps) {
  const MoERouteOutput r = forward_route(hidden_states, args, taps);
  const OutputWithBias expert = forward_expert_compute(r.hidden_states_and_probs, r.token_dispatcher_attrs, taps);
  OutputWithBias out;
  out.output = forward_postprocess(expert.output, r.shared_expert_output, taps);
  out.bias = expert.bias;
  return out;
}

std::optional<std::string> MoELayer::backward_unsupported() const {
  if (auto why = router.backward_unsupported()) return why;
  if (config_.moe_apply_probs_on_input) return std::string("moe_apply_probs_on_input");
  if (config_.add_bias_linear) return std::string("expert biases (add_bias_linear)");
  if (config_.bias_activation_fusion) return std::string("bias_activation_fusion (the fused activation's backward)");
  return std::nullopt;
}

MlpGrads MoELayer::backward(const Mat& doutput, MoELayerSaved&& saved) const {
  if (const auto why = backward_unsupported()) throw MoEError("MoELayer has no backward: " + *why);
  const Index T = saved.tokens, h = config_.hidden_size, E = *config_.num_moe_experts;
  if (T <= 0 || saved.router.logits.rows() != T)
    throw std::logic_error("MoELayer::backward: `saved` was not filled by forward(..., saved)");
  if (doutput.rows() != T || doutput.cols() != h)
    throw ShapeError("MoELayer backward: grad_output is [" + std::to_string(doutput.rows()) + ", " +
                     std::to_string(doutput.cols()) + "], the output [" + std::to_string(T) + ", " + std::to_string(h) +
                     "]");
  const Index N = static_cast<Index>(saved.row_tokens.size());
  MlpGrads g;
  auto add = [&g](const std::string& prefix, const ParamGrads& params) {
    for (const ParamGrad& p : params) g.params.push_back({prefix + p.name, p.value, p.shape, p.magnitude});
  };
  const RoundingCount at_output = rounding_now();

  // combine's backward: each dispatched row takes its token's gradient.
  Mat drows(N, h);  // [N, h]
  for (Index i = 0; i < N; ++i) drows.row(i) = doutput.row(saved.row_tokens[i]);
  const SequentialMLPGrads eg = [&] {
    const progress::Step step("experts");
    return experts.backward(drows, std::move(saved.experts));
  }();
  add("experts.", eg.params);

  // dispatch's backward: scatter-add the rows' gradients to their tokens; probabilities to their entries.
  Mat dhidden = Mat::Zero(T, h);  // [T, h]
  Mat dprobs = Mat::Zero(T, E);   // [T, E]
  std::vector<int> rows_of_token(static_cast<std::size_t>(T), 0);
  for (Index i = 0; i < N; ++i) {
    const Index t = saved.row_tokens[i];
    for (Index j = 0; j < h; ++j)
      dhidden(t, j) =
          p_.act(dhidden(t, j) + eg.permuted_local_hidden_states(i, j));  // rounds: index_add, one row at a time
    dprobs(t, saved.row_experts[i]) = eg.permuted_probs[i];
    ++rows_of_token[t];
  }
  int most_rows = 0;
  for (int c : rows_of_token) most_rows = std::max(most_rows, c);
  p_.count_act(most_rows);

  progress::now("router");
  const RouterGrads rg = router.backward(dprobs, saved.router);
  add("router.", rg.params);
  Mat dinput = p_.act(Mat(dhidden + rg.input));  // rounds: autograd's sum of the two uses
  p_.count_act();

  if (shared_experts) {
    const RoundingCount routed_end = rounding_now();
    rounding_set(at_output);  // the shared experts' backward starts from the output's gradient
    const MlpGrads sg = [&] {
      const progress::Step step("shared_experts");
      return shared_experts->backward(doutput, std::move(*saved.shared_experts));
    }();
    add("shared_experts.", sg.params);
    rounding_join(routed_end);
    dinput = p_.act(Mat(dinput + sg.hidden_states));  // rounds: + the shared experts' input gradient
    p_.count_act();
  }
  g.hidden_states = std::move(dinput);
  return g;
}

}  // namespace twin::reference::moe
