/* One rank of the MoETransformerLayer forward (reference/moe/moe_transformer_layer.h, moe_layer.h):
 * the dense layer's attention half, then the MoE MLP:
 *   shared experts (linear_fc1, activation, linear_fc2, sigmoid gate)   [T, h]
 *   router: gating GEMM, fused top-k, capacity drop, losses             [T, E]
 *   dispatch: one row-id map, permute tokens and probabilities          [N, h]
 *   experts: grouped fc1, fused bias + activation + probability, grouped fc2
 *   combine: unpermute (per token, expert order), + shared experts, mlp_bda.
 *
 * Design: everything up to the router's outputs and from the combine on is enqueued on one stream
 * with no host synchronisation. The expert compute needs the tokens per expert on the host (the
 * grouped GEMM's group sizes, as Megatron's grouped MLP syncs them): one small download after the
 * row-id map is built. At expert-parallel size ep > 1 every rank runs this sequence on its own
 * tokens and computes its local experts' rows from all ranks, exchanged by Megatron's alltoall
 * dispatcher (moe_alltoall_experts) or allgather dispatcher (moe_allgather_experts). At
 * tensor-parallel size tp > 1 (sequence parallel) each rank runs it on its slice of the tokens
 * (moe_tokens) through every expert, the load-balancing counts all-reduced (moe_tp_column_counts)
 * and the shared experts a tensor-parallel MLP (moe_shared_experts_forward). Rounding points are counted as the
 * reference counts them (the reference MoE sources), so a golden's bound follows from what this twin executed. */
#pragma once

#include <algorithm>
#include <cstring>
#include <string>

#include "core/tensor.h"
#include "optimized/moe/experts.cuh"
#include "optimized/moe/moe_transformer_layer_plan.h"
#include "optimized/moe/router.cuh"
#include "optimized/moe/shared_experts.cuh"
#include "optimized/moe/token_dispatcher.cuh"
#include "optimized/layer/attention_half.cuh"

