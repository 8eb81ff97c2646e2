/* MoELayer's backward on one rank (reference MoELayer::backward;
 * megatron/core/transformer/moe/moe_layer.py under autograd), from the gradient of its output
 * (mlp_bda's d mlp [T, h]) to the gradient of its input (pre_mlp_layernorm's output) and of its
 * parameters, in the forward's reverse order on the forward's buffers:
 *   combine (unpermute):  each row takes its token's gradient (permute_forward of d out)  [N, h]
 *   experts:              per expert, as one grouped GEMM each: fc2's wgrad and dgrad; the
 *                         per_token_scale's backward (d probability of each row) with the
 *                         activation's (GLU's); fc1's wgrad and dgrad; at ep > 1 the local
 *                         experts between the alltoall dispatcher's duals               [N, h]
 *   dispatch (permute):   each token's rows added in expert order (unpermute_forward); the
 *                         rows' probability gradients to their (token, expert) entries   [T, h], [T, E]
 *   router:               the score function's backward with the losses' gradients
 *                         (router_topk_backward), the gating GEMM's backward in the router
 *                         dtype, cast to the input's and the weight's dtype              [T, h], [E, h]
 *   d input = d dispatch + d router (autograd's sum, stored in T), + the shared experts'
 *   backward from d out (their gate's, their MLP's, the gate GEMM's dgrad added).
 * Rounding points are counted as the reference counts them; the experts' and the shared experts'
 * branches fork from the output's count and join where they meet. The group sizes are the
 * forward's, already on the host; at ep > 1 the dispatcher's split sizes are read back from the
 * forward's gathered counts. */
#pragma once

#include <algorithm>

#include "optimized/activations.cuh"
#include "optimized/attention_backward.cuh"
#include "optimized/layer/attention_half.cuh"
#include "optimized/mlp_backward.cuh"  // grad_sum
#include "optimized/linear.cuh"
#include "optimized/moe/moe_layer.cuh"  // AlltoallChunks, and the ops of the forward

