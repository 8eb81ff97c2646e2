// TopKRouter, mirroring megatron/core/transformer/moe/router.py (Megatron-LM 93ddc24):
//   forward: apply_input_jitter -> gating (logits) -> routing:
//     apply_z_loss -> topk_routing_with_score_function (or sinkhorn) -> apply_router_token_dropping
//     -> _apply_aux_loss / _apply_seq_aux_loss / _apply_global_aux_loss -> _apply_expert_bias.
// Losses are logged as Megatron's save_to_aux_losses_tracker logs them: loss / coeff.
//
// Backward (from the gradient of the returned probs): the token dropping's multiply by the map,
// the score function's backward (topk_routing_backward), plus the losses' gradients as
// MoEAuxLossAutoScaler injects them: its backward hands each loss the gradient
// main_loss_backward_scale, 1.0 unless set (calculate_per_token_loss, which would scale the loss by
// the token count, is not mirrored: MoEError). So a load-balancing loss adds
// d loss / d scores_for_aux_loss = tokens_per_expert[e] E coeff / (k T^2) (/ b for seq_aux_loss)
// through its scores' backward, and the z-loss its own gradient of the logits; then the gating
// GEMM's backward (RouterGatingLinearFunction: in the router dtype, cast to the input's and the
// weight's dtype). Sinkhorn routing's backward is its activation's (sinkhorn_backward); input
// jitter has no backward here (MoEError).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "core/config.h"
#include "reference/linear.h"
#include "reference/moe/moe_utils.h"
#include "reference/taps.h"

namespace twin::reference::moe {

// The MoE losses of one forward, by the name Megatron logs them under, as loss / coeff.
using AuxLosses = std::map<std::string, double>;

struct RouterOutput {
  Mat logits;           // [T, E] gating output, router dtype
  Mat probs;            // [T, E] routing probabilities (zero off the map), router dtype
  BoolMat routing_map;  // [T, E]
};

// What TopKRouter's backward needs from its forward.
struct RouterSaved {
  Mat input;            // [T, h] the gating input
  Mat logits;           // [T, E]
  BoolMat selected;     // [T, E] the top-k choice, before token dropping
  BoolMat routing_map;  // [T, E] after dropping (the probs are multiplied by it)
  std::optional<std::vector<bool>> padding_mask;
  bool z_loss = false;                 // the z-loss was attached (training with moe_z_loss_coeff)
  std::optional<Mat> aux_scores_grad;  // [T, E] d (sum of the load-balancing losses) / d scores_for_aux_loss
};

struct RouterGrads {
  Mat input;          // [T, h] in the activation dtype
  ParamGrads params;  // "weight"
};

class TopKRouter {
 public:
  TopKRouter(const TransformerConfig& config, Precision precision);

  // state_dict keys under `prefix` ("mlp.router."): weight [E, h], bias [E] (add_bias_linear),
  // expert_bias [E] (moe_router_enable_expert_bias; a zero buffer when absent).
  void load_state_dict(const StateDict& sd, const std::string& prefix);

  // input: [T, h] with T = seq_length * bsz tokens (t = s_idx * bsz + b_idx); padding_mask: [T],
  // True = padding. Records taps "logits" [s, b, E], "0" (probs) and "1" (routing_map), the aux
  // losses this call logged and, with an expert bias, the token counter after the call (state
  // "local_tokens_per_expert_after").
  // recorded_routing_map: Megatron's map from a golden. With capacity dropping, the post-drop map
  // a golden fixes where the drop depends on torch.topk's order among tied values
  // (tie_break_dependent), checked to be a valid outcome, then used; without, the top-k choice
  // itself (k experts per token), taken where the twin's choice flipped on a near tie.
  RouterOutput forward(const Mat& input, Index seq_length, Index bsz, const std::vector<bool>* padding_mask,
                       const Taps& taps, AuxLosses* aux_losses, const BoolMat* recorded_routing_map = nullptr,
                       RouterSaved* saved = nullptr);
  // dprobs [T, E]: the gradient of forward's probs (router dtype).
  RouterGrads backward(const Mat& dprobs, const RouterSaved& saved) const;
  // Why backward cannot run for this config (nullopt: it can).
  std::optional<std::string> backward_unsupported() const;

  Mat apply_input_jitter(const Mat& input);  // [T, h]
  Mat gating(const Mat& input) const;        // [T, h] -> [T, E]
  RouterOutput routing(const Mat& logits, Index seq_length, Index bsz, const std::vector<bool>* padding_mask,
                       AuxLosses* aux_losses, const BoolMat* recorded_routing_map = nullptr);
  double get_aux_loss_coeff(const std::string& aux_loss_type) const;
  bool is_aux_loss_enabled() const;
  DType router_dtype() const { return router_dtype_; }

  // --- state (public so tests and handlers can set and read it)
  bool training = true;
  Mat weight;                                      // [E, h]
  std::optional<RowVec> bias;                      // [E]
  std::optional<std::vector<double>> expert_bias;  // [E] fp32 buffer
  std::vector<double> local_tokens_per_expert;     // [E] expert-bias token counter
  std::vector<double> global_tokens_per_expert;    // [E] global_aux_loss accumulator
  double ga_steps = 0;
  // Input jitter: uniform(1 - eps, 1 + eps) from a counter-based generator keyed by this seed,
  // the call number and the element index, so a run is reproducible.
  std::uint64_t jitter_seed = 0;
  std::uint64_t jitter_calls = 0;

 private:
  // The sinkhorn choice (training: the top-k of sinkhorn(logits); eval: of the activation), or a
  // given one (a golden's: k experts per token), and the activation's probabilities on it.
  Routing sinkhorn_load_balancing(const Mat& logits, const BoolMat* selection = nullptr) const;
  Mat sinkhorn_backward(const Mat& logits, const Mat& dscores, const BoolMat& selected) const;
  RoutingOptions routing_options() const;  // topk_routing_with_score_function's options from the config
  Mat apply_load_balancing_losses(const Mat& logits, Index seq_length, Index bsz, const std::vector<bool>* padding_mask,
                                  AuxLosses* aux_losses);
  void use_recorded_routing_map(RouterOutput& r, const RouterOutput& before_drop, const BoolMat& rec) const;
  // Where the scores are stored until probs' final cast to the router dtype: fp32 since the pin
  // (MegatronSwitches::router_scores_fp32), the router dtype at the pin.
  DType scores_dtype() const;
  // The aux-loss scores' and losses' dtype: fp32 for softmax; the sigmoid path's by
  // MegatronSwitches::aux_loss_scores_fp32.
  DType aux_scores_dtype() const;
  // The rounding points the score function adds to probs or to their gradient.
  void count_score_rounding() const;

  TransformerConfig config_;
  Precision precision_;
  DType router_dtype_;
  RouterSaved* saving_ = nullptr;  // set while forward(..., saved) runs
  int num_experts_;
  int topk_;
};

// Megatron's sinkhorn normalisation (moe_utils.sinkhorn), tol 1e-4.
Mat sinkhorn(const Mat& cost, double tol = 0.0001);

}  // namespace twin::reference::moe