namespace twin::opt::TWIN_BACKEND {

inline void moe_download(void* host, const void* dev, std::size_t bytes, cudaStream_t st) {
  if (bytes == 0) return;
  rt::Device& d = rt::device(this_backend());
  d.copy(host, dev, bytes, rt::CopyKind::DeviceToHost, st);
  d.synchronize(st);
}

// The tokens T this rank routes: the layer's s * b, or under sequence parallelism its slice's.
inline std::int64_t moe_tokens(const MoEPlan& p) { return std::int64_t(p.attn.s_local()) * p.attn.b; }

// MoETransformerLayer's router phase (_forward_mlp_router): attention, pre_mlp_layernorm, shared
// experts, router, and the dispatch preprocess (the row-id map and the permute). No host
// synchronisation unless a recorded map is checked or the expert-bias counter is updated eagerly
// (p.capturing: the host updates the counter after the graph's replay), so it can be captured.
// The permuted rows N at most, for the cost model: each token to topk experts, or every expert
// filled to its capacity when padded.
inline std::int64_t routed_rows_bound(const MoEPlan& p) {
  const std::int64_t T = moe_tokens(p);
  return p.drop && p.pad_to_capacity ? p.E * expert_capacity(T * p.topk, p.E, p.capacity_factor) : T * p.topk;
}

// With capacity dropping, a golden's post-drop map still shows where a token's top-k choice flipped
// on a (near) tie: the top-k runs again with each token's recorded experts, then its own by
// probability, largest first, up to k (the reference's recorded_selection), before the drop.
inline void moe_recorded_choice(MoEPlan& p, RouterArgs ra, std::int64_t T, cudaStream_t st) {
  if (p.capturing) throw std::invalid_argument("a recorded routing map is checked on the host: not in a graph");
  const int E = p.E;
  std::vector<std::uint8_t> pre(std::size_t(T * E));
  moe_download(pre.data(), p.map_pre, pre.size(), st);
  twin::Tensor probs = twin::Tensor::empty(p.rdt, {T, E});
  moe_download(probs.raw_mut(), p.probs_pre, probs.nbytes(), st);
  const std::vector<double> pv = probs.to_f64();
  std::vector<std::uint8_t> chosen(pre.size());
  for (std::int64_t t = 0; t < T; ++t) {
    std::vector<int> ours;
    int n = 0;
    for (int e = 0; e < E; ++e) {
      chosen[std::size_t(t * E + e)] = p.recorded_map[t * E + e] != 0;
      n += chosen[std::size_t(t * E + e)];
      if (pre[std::size_t(t * E + e)] && !chosen[std::size_t(t * E + e)]) ours.push_back(e);
    }
    if (n > p.topk)
      throw std::invalid_argument("recorded routing map gives token " + std::to_string(t) + " " + std::to_string(n) +
                                  " experts, moe_router_topk is " + std::to_string(p.topk));
    std::stable_sort(ours.begin(), ours.end(),
                     [&](int a, int b) { return pv[std::size_t(t * E + a)] > pv[std::size_t(t * E + b)]; });
    for (std::size_t i = 0; i < ours.size() && n < p.topk; ++i, ++n) chosen[std::size_t(t * E + ours[i])] = 1;
  }
  if (chosen == pre) return;
  rt::device(this_backend()).copy(p.map_pre, chosen.data(), chosen.size(), rt::CopyKind::HostToDevice, st);
  ra.selection = p.map_pre;  // read per token before its map is written (the kernel's rule)
  router_topk_forward(p.rdt, p.logits, p.expert_bias, p.padding, p.probs_pre, p.map_pre, p.aux_scores, p.aux_map, p.z,
                      ra, st);
}

// apply_router_token_dropping: each expert keeps at most its capacity of tokens; a golden's
// recorded post-drop map, checked to be an outcome the capacity rule allows, replaces the twin's.
inline void moe_capacity_drop(MoEPlan& p, std::int64_t T, cudaStream_t st) {
  const int E = p.E;
  const DType rdt = p.rdt;
  const std::int64_t capacity = expert_capacity(T * p.topk, E, p.capacity_factor);
  router_capacity_forward(rdt, p.probs_pre, p.map_pre, p.probs, p.routing_map, T, E, capacity,
                          p.drop_by_probs ? "probs" : "position", p.pad_to_capacity, st);
  if (p.recorded_map) {
    if (p.capturing) throw std::invalid_argument("a recorded routing map is checked on the host: not in a graph");
    // A golden's post-drop map (torch.topk's order among ties): a valid outcome keeps each
    // expert's count and, unless padding, only pairs the top-k chose; then it is the map.
    std::vector<std::uint8_t> pre(std::size_t(T * E)), post(std::size_t(T * E));
    moe_download(pre.data(), p.map_pre, pre.size(), st);
    moe_download(post.data(), p.routing_map, post.size(), st);
    for (int e = 0; e < E; ++e) {
      std::int64_t rec = 0, mine = 0;
      for (std::int64_t t = 0; t < T; ++t) {
        rec += p.recorded_map[t * E + e] != 0;
        mine += post[std::size_t(t * E + e)];
        if (!p.pad_to_capacity && p.recorded_map[t * E + e] && !pre[std::size_t(t * E + e)])
          throw std::invalid_argument("recorded routing map routes token " + std::to_string(t) + " to expert " +
                                      std::to_string(e) + ", which its top-k did not choose");
      }
      if (rec != mine)
        throw std::invalid_argument("recorded routing map gives expert " + std::to_string(e) + " " +
                                    std::to_string(rec) + " tokens, the capacity rule gives " + std::to_string(mine));
    }
    rt::device(this_backend()).copy(p.routing_map, p.recorded_map, std::size_t(T * E), rt::CopyKind::HostToDevice, st);
    // probs = probs before the drop, masked by the recorded map: the pad path (pad_to_capacity
    // false, capacity >= T) of the capacity kernel with the recorded map as its input map.
    router_capacity_forward(rdt, p.probs_pre, p.routing_map, p.probs, p.routing_map, T, E, T + 1, "probs", false, st);
  }
}

// The z-loss's coefficient on this rank: Megatron's apply_z_loss divides it by the tensor (and
// context) parallel size, each rank's loss the mean over its own tokens.
inline double moe_z_loss_coeff(const MoEPlan& p) { return p.z_coeff / p.attn.tp; }

// The plan's load-balancing loss (p.aux_kind set) as the loss kernels take it, forward and backward.
inline LossArgs load_balancing_loss_args(const MoEPlan& p) {
  LossArgs la;
  la.kind = *p.aux_kind;
  la.tokens = moe_tokens(p);
  la.experts = p.E;
  la.bsz = p.attn.b;
  la.topk = p.topk;
  la.with_padding_mask = p.padding != nullptr;
  la.coeff = p.aux_coeff;
  la.global_tokens = p.global_tokens;
  la.ga_steps = p.ga_steps;
  la.loss_dtype = 0;  // the losses are fp32 tensors
  la.tp = p.attn.tp;
  la.tp_counts = p.attn.tp > 1 ? p.tp_counts : nullptr;
  return la;
}

// The load-balancing loss's column counts over the tensor-parallel ranks (tp > 1): this rank's,
// all-reduced (exact: integers in fp64), which the loss kernels then read (LossArgs::tp_counts).
inline void moe_tp_column_counts(const MoEPlan& p, cudaStream_t st) {
  const LossArgs la = load_balancing_loss_args(p);
  const int cols = la.kind == AuxLossKind::SeqAuxLoss ? la.bsz * la.experts : la.experts;
  router_map_column_counts(p.aux_map, p.padding, la, p.tp_counts, st);
  p.attn.comm->all_reduce(p.tp_counts, p.tp_counts, std::size_t(cols), DType::F64, st);
}

// SharedExpertMLP: a tensor-parallel MLP on the rank's tokens (with SP all-gathered: ln2_full),
// linear_fc1 column parallel (this rank's shared_ffn / tp columns of both GLU halves), linear_fc2
// row parallel (its partial summed over the ranks, reduce-scattered to the rank's tokens under
// SP), then the gate on the rank's own tokens.                            // [T, h]
inline void moe_shared_experts_forward(MoEPlan& p, cudaStream_t st) {
  const RankPlan& a = p.attn;
  const DType dt = a.dt;
  const std::int64_t n = std::int64_t(a.s) * a.b, T = moe_tokens(p), h = a.h;
  const int f = p.shared_ffn / a.tp;
  const std::int64_t w1 = (p.glu ? 2 : 1) * std::int64_t(f);
  auto tap = [&](MoETapPoint t) {
    if (p.on_tap) p.on_tap(t);
  };
  linear_forward(dt, a.sp ? a.ln2_full : a.ln2, p.shared_fc1_w, nullptr, p.shared_fc1, n, h, w1, st);  // [n, w1]
  tap(MoETapPoint::SharedFc1);
  bias_activation_forward(dt, p.shared_fc1, nullptr, p.shared_act, n, f, a.act, p.glu, st);  // [n, f]
  linear_forward(dt, p.shared_act, p.shared_fc2_w, nullptr, a.tp > 1 ? p.shared_fc2_partial : p.shared_fc2, n, f, h,
                 st);                                                               // [n, h]
  tp_reduce(tensor_parallel(a), dt, p.shared_fc2_partial, p.shared_fc2, n, h, st);  // [T, h]
  tap(MoETapPoint::SharedFc2);
  if (p.shared_gate) {
    linear_uncounted(dt, a.ln2, p.shared_gate_w, nullptr, p.gate_logits, T, h, 1, st);  // [T, 1]
    shared_expert_gate_forward(dt, p.shared_fc2, p.gate_logits, p.shared_out, T, int(h), st);
  }
  tap(MoETapPoint::SharedExperts);
}

inline void moe_router_phase_impl(MoEPlan& p, cudaStream_t st) {
  attention_forward_impl(p.attn, st);
  const RankPlan& a = p.attn;
  const DType dt = a.dt, rdt = p.rdt;
  const std::int64_t T = moe_tokens(p), h = a.h;
  const int E = p.E;
  auto tap = [&](MoETapPoint t) {
    if (p.on_tap) p.on_tap(t);
  };
  const void* x = a.ln2;  // [T, h] pre_mlp_layernorm output (this rank's tokens)

  // ---- shared experts                                              // [T, h]
  if (p.shared_ffn > 0) moe_shared_experts_forward(p, st);
  const RoundingCount hidden_states_rounding = rounding_now();

  // ---- router: gating in the router dtype                          // [T, E]
  if (rdt == DType::F64) {
    cast_forward(dt, DType::F64, x, p.x_r, T * h, st);
    gating_fp64(static_cast<const double*>(p.x_r), static_cast<const double*>(p.router_w),
                static_cast<const double*>(p.router_b), static_cast<double*>(p.logits), T, E, int(h), st);
  } else {
    if (p.cast_input) cast_forward(dt, rdt, x, p.x_r, T * h, st);
    linear_uncounted(rdt, p.cast_input ? p.x_r : x, p.router_w, p.router_b, p.logits, T, h, E, st);
  }
  rounding_reduce(h);  // counts: the gating GEMM, stored in the router dtype
  rounding_store(rdt);
  tap(MoETapPoint::RouterLogits);

  // ---- fused score function + top-k (+ the losses' per-token parts)
  RouterArgs ra;
  ra.tokens = T;
  ra.experts = E;
  ra.topk = p.topk;
  ra.score = p.score;
  ra.pre_softmax = p.pre_softmax;
  ra.num_groups = p.num_groups;
  ra.group_topk = p.group_topk;
  ra.scaling_factor = p.scaling_factor;
  ra.scores_fp32 = p.scores_fp32;
  ra.aux_scores = p.aux_kind.has_value();
  ra.aux_scores_fp32 = p.aux_scores_fp32;
  ra.z_loss = p.z_loss;
  if (p.recorded_map && !p.drop) {
    // Without capacity dropping a golden's map is Megatron's top-k choice itself (its choice flipped
    // on a near tie): k experts per token, read by the top-k kernel from the routing map buffer.
    if (p.capturing) throw std::invalid_argument("a recorded routing map is checked on the host: not in a graph");
    for (std::int64_t t = 0; t < T; ++t) {
      int n = 0;
      for (int e = 0; e < E; ++e) n += p.recorded_map[t * E + e] != 0;
      if (n != p.topk)
        throw std::invalid_argument("recorded routing map gives token " + std::to_string(t) + " " + std::to_string(n) +
                                    " experts, moe_router_topk is " + std::to_string(p.topk));
    }
    rt::device(this_backend()).copy(p.routing_map, p.recorded_map, std::size_t(T * E), rt::CopyKind::HostToDevice, st);
    ra.selection = p.routing_map;
  }
  router_topk_forward(rdt, p.logits, p.expert_bias, p.padding, p.drop ? p.probs_pre : p.probs,
                      p.drop ? p.map_pre : p.routing_map, p.aux_scores, p.aux_map, p.z, ra, st);
  if (p.recorded_map && p.drop && !p.pad_to_capacity) moe_recorded_choice(p, ra, T, st);  // padded: no top-k's
  if (p.z_loss) {
    LossArgs la;
    la.kind = AuxLossKind::ZLoss;
    la.tokens = T;
    la.experts = E;
    la.coeff = moe_z_loss_coeff(p);
    la.loss_dtype = loss_dtype_code(rdt);
    router_loss_forward(p.aux_scores, p.aux_map, p.z, p.padding, la, p.loss_scratch, p.losses + 1, st);
  }
  if (p.drop) moe_capacity_drop(p, T, st);
  if (p.aux_kind && a.tp > 1) moe_tp_column_counts(p, st);
  if (p.aux_kind)
    router_loss_forward(p.aux_scores, p.aux_map, p.z, p.padding, load_balancing_loss_args(p), p.loss_scratch, p.losses,
                        st);
  // counts: the score function in fp32 (sqrtsoftplus: softplus, then sqrt) held in the scores'
  // dtype; the sigmoid path's renormalisation (sum, + 1e-20, division); the scaling factor; the
  // cast to the router dtype when the scores were held in fp32.
  const DType sdt = p.scores_fp32 ? DType::F32 : rdt;
  rounding_reduce(E);
  rounding_store(DType::F32, p.score == ScoreFunction::SqrtSoftplus ? 2 : 1);
  rounding_store(sdt,
                 1 + (p.score != ScoreFunction::Softmax && p.topk > 1 ? 3 : 0) + (p.scaling_factor != 0.0f ? 1 : 0));
  if (sdt != rdt) rounding_store(rdt);
  if (p.local_tokens && !p.capturing) {  // _apply_expert_bias: count the routed non-padding tokens per expert
    std::vector<std::uint8_t> map(std::size_t(T * E));
    moe_download(map.data(), p.routing_map, map.size(), st);
    for (std::int64_t t = 0; t < T; ++t) {
      if (p.padding_host && (*p.padding_host)[std::size_t(t)]) continue;
      for (int e = 0; e < E; ++e) (*p.local_tokens)[std::size_t(e)] += map[std::size_t(t * E + e)];
    }
  }
  tap(MoETapPoint::RouterProbs);
  rounding_join(hidden_states_rounding);

  // ---- dispatch: the row-id map, built once; permute tokens and probabilities   // [N, h]
  build_row_id_map(p.routing_map, T, E, p.tokens_per_expert_dev, p.offsets, p.row_id_map, st);
  permute_forward(dt, rdt, x, p.row_id_map, p.probs, p.permuted, p.permuted_probs, T, E, h, routed_rows_bound(p), st);
}

// experts: grouped fc1, fused bias + activation + probability, grouped fc2, over the rows `in`
// grouped by the experts whose weights the plan holds (tokens_per_expert: host group sizes,
// offsets: their exclusive prefix on the device, n rows) into `out`.
inline void moe_grouped_experts(MoEPlan& p, const void* in, const void* probs, void* out,
                                const std::vector<std::int64_t>& tokens_per_expert, const std::int64_t* offsets,
                                int experts, std::int64_t n, cudaStream_t st) {
  const RankPlan& a = p.attn;
  const DType dt = a.dt, rdt = p.rdt;
  const std::int64_t h = a.h;
  const int w1 = (p.glu ? 2 : 1) * p.ffn;
  grouped_linear_forward(this_backend(), dt, in, p.fc1_w, p.fc1, tokens_per_expert, h, w1, st);  // [n, w1]
  if (p.ep == 1 && p.on_tap) p.on_tap(MoETapPoint::ExpertsFc1);  // at ep > 1 each expert's rows are its owner's
  grouped_bias_activation_forward(dt, rdt, p.fc1, p.fc1_b, probs, p.act_out, offsets, experts, n, p.ffn, a.act, p.glu,
                                  st);                                                                   // [n, ffn]
  grouped_linear_forward(this_backend(), dt, p.act_out, p.fc2_w, out, tokens_per_expert, p.ffn, h, st);  // [n, h]
  if (p.ep == 1 && p.on_tap) p.on_tap(MoETapPoint::ExpertsFc2);
  if (p.fc2_b) grouped_scaled_bias_add_forward(dt, rdt, out, p.fc2_b, probs, offsets, experts, n, int(h), st);
}

// The alltoall dispatcher's row bookkeeping at this rank, from every rank's tokens per expert
// [ep, E] (p.ep_counts, gathered by the forward's preprocess): chunk (q, l) is the rows rank q
// sends for this rank's local expert l, at its source rank-major offset (as received) and at its
// local expert-major one (as the local experts read them).
struct AlltoallChunks {
  int ep = 1, El = 0;
  std::vector<std::int64_t> counts;                // [ep, E]
  std::vector<std::int64_t> local_tokens;          // [El] rows this rank's experts compute
  std::vector<std::size_t> in_rows, out_rows;      // [ep] rows this rank sends to / receives from rank q
  std::vector<std::int64_t> by_source, by_expert;  // [ep * El] chunk offsets
  std::vector<std::int64_t> offsets;               // [El + 1] exclusive prefix of local_tokens
  std::int64_t Nl = 0;                             // rows received
  std::int64_t n(int q, int l) const { return rows_[std::size_t(q) * El + l]; }