namespace twin::opt::TWIN_BACKEND {

// RouterGatingLinearFunction's backward: d input = (dlogits @ weight.to(rdt)).to(input dtype),
// d weight = (dlogits^T @ input.to(rdt)).to(weight dtype), both GEMMs in the router dtype.
inline void router_gating_backward(const MoEPlan& p, const MoELayerGrads& g, std::int64_t T, cudaStream_t st) {
  const DType dt = p.attn.dt, rdt = p.rdt;
  const int E = p.E, h = p.attn.h;
  const RoundingCount before = rounding_now();
  if (rdt == DType::F64) {
    gating_fp64_backward(static_cast<const double*>(g.dlogits), static_cast<const double*>(p.router_w),
                         static_cast<const double*>(p.x_r), static_cast<double*>(g.d_x_r),
                         static_cast<double*>(g.d_router_w_r), T, E, h, st);
  } else {
    const void* x = rdt == dt ? p.attn.ln2 : p.x_r;  // the gating input in rdt
    linear_backward_dgrad(rdt, g.dlogits, p.router_w, rdt == dt ? g.d_x_router : g.d_x_r, T, h, E, st);
    linear_backward_wgrad(rdt, g.dlogits, x, rdt == dt ? g.router_w : g.d_router_w_r, T, h, E, st);
  }
  if (rdt != dt) {
    cast_forward(rdt, dt, g.d_x_r, g.d_x_router, T * h, st);
    cast_forward(rdt, dt, g.d_router_w_r, g.router_w, std::int64_t(E) * h, st);
  }
  // counts: as the reference: the GEMMs' fp32 reduction (the longer of E and T), stored in rdt,
  // then in the input's (weight's) dtype.
  rounding_set(before);
  rounding_reduce(std::max<std::int64_t>(E, T));
  rounding_store(rdt);
  rounding_store(dt);
}

// TopKRouter's backward from d probs [T, E]: the losses' gradients of the aux scores, the score
// function's backward into d logits, the gating GEMM's.
inline void router_backward(const MoEPlan& p, const MoELayerGrads& g, std::int64_t T, cudaStream_t st) {
  const float* aux_grad = nullptr;
  if (p.aux_kind) {
    const LossArgs la = load_balancing_loss_args(p);
    router_aux_scores_grad(p.rdt, p.aux_map, p.padding, &la, 1, p.score, p.aux_scores_fp32, g.aux_grad, g.aux_scratch,
                           st);
    aux_grad = g.aux_grad;
  }
  RouterBackwardArgs ra;
  ra.tokens = T;
  ra.experts = p.E;
  ra.topk = p.topk;
  ra.score = p.score;
  ra.pre_softmax = p.pre_softmax;
  ra.scaling_factor = p.scaling_factor;
  ra.scores_fp32 = p.scores_fp32;
  ra.aux_scores_fp32 = p.aux_scores_fp32;
  ra.z_loss = p.z_loss;
  ra.z_coeff = moe_z_loss_coeff(p);
  router_topk_backward(p.rdt, p.logits, g.dprobs, p.routing_map, p.drop ? p.map_pre : p.routing_map, aux_grad,
                       p.padding, g.dlogits, ra, st);
  router_gating_backward(p, g, T, st);
}

// SharedExpertMLP's backward from d out [T, h] into g.d_x_shared: the gate's, the MLP's
// (linear_fc2, the activation, linear_fc1), the gate GEMM's. At tp > 1 (sequence parallel) the
// duals of the forward's collectives: d out all-gathered to every token [n, h] for linear_fc2's
// (row parallel) gradients, linear_fc1's (column parallel) input gradient reduce-scattered.
inline void shared_experts_backward(const MoEPlan& p, const MoELayerGrads& g, std::int64_t T, cudaStream_t st) {
  const RankPlan& a = p.attn;
  const DType dt = a.dt;
  const TensorParallel tp = tensor_parallel(a);
  const std::int64_t n = std::int64_t(a.s) * a.b;
  const int h = a.h, f = p.shared_ffn / a.tp, w1 = (p.glu ? 2 : 1) * f;
  const void* d_mlp = g.d_output;
  RoundingCount gate_branch;
  if (p.shared_gate) {
    gate_branch = shared_expert_gate_backward(dt, g.d_output, p.shared_fc2, p.gate_logits, g.d_shared_mlp,
                                              g.d_gate_logits, T, h, st);
    d_mlp = g.d_shared_mlp;
  }
  d_mlp = tp_gather_rows(tp, dt, d_mlp, g.d_shared_full, n, h, st);               // [n, h]
  linear_backward_wgrad(dt, d_mlp, p.shared_act, g.shared_fc2_w, n, f, h, st);    // [h, f]
  linear_backward_dgrad(dt, d_mlp, p.shared_fc2_w, g.d_shared_act, n, f, h, st);  // [n, f]
  bias_activation_backward(dt, p.shared_fc1, nullptr, g.d_shared_act, g.d_shared_fc1, n, f, a.act, p.glu, st);
  linear_backward_wgrad(dt, g.d_shared_fc1, a.sp ? a.ln2_full : a.ln2, g.shared_fc1_w, n, h, w1, st);  // [w1, h]
  void* const d_x = a.tp > 1 ? g.d_x_shared_partial : g.d_x_shared;
  linear_backward_dgrad(dt, g.d_shared_fc1, p.shared_fc1_w, d_x, n, h, w1, st);  // [n, h]
  tp_reduce(tp, dt, d_x, g.d_x_shared, n, h, st);                                // [T, h]
  if (p.shared_gate) {
    rounding_join(gate_branch);
    shared_expert_gate_input_backward(dt, g.d_gate_logits, p.shared_gate_w, g.d_x_shared, T, h, st);
    linear_backward_wgrad(dt, g.d_gate_logits, a.ln2, g.shared_gate_w, T, h, 1, st);  // [1, h]
  }
}

// The routed experts' backward (SequentialMLP's, as grouped GEMMs) over n rows grouped by the plan's
// experts (tpe: host group sizes): from d_out [n, h], the rows' input gradient d_in [n, h] and
// probabilities' d_probs [n], the experts' weight gradients (scaled by wgrad_scale) into g; in
// [n, h] and probs [n] the forward's expert inputs, p.fc1 and p.act_out its activations.
inline void moe_grouped_experts_backward(const MoEPlan& p, const MoELayerGrads& g, const void* in, const void* probs,
                                         const void* d_out, void* d_in, void* d_probs,
                                         const std::vector<std::int64_t>& tpe, std::int64_t n, float wgrad_scale,
                                         cudaStream_t st) {
  const RankPlan& a = p.attn;
  const DType dt = a.dt;
  const std::int64_t h = a.h;
  const int w1 = (p.glu ? 2 : 1) * p.ffn;
  const rt::Backend be = this_backend();
  grouped_linear_backward_wgrad(be, dt, d_out, p.act_out, g.fc2_w, tpe, p.ffn, h, wgrad_scale, st);  // [E, h, ffn]
  grouped_linear_backward_dgrad(be, dt, d_out, p.fc2_w, g.d_act, tpe, p.ffn, h, st);                 // [n, ffn]
  grouped_scaled_activation_backward(dt, p.rdt, p.fc1, probs, g.d_act, g.d_fc1, d_probs, n, p.ffn, a.act, p.glu,
                                     st);                                                    // [n, w1], [n]
  grouped_linear_backward_wgrad(be, dt, g.d_fc1, in, g.fc1_w, tpe, h, w1, wgrad_scale, st);  // [E, w1, h]
  grouped_linear_backward_dgrad(be, dt, g.d_fc1, p.fc1_w, d_in, tpe, h, w1, st);             // [n, h]
}

// An expert's weight-gradient scale: 1 / ep where the expert-parallel ranks hold replicas of one
// batch (DDP's expert_gradient_scaling_factor, 1 / data-parallel size: the gradient of the ranks'
// mean loss), 1 where each holds its own slice of the sequence (ep = tp).
inline float moe_expert_wgrad_scale(const MoEPlan& p) { return p.ep_replicas ? 1.0f / float(p.ep) : 1.0f; }

// The alltoall dispatcher's backward at ep > 1, the duals of moe_alltoall_experts' collectives:
// each row's gradient goes to the rank that computed its expert (the combine's reverse all-to-all),
// is sorted local expert-major, runs the local experts' backward, and comes back with its
// probability's gradient (the dispatch's all-to-all) into this rank's rows in the ep = 1 layout.
// The ranks hold replicas of one batch, so an expert's weight gradient sums every rank's rows; it is
// scaled by 1 / ep, DDP's expert_gradient_scaling_factor (1 / data-parallel size: the gradient of
// the ranks' mean loss, which is the golden's). Communication and the chunk sorts move values
// without rounding.
inline void moe_alltoall_experts_backward(const MoEPlan& p, const MoELayerGrads& g, cudaStream_t st) {
  const DType dt = p.attn.dt, rdt = p.rdt;
  const std::size_t H = std::size_t(p.attn.h), row = H * dtype_size(dt), prob = dtype_size(rdt);
  require(p.ep_comm && g.ep_d_recv && g.ep_d_out && g.ep_d_in && g.ep_d_in_probs && g.ep_d_recv_probs,
          "moe backward: expert parallelism without its group or buffers");
  const AlltoallChunks c(p, st);
  // ---- the combine's dual: each row's gradient to its expert's rank            // [Nl, h]
  p.ep_comm->all_to_all(g.d_rows, c.times(c.in_rows, H), g.ep_d_recv, c.times(c.out_rows, H), dt, st);
  c.sort(g.ep_d_recv, g.ep_d_out, row, true, st);
  // ---- the local experts
  moe_grouped_experts_backward(p, g, p.ep_in, p.ep_in_probs, g.ep_d_out, g.ep_d_in, g.ep_d_in_probs, c.local_tokens,
                               c.Nl, moe_expert_wgrad_scale(p), st);
  // ---- the dispatch's dual: the rows' and probabilities' gradients back      // [N, h], [N]
  c.sort(g.ep_d_in, g.ep_d_recv, row, false, st);
  p.ep_comm->all_to_all(g.ep_d_recv, c.times(c.out_rows, H), g.d_permuted, c.times(c.in_rows, H), dt, st);
  c.sort(g.ep_d_in_probs, g.ep_d_recv_probs, prob, false, st);
  p.ep_comm->all_to_all(g.ep_d_recv_probs, c.out_rows, g.d_permuted_probs, c.in_rows, rdt, st);
}

// The allgather dispatcher's backward at ep > 1, the duals of moe_allgather_experts' collectives,
// into d hidden [T, h] and d probs [T, E]:
//   the reduce-scatter's dual: every rank gathers the output gradients [TG, h];
//   unpermute's: each local expert row takes its gathered token's gradient; the local experts'
//     backward (weight gradients scaled by 1 / ep, as at alltoall);
//   permute's: each gathered token's local rows added in expert order [TG, h] (stored in T);
//   the all-gather's: a reduce-scatter adds the ranks' partials of this rank's tokens (ep - 1
//     additions, rank order, stored in T);
//   the local probabilities' gradients [TG, local_E]: each rank sends rank q the rows of q's tokens
//     (an all-to-all), which puts them in their experts' columns of d probs [T, E].
inline void moe_allgather_experts_backward(const MoEPlan& p, const MoELayerGrads& g, cudaStream_t st) {
  const RankPlan& a = p.attn;
  const DType dt = a.dt, rdt = p.rdt;
  const std::int64_t T = moe_tokens(p), h = a.h, TG = T * p.ep;
  const int E = p.E, El = p.local_E, ep = p.ep;
  require(p.ep_comm && g.ag_d && g.ag_d_local_probs && g.ag_d_probs_recv && g.ep_d_out && g.ep_d_in && g.ep_d_in_probs,
          "moe backward: the allgather dispatcher without its group or buffers");
  std::int64_t Nl = 0;
  for (auto n : p.local_tokens_per_expert) Nl += n;
  // ---- the reduce-scatter's dual; unpermute's                    // [TG, h] -> [Nl, h]
  p.ep_comm->all_gather(g.d_output, g.ag_d, std::size_t(T * h), dt, st);
  permute_forward(dt, rdt, g.ag_d, p.ag_row_id_map, nullptr, g.ep_d_out, nullptr, TG, El, h, Nl, st);
  // ---- the local experts
  moe_grouped_experts_backward(p, g, p.ep_in, p.ep_in_probs, g.ep_d_out, g.ep_d_in, g.ep_d_in_probs,
                               p.local_tokens_per_expert, Nl, moe_expert_wgrad_scale(p), st);
  // ---- permute's dual, then the all-gather's                    // [TG, h] -> [T, h]
  unpermute_forward(dt, g.ep_d_in, p.ag_row_id_map, g.ag_d, TG, El, h, Nl, st);
  rounding_store(dt, std::min(g.most_rows, El));  // counts: a token's local rows summed
  p.ep_comm->reduce_scatter(g.ag_d, g.d_hidden, std::size_t(T * h), dt, st);
  rounding_store(dt, ep - 1);  // counts: the ranks' partials summed
  // ---- the probabilities: [TG, El] here, rank q's tokens to rank q   // [T, E]
  permute_probs_backward(rdt, g.ep_d_in_probs, p.ag_row_id_map, g.ag_d_local_probs, TG, El, st);
  const std::vector<std::size_t> split(std::size_t(ep), std::size_t(T) * El);
  p.ep_comm->all_to_all(g.ag_d_local_probs, split, g.ag_d_probs_recv, split, rdt, st);
  // received [ep (expert rank q), T, El] -> d probs[t, q El + l]
  const std::size_t rs = dtype_size(rdt);
  std::vector<unsigned char> recv(std::size_t(TG * El) * rs), dprobs(std::size_t(T * E) * rs);
  moe_download(recv.data(), g.ag_d_probs_recv, recv.size(), st);
  for (int q = 0; q < ep; ++q)
    for (std::int64_t t = 0; t < T; ++t)
      std::memcpy(&dprobs[std::size_t(t * E + std::int64_t(q) * El) * rs], &recv[std::size_t((q * T + t) * El) * rs],
                  std::size_t(El) * rs);
  rt::Device& dev = rt::device(this_backend());
  dev.copy(g.dprobs, dprobs.data(), dprobs.size(), rt::CopyKind::HostToDevice, st);
  dev.synchronize(st);  // the upload's source is this frame's
}

// MoETransformerLayer's backward at one rank in three phases, the forward's in reverse,
// each callable alone (they run in turn; the rounding count crosses from one to the next in g):
//   postprocess: mlp_bda's (d mlp = dropout's backward of dout; the residual's gradient is dout),
//     the combine's (each row takes its token's gradient) and the shared experts' backward (a
//     branch from d mlp). Fixed shapes, no host synchronisation: captured as a graph.
//   expert compute: the experts' backward, at ep > 1 between the dispatcher's duals; eager (the
//     group sizes are host values; at ep > 1 the split sizes are read back).
//   router: the dispatch's backward, the router's, autograd's sums into d ln2, pre_mlp_layernorm's
//     with the residual's gradient added, then the attention half's. Fixed shapes: a graph.
// With the allgather dispatcher at ep > 1 the combine's and the dispatch's duals are collectives:
// the expert-compute phase runs them (moe_allgather_experts_backward).
inline bool moe_backward_dispatch_in_expert_phase(const MoEPlan& p) { return p.ep > 1 && p.allgather; }

inline std::int64_t moe_routed_rows(const MoEPlan& p) {
  std::int64_t N = 0;
  for (auto n : p.tokens_per_expert) N += n;
  return N;
}

inline void moe_backward_postprocess_impl(const MoEPlan& p, MoEGrads& g, cudaStream_t st) {
  const RankPlan& a = p.attn;
  const RankGrads& ag = g.attn;
  const DType dt = a.dt;
  const std::int64_t T = moe_tokens(p), h = a.h;
  require(g.d_output == ag.d_mlp && g.d_input == ag.d_ln2, "moe backward: MoELayer's gradients are not the layer's");
  require(g.router_w && g.fc1_w && g.fc2_w && g.d_rows && g.d_act && g.d_fc1 && g.d_permuted && g.d_permuted_probs &&
              g.d_hidden && g.dprobs && g.dlogits && g.d_x_router,
          "moe backward: a required gradient buffer is null");
  g.at_input = rounding_now();
  // ---- mlp_bda                                                        // [T, h]
  bias_dropout_add_backward(dt, ag.dout, ag.d_mlp, nullptr, nullptr, T, a.h,
                            DropoutArgs::make(a.hidden_dropout, a.training, a.seed, a.offset_mlp_bda),
                            tensor_parallel(a).element_base(std::int64_t(a.s) * a.b, a.h), nullptr, 0, st);
  g.at_output = rounding_now();
  // ---- the shared experts, a branch from d mlp                        // [T, h]
  if (p.shared_ffn > 0) {
    shared_experts_backward(p, g, T, st);
    g.shared_end = rounding_now();
    rounding_set(g.at_output);
  }
  // ---- the combine's backward: each row takes its token's gradient    // [N, h]
  if (!moe_backward_dispatch_in_expert_phase(p))
    permute_forward(dt, p.rdt, g.d_output, p.row_id_map, nullptr, g.d_rows, nullptr, T, p.E, h, moe_routed_rows(p), st);
}

inline void moe_backward_expert_compute_impl(const MoEPlan& p, MoEGrads& g, cudaStream_t st) {
  if (p.ep == 1)
    moe_grouped_experts_backward(p, g, p.permuted, p.permuted_probs, g.d_rows, g.d_permuted, g.d_permuted_probs,
                                 p.tokens_per_expert, moe_routed_rows(p), 1.0f, st);  // [N, h], [N]
  else if (p.allgather)
    moe_allgather_experts_backward(p, g, st);  // [T, h], [T, E]
  else
    moe_alltoall_experts_backward(p, g, st);  // [N, h], [N]
}

// At tp > 1 the replicated parameters' gradients each rank computed over its tokens, summed over
// the ranks as Megatron's finalize_model_grads all-reduces the sequence-parallel ones
// (pre_mlp_layernorm's, the router's, the shared experts' gate) and its DDP the experts' over the
// expert-data-parallel group (which the tensor-parallel ranks are at expert tensor-parallel size 1).
inline void moe_tp_sum_param_grads(const MoEPlan& p, MoEGrads& g, cudaStream_t st) {
  const RankPlan& a = p.attn;
  if (a.tp == 1) return;
  const std::int64_t h = a.h, E = p.E, w1 = (p.glu ? 2 : 1) * std::int64_t(p.ffn);
  const TensorParallel tp = tensor_parallel(a);
  GradLeaves leaves(rounding_now());
  tp_sum_param_grads(tp, a.dt, {g.attn.ln2_w, g.attn.ln2_b}, h, leaves, st);
  tp_sum_param_grads(tp, a.dt, {g.router_w}, E * h, leaves, st);
  tp_sum_param_grads(tp, a.dt, {g.shared_gate_w}, h, leaves, st);
  if (p.ep == 1) {  // at ep = tp each expert is its owner's alone
    tp_sum_param_grads(tp, a.dt, {g.fc1_w}, E * w1 * h, leaves, st);
    tp_sum_param_grads(tp, a.dt, {g.fc2_w}, E * h * p.ffn, leaves, st);
  }
  leaves.join_all();
}

inline void moe_backward_router_impl(const MoEPlan& p, MoEGrads& g, cudaStream_t st) {
  const RankPlan& a = p.attn;
  const RankGrads& ag = g.attn;
  const DType dt = a.dt, rdt = p.rdt;
  const std::int64_t T = moe_tokens(p), h = a.h;
  // ---- the dispatch's backward: rows to their tokens, probabilities to their entries
  if (!moe_backward_dispatch_in_expert_phase(p)) {
    const std::int64_t N = moe_routed_rows(p);
    unpermute_forward(dt, g.d_permuted, p.row_id_map, g.d_hidden, T, p.E, h, N, st);  // [T, h]
    rounding_store(dt, g.most_rows);  // counts: index_add, one store per row of the token with the most
    permute_probs_backward(rdt, g.d_permuted_probs, p.row_id_map, g.dprobs, T, p.E, st);  // [T, E]
  }
  // ---- the router; d ln2 = the dispatch's + the router's (+ the shared experts')     // [T, h]
  router_backward(p, g, T, st);
  grad_sum(dt, g.d_hidden, g.d_x_router, g.d_input, T * h, st);  // autograd's sum of the two uses
  if (p.shared_ffn > 0) {
    rounding_join(g.shared_end);
    grad_sum(dt, g.d_input, g.d_x_shared, g.d_input, T * h, st);
  }
  // ---- pre_mlp_layernorm, then the residual's gradient added                         // [T, h]
  norm_backward(a.rms, dt, ag.d_ln2, a.h1, ag.dh1, a.ln2_w, ag.ln2_w, ag.ln2_b, NormRows::dense(T, a.h), a.eps,
                a.zero_centered_gamma, ag.workspace, ag.workspace_bytes, st);
  rounding_join(g.at_input);
  grad_sum(dt, ag.dh1, ag.dout, ag.dh1, T * a.h, st);
  attention_half_backward(attention_half_backward_args(a, ag), st);
  moe_tp_sum_param_grads(p, g, st);
}

inline std::size_t moe_rank_backward_workspace_bytes_impl(const MoEPlan& p) {
  const RankGrads none;
  return std::max(norm_backward_workspace_bytes(p.attn.rms, std::int64_t(p.attn.s) * p.attn.b, p.attn.h),
                  attention_half_backward_workspace_bytes(attention_half_backward_args(p.attn, none)));
}

}  // namespace twin::opt::TWIN_BACKEND