  AlltoallChunks(const MoEPlan& p, cudaStream_t st) : ep(p.ep), El(p.local_E), counts(std::size_t(p.ep) * p.E) {
    const int E = p.E, me = p.ep_rank;
    moe_download(counts.data(), p.ep_counts, counts.size() * sizeof(std::int64_t), st);
    rows_.resize(std::size_t(ep) * El);
    for (int q = 0; q < ep; ++q)
      for (int l = 0; l < El; ++l)
        rows_[std::size_t(q) * El + l] = counts[std::size_t(q) * E + std::size_t(me) * El + l];
    in_rows.assign(std::size_t(ep), 0);
    out_rows.assign(std::size_t(ep), 0);
    for (int q = 0; q < ep; ++q)
      for (int l = 0; l < El; ++l) {
        in_rows[std::size_t(q)] += std::size_t(p.tokens_per_expert[std::size_t(q) * El + l]);
        out_rows[std::size_t(q)] += std::size_t(n(q, l));
      }
    by_source.assign(std::size_t(ep) * El, 0);
    by_expert.assign(std::size_t(ep) * El, 0);
    local_tokens.assign(std::size_t(El), 0);
    std::int64_t off = 0;
    for (int q = 0; q < ep; ++q)
      for (int l = 0; l < El; ++l) {
        by_source[std::size_t(q) * El + l] = off;
        off += n(q, l);
        local_tokens[std::size_t(l)] += n(q, l);
      }
    Nl = off;
    offsets.assign(std::size_t(El) + 1, 0);
    off = 0;
    for (int l = 0; l < El; ++l) {
      offsets[std::size_t(l)] = off;
      for (int q = 0; q < ep; ++q) {
        by_expert[std::size_t(q) * El + l] = off;
        off += n(q, l);
      }
    }
    offsets[std::size_t(El)] = off;
  }
  // Split sizes in elements of `width` per row.
  static std::vector<std::size_t> times(std::vector<std::size_t> v, std::size_t width) {
    for (auto& x : v) x *= width;
    return v;
  }
  // sort_chunks_by_idxs: moves each chunk of src to dst, source rank-major -> local expert-major
  // (to_expert_major) or back.
  void sort(const void* src, void* dst, std::size_t bytes_per_row, bool to_expert_major, cudaStream_t st) const {
    rt::Device& dev = rt::device(this_backend());
    for (std::size_t c = 0; c < by_source.size(); ++c) {
      const std::size_t rows = std::size_t(rows_[c]);
      if (!rows) continue;
      const std::size_t from = std::size_t(to_expert_major ? by_source[c] : by_expert[c]);
      const std::size_t to = std::size_t(to_expert_major ? by_expert[c] : by_source[c]);
      dev.copy(static_cast<char*>(dst) + to * bytes_per_row, static_cast<const char*>(src) + from * bytes_per_row,
               rows * bytes_per_row, rt::CopyKind::DeviceToDevice, st);
    }
  }

 private:
  std::vector<std::int64_t> rows_;  // [ep * El] n(q, l)
};

// Megatron's MoEAlltoAllTokenDispatcher at expert-parallel size ep (the ranks replicas of one
// batch, or at ep = tp each with its slice of the sequence), around the local
// experts. p.permuted holds this rank's tokens permuted over ALL E experts (expert-major, the
// ep = 1 layout), so the rows for rank q's experts are one contiguous part:
//   preprocess: the ranks all-gather their tokens per expert [ep, E]; input_splits[q] = this
//     rank's rows for q's experts, output_splits[q] = rank q's rows for this rank's experts;
//   dispatch: all-to-all of the rows and their probabilities, then sort_chunks_by_idxs: the
//     received chunks (source rank-major, then local expert) reordered local expert-major, so each
//     local expert's rows are contiguous (source rank 0 first, then 1, ...);
//   the local experts as grouped GEMMs;
//   combine: the chunks sorted back (source rank-major), the reverse all-to-all into p.expert_out,
//     this rank's rows in its own permuted order, where the ep = 1 combine (unpermute) reads them.
// Communication and the chunk sorts move values without rounding, and each row meets exactly the
// ep = 1 arithmetic (its expert's weights, its probability), so the rounding points are the
// ep = 1 ones. The counts cross to the host once (the grouped GEMM's group sizes, as at ep = 1).
inline void moe_alltoall_experts(MoEPlan& p, cudaStream_t st) {
  const RankPlan& a = p.attn;
  const DType dt = a.dt, rdt = p.rdt;
  const std::int64_t h = a.h;
  const int E = p.E, ep = p.ep, El = p.local_E, me = p.ep_rank;
  require(p.ep_comm && p.ep_comm->size() == ep && p.ep_comm->rank() == me && El * ep == E,
          "moe alltoall dispatcher: the plan's expert-parallel group does not match ep = " + std::to_string(ep));
  // ---- preprocess: every rank's tokens per expert                  // [ep, E]
  p.ep_comm->all_gather(p.tokens_per_expert_dev, p.ep_counts, std::size_t(E), DType::I64, st);
  const AlltoallChunks c(p, st);
  p.local_tokens_per_expert = c.local_tokens;
  p.ep_offsets_host = c.offsets;
  // ---- dispatch: rows and probabilities to the ranks that hold their experts
  const std::size_t H = std::size_t(h);
  p.ep_comm->all_to_all(p.permuted, c.times(c.in_rows, H), p.ep_recv, c.times(c.out_rows, H), dt, st);
  p.ep_comm->all_to_all(p.permuted_probs, c.in_rows, p.ep_recv_probs, c.out_rows, rdt, st);
  const std::size_t row = H * dtype_size(dt), prob = dtype_size(rdt);
  c.sort(p.ep_recv, p.ep_in, row, true, st);               // [Nl, h]
  c.sort(p.ep_recv_probs, p.ep_in_probs, prob, true, st);  // [Nl]
  rt::device(this_backend())
      .copy(p.ep_offsets, p.ep_offsets_host.data(), p.ep_offsets_host.size() * sizeof(std::int64_t),
            rt::CopyKind::HostToDevice, st);

  // ---- the local experts                                           // [Nl, h]
  moe_grouped_experts(p, p.ep_in, p.ep_in_probs, p.ep_out, p.local_tokens_per_expert, p.ep_offsets, El, c.Nl, st);

  // ---- combine: back to source rank-major, the reverse all-to-all  // [N, h]
  c.sort(p.ep_out, p.ep_recv, row, false, st);
  p.ep_comm->all_to_all(p.ep_recv, c.times(c.out_rows, H), p.expert_out, c.times(c.in_rows, H), dt, st);
}

// The allgather dispatcher's expert rows for the taps: each rank that records taps (rank 0 where
// the ranks hold replicas of one batch, every rank at ep = tp) receives its own tokens' rows of
// every expert, expert-major (the ep = 1 layout, p.expert_out). A local expert's rows are in
// gathered-token order, so rank q's tokens' rows of it are one contiguous chunk.
inline void moe_allgather_expert_taps(MoEPlan& p, cudaStream_t st) {
  const std::int64_t T = moe_tokens(p), h = p.attn.h;
  const int ep = p.ep, El = p.local_E, me = p.ep_rank;
  const std::size_t es = dtype_size(p.attn.dt);
  rt::Device& dev = rt::device(this_backend());
  std::vector<std::size_t> send(std::size_t(ep), 0), recv(std::size_t(ep), 0);
  std::int64_t packed = 0;
  for (int q = 0; q < (p.ep_replicas ? 1 : ep); ++q) {  // the receiving ranks
    std::int64_t first = 0;                             // local expert l's first row
    for (int l = 0; l < El; ++l) {
      std::int64_t before = 0, nq = 0;  // rows of tokens before rank q's, of rank q's
      for (std::int64_t t = 0; t < (q + 1) * T; ++t)
        (t < q * T ? before : nq) += p.ag_local_map_host[std::size_t(t * El + l)];
      if (nq)
        dev.copy(static_cast<char*>(p.ep_recv) + std::size_t(packed * h) * es,
                 static_cast<const char*>(p.ep_out) + std::size_t((first + before) * h) * es, std::size_t(nq * h) * es,
                 rt::CopyKind::DeviceToDevice, st);
      packed += nq;
      send[std::size_t(q)] += std::size_t(nq * h);
      first += p.local_tokens_per_expert[std::size_t(l)];
    }
  }
  if (!p.ep_replicas || me == 0)
    for (int q = 0; q < ep; ++q)
      for (int l = 0; l < El; ++l)
        recv[std::size_t(q)] += std::size_t(p.tokens_per_expert[std::size_t(q * El + l)] * h);
  p.ep_comm->all_to_all(p.ep_recv, send, p.expert_out, recv, p.attn.dt, st);
}

// Megatron's MoEAllGatherTokenDispatcher at expert-parallel size ep (the ranks replicas of one
// batch, or at ep = tp each with its slice of the sequence): every rank gathers
// the ranks' tokens, routing maps and probabilities (TG = ep * T tokens, rank q's at
// [q T, (q + 1) T)); local_map / local_probs are their local experts' columns; the local experts
// run on the tokens permuted by local_map (build_row_id_map over [TG, local_E]); unpermute gives
// the local experts' partial output of every gathered token [TG, h] (each token's local rows added
// in expert order, stored in T, as at ep = 1); the reduce-scatter, in the probabilities' dtype as
// Megatron's token_combine casts it, adds the ranks' partials of this rank's tokens into the
// combine's output [T, h]. Its rounding points (the partial sums, the ep - 1 additions, the casts)
// are counted in the postprocess, where the ep = 1 combine counts its own. With
// gather_expert_taps each recording rank gets its own tokens' rows of every expert
// (moe_allgather_expert_taps): the ep = 1 experts' output (p.expert_out) the taps read.
inline void moe_allgather_experts(MoEPlan& p, cudaStream_t st) {
  const RankPlan& a = p.attn;
  const DType dt = a.dt, rdt = p.rdt;
  const std::int64_t T = moe_tokens(p), h = a.h;
  const int E = p.E, ep = p.ep, El = p.local_E, me = p.ep_rank;
  const std::int64_t TG = T * ep;
  require(p.ep_comm && p.ep_comm->size() == ep && p.ep_comm->rank() == me && El * ep == E,
          "moe allgather dispatcher: the plan's expert-parallel group does not match ep = " + std::to_string(ep));
  const std::size_t es = dtype_size(dt), rs = dtype_size(rdt);
  // ---- token_dispatch: gather the tokens, the routing maps, the probabilities   // [TG, ...]
  p.ep_comm->all_gather(a.ln2, p.ag_x, std::size_t(T * h), dt, st);
  p.ep_comm->all_gather(p.routing_map, p.ag_map, std::size_t(T * E), DType::BOOL, st);
  p.ep_comm->all_gather(p.probs, p.ag_probs, std::size_t(T * E), rdt, st);
  // ---- dispatch_postprocess: the local experts' columns (on the host: this phase syncs anyway)
  std::vector<std::uint8_t> map(std::size_t(TG * E));
  std::vector<unsigned char> probs(std::size_t(TG * E) * rs);
  moe_download(map.data(), p.ag_map, map.size(), st);
  moe_download(probs.data(), p.ag_probs, probs.size(), st);
  p.ag_local_map_host.resize(std::size_t(TG * El));
  p.ag_local_probs_host.resize(std::size_t(TG * El) * rs);
  for (std::int64_t t = 0; t < TG; ++t) {
    const std::size_t src = std::size_t(t * E + std::int64_t(me) * El), dst = std::size_t(t * El);
    std::memcpy(&p.ag_local_map_host[dst], &map[src], std::size_t(El));
    std::memcpy(&p.ag_local_probs_host[dst * rs], &probs[src * rs], std::size_t(El) * rs);
  }
  rt::Device& dev = rt::device(this_backend());
  dev.copy(p.ag_local_map, p.ag_local_map_host.data(), p.ag_local_map_host.size(), rt::CopyKind::HostToDevice, st);
  dev.copy(p.ag_local_probs, p.ag_local_probs_host.data(), p.ag_local_probs_host.size(), rt::CopyKind::HostToDevice,
           st);
  build_row_id_map(p.ag_local_map, TG, El, p.ag_tokens_per_expert, p.ep_offsets, p.ag_row_id_map, st);
  p.local_tokens_per_expert.assign(std::size_t(El), 0);
  moe_download(p.local_tokens_per_expert.data(), p.ag_tokens_per_expert, std::size_t(El) * sizeof(std::int64_t), st);
  std::int64_t Nl = 0;
  for (auto n : p.local_tokens_per_expert) Nl += n;
  permute_forward(dt, rdt, p.ag_x, p.ag_row_id_map, p.ag_local_probs, p.ep_in, p.ep_in_probs, TG, El, h, Nl, st);

  // ---- the local experts                                           // [Nl, h]
  moe_grouped_experts(p, p.ep_in, p.ep_in_probs, p.ep_out, p.local_tokens_per_expert, p.ep_offsets, El, Nl, st);

  if (p.gather_expert_taps) moe_allgather_expert_taps(p, st);

  // ---- combine_preprocess: unpermute; token_combine: reduce-scatter in the probabilities' dtype
  unpermute_forward(dt, p.ep_out, p.ag_row_id_map, p.ag_partial, TG, El, h, Nl, st);  // [TG, h]
  void* out = p.shared_ffn > 0 ? p.combined : p.mlp_out;                              // [T, h]
  if (rdt == dt) {
    p.ep_comm->reduce_scatter(p.ag_partial, out, std::size_t(T * h), dt, st);
  } else {
    cast_forward(dt, rdt, p.ag_partial, p.ag_partial_r, TG * h, st);  // exact: the router dtype is fp32 or fp64
    p.ep_comm->reduce_scatter(p.ag_partial_r, p.ag_combined_r, std::size_t(T * h), rdt, st);
    cast_forward(rdt, dt, p.ag_combined_r, out, T * h, st);
  }
}

// The expert-compute phase (_forward_mlp_expert_compute): the group sizes to the host (the one
// synchronisation: shapes depend on the routing, so this phase stays eager), the grouped experts,
// at ep > 1 between the alltoall dispatcher's dispatch and combine.
inline void moe_expert_compute_impl(MoEPlan& p, cudaStream_t st) {
  const int E = p.E;
  auto tap = [&](MoETapPoint t) {
    if (p.on_tap) p.on_tap(t);
  };
  p.tokens_per_expert.assign(std::size_t(E), 0);
  moe_download(p.tokens_per_expert.data(), p.tokens_per_expert_dev, std::size_t(E) * sizeof(std::int64_t), st);
  std::int64_t N = 0;
  for (auto n : p.tokens_per_expert) N += n;
  tap(MoETapPoint::ExpertInputs);

  if (p.ep == 1)
    moe_grouped_experts(p, p.permuted, p.permuted_probs, p.expert_out, p.tokens_per_expert, p.offsets, E, N, st);
  else if (p.allgather)
    moe_allgather_experts(p, st);
  else
    moe_alltoall_experts(p, st);
  tap(MoETapPoint::ExpertsOutput);
}

// The postprocess phase (_forward_mlp_postprocess): combine, shared experts, mlp_bda. Fixed
// shapes (the row-id map is [E, T]): captured as a graph like the router phase.
inline void moe_postprocess_impl(MoEPlan& p, cudaStream_t st) {
  const RankPlan& a = p.attn;
  const DType dt = a.dt;
  const std::int64_t T = moe_tokens(p), h = a.h;
  const int E = p.E;
  auto tap = [&](MoETapPoint t) {
    if (p.on_tap) p.on_tap(t);
  };

  // ---- combine: unpermute, + shared experts                        // [T, h]
  if (p.ep > 1 && p.allgather) {
    // The allgather dispatcher combined in the expert phase. counts: a token's rows of one rank's
    // experts summed (at most min(top-k, local experts) stores), then the reduce-scatter's ep - 1
    // additions in the probabilities' dtype and, when that is not T, the cast back.
    rounding_store(dt, std::min(p.topk, p.local_E));
    rounding_store(p.rdt, p.ep - 1);
    if (p.rdt != dt) rounding_store(dt);
  } else {
    unpermute_forward(dt, p.expert_out, p.row_id_map, p.shared_ffn > 0 ? p.combined : p.mlp_out, T, E, h,
                      routed_rows_bound(p), st);
    rounding_store(dt, p.topk);  // counts: each token's top-k expert rows summed, one store each
  }
  if (p.shared_ffn > 0)
    bias_dropout_add_forward(dt, p.combined, nullptr, p.shared_out, p.mlp_out, T, int(h), DropoutArgs{}, 0, st);
  tap(MoETapPoint::MlpOutput);

  // ---- mlp_bda: out = h1 + dropout(mlp_out)                        // [T, h]
  bias_dropout_add_forward(dt, p.mlp_out, nullptr, a.h1, a.out, T, int(h),
                           DropoutArgs::make(a.hidden_dropout, a.training, a.seed, a.offset_mlp_bda),
                           tensor_parallel(a).element_base(std::int64_t(a.s) * a.b, a.h), st);
}

}  // namespace twin::opt::TWIN_BACKEND
