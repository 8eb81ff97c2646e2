/* The MoE router (reference/moe/router.h; megatron/core/transformer/moe/router.py TopKRouter and
 * moe_utils.py topk_routing_with_score_function, compute_routing_scores_for_aux_loss,
 * apply_router_token_dropping, the losses), as kernels on one stream.
 *
 * Design:
 *  - gating: logits[T, E] = x[T, h] @ w[E, h]^T through the GEMM interface in the router dtype
 *    (the params dtype, or fp32 with moe_router_dtype="fp32": the input is cast once, the weight
 *    is held in fp32). fp64 (moe_router_dtype="fp64") has no cuBLASLt compute type here: a small
 *    fp64 dot-product kernel (one thread per logit, fixed order) computes it.
 *  - one fused kernel per token (router_topk_kernel): score function (softmax before or after
 *    top-k, sigmoid), group-limited top-k, expert bias (it only chooses, as in Megatron), the
 *    sigmoid renormalisation, the top-k scaling factor; with the same rounding points as the
 *    reference (softmax in fp32 stored in the router dtype, ...). In the same pass it computes what
 *    the losses need: the aux-loss scores (full fp32 softmax or normalised sigmoid) and their
 *    top-k map, padding rows cleared, and logsumexp^2 for the z-loss. The tie rule is the
 *    reference's: among equal values the lower index wins (experts, then tokens under a capacity).
 *  - capacity (router_capacity_kernel): each expert keeps at most capacity tokens, by probability
 *    ("probs") or earliest routed ("position"); one thread per (token, expert) computes its rank in
 *    its expert's column, so no sort and no atomics: the result does not depend on scheduling.
 *  - losses (router_loss_kernel): one block; one thread per column sums over the tokens in token
 *    order (fixed order: two runs give the same bits), thread 0 finishes the scalar.
 * Every output is deterministic; nothing here synchronises with the host. */
#pragma once

#include <cmath>
#include <type_traits>

#include "optimized/kernel_common.cuh"
#include "optimized/layer/kernel_types.h"  // ScoreFunction, AuxLossKind, kMaxRouterExperts

namespace twin::opt::TWIN_BACKEND {

// At most this many experts per router (per-thread arrays of the fused kernel).
constexpr int kRouterMaxExperts = kMaxRouterExperts;

// The arithmetic type of router-dtype math: double for an fp64 router, else fp32.
template <class R>
using RouterCompute = std::conditional_t<std::is_same<R, double>::value, double, float>;

// A value stored in the router dtype R (bf16 / fp16 / fp32: one RNE rounding; fp64: none).
template <class R>
__host__ __device__ inline RouterCompute<R> round_r(RouterCompute<R> x) {
  if constexpr (std::is_same<R, double>::value)
    return x;
  else
    return Io<R>::load(Io<R>::store(static_cast<float>(x)));
}

struct RouterArgs {
  std::int64_t tokens = 0;  // T
  int experts = 0;          // E
  int topk = 1;
  ScoreFunction score = ScoreFunction::Softmax;
  bool pre_softmax = false;
  int num_groups = 0, group_topk = 0;  // group_topk == 0: plain top-k
  float scaling_factor = 0.0f;         // 0: none
  // MegatronSwitches::router_scores_fp32: the scores, renormalisation and scaling stored in fp32,
  // one cast to R at the end; else each stored in R.
  bool scores_fp32 = false;
  bool aux_scores = false;       // compute the aux-loss scores and map
  bool aux_scores_fp32 = false;  // MegatronSwitches::aux_loss_scores_fp32: the sigmoid path's in fp32, else in R
  bool z_loss = false;           // compute logsumexp^2 per token
  // Megatron's top-k choice [T, E] (0/1, k per token) from a golden, taken instead of the top-k
  // (the reference's RoutingOptions::selection); may alias the routing map written: each token's
  // row is read before it is written, by the same thread. Null: choose.
  const std::uint8_t* selection = nullptr;
};

// Indices of the k largest of v[0..n) into out (largest first; equal values: lower index first;
// NaN counts as the largest, as torch.topk). Selection by repeated scan: n <= kRouterMaxExperts.
template <class C>
__host__ __device__ inline void topk_select(const C* v, int n, int k, int* out) {
  bool taken[kRouterMaxExperts];
  for (int i = 0; i < n; ++i) taken[i] = false;
  for (int j = 0; j < k; ++j) {
    int best = -1;
    for (int i = 0; i < n; ++i) {
      if (taken[i]) continue;
      if (best < 0) {
        best = i;
        continue;
      }
      const bool vi_nan = v[i] != v[i], vb_nan = v[best] != v[best];
      if (vb_nan) continue;                    // the earlier NaN stays
      if (vi_nan || v[i] > v[best]) best = i;  // strictly greater: ties keep the lower index
    }
    taken[best] = true;
    out[j] = best;
  }
}

// A value stored in fp32 (a no-op in fp32 arithmetic).
template <class C>
__host__ __device__ inline C round_f32(C x) {
  return static_cast<C>(static_cast<float>(x));
}

// The sigmoid path's score of one fp32 logit, in fp32: sigmoid, or softplus (beta 1, threshold 20)
// then sqrt.
__host__ __device__ inline float sigmoid_path_score(float x, ScoreFunction score) {
  if (score == ScoreFunction::SqrtSoftplus) return sqrtf(x > 20.0f ? x : log1pf(expf(x)));
  return 1.0f / (1.0f + expf(-x));
}

// One thread per token. logits [T, E] in R; expert_bias [E] fp32 or null; padding [T] (1 = pad)
// or null. Out: probs [T, E] in R (zero off the map), map [T, E] (0/1); with aux_scores:
// aux_scores [T, E] fp32 holding the values stored in their dtype, aux_map [T, E]; with z_loss:
// z [T] = logsumexp(logits)^2 in fp32.
template <class R>
__global__ void router_topk_kernel(const R* logits, const float* expert_bias, const std::uint8_t* padding, R* probs,
                                   std::uint8_t* routing_map, float* aux_scores, std::uint8_t* aux_map, float* z,
                                   RouterArgs a) {
  using C = RouterCompute<R>;
  const int E = a.experts, k = a.topk;
  for (std::int64_t t = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; t < a.tokens;
       t += std::int64_t(gridDim.x) * blockDim.x) {
    const R* row = logits + t * E;  // [E]
    C x[kRouterMaxExperts];         // the logits
    for (int e = 0; e < E; ++e) x[e] = static_cast<C>(Io<R>::load(row[e]));
    float xf[kRouterMaxExperts];  // the logits cast to fp32 (softmax(x, dtype=float32), sigmoid in fp32)
    for (int e = 0; e < E; ++e) xf[e] = static_cast<float>(x[e]);

    // Where a score is stored: the scores' dtype (fp32 with scores_fp32, else R); the expert-biased
    // scores' promote(scores' dtype, fp32); the logits' R.
    enum Held { InR, InScores, InBiased };
    auto hold = [&](C x, Held where) -> C {
      if (where == InR || (where == InScores && !a.scores_fp32)) return round_r<R>(x);
      if (where == InBiased && std::is_same<C, double>::value && !a.scores_fp32) return x;  // fp64 + fp32: fp64
      return round_f32(x);
    };
    // softmax in fp32 over n values, each stored in fp32 then in the scores' dtype
    auto softmax_s = [&](const float* in, int n, C* out) {
      float m = in[0];
      for (int i = 1; i < n; ++i) m = fmaxf(m, in[i]);
      float ex[kRouterMaxExperts], sum = 0.0f;
      for (int i = 0; i < n; ++i) sum += (ex[i] = expf(in[i] - m));
      for (int i = 0; i < n; ++i) out[i] = hold(static_cast<C>(ex[i] / sum), InScores);  // rounds: fp32, then held
    };

    C scores[kRouterMaxExperts];  // what top-k chooses by
    int idx[kRouterMaxExperts];   // the chosen experts
    C top[kRouterMaxExperts];     // their probabilities
    auto choose = [&](const C* s, Held held) {
      if (a.selection) {  // the given experts, largest score first as torch.topk orders them
        C given[kRouterMaxExperts];
        for (int e = 0; e < E; ++e) given[e] = a.selection[t * E + e] ? s[e] : static_cast<C>(-INFINITY);
        topk_select(given, E, k, idx);
      } else if (a.group_topk > 0) {
        // group_limited_topk: each group scored by the sum of its top (k / group_topk), held as s is
        const int G = a.num_groups, per = E / G, inner = k / a.group_topk;
        C gs[kRouterMaxExperts];
        for (int g = 0; g < G; ++g) {
          int gi[kRouterMaxExperts];
          topk_select(s + g * per, per, inner, gi);
          C sum = 0;
          for (int j = 0; j < inner; ++j) sum += s[g * per + gi[j]];  // largest first, as the reference
          gs[g] = hold(sum, held);                                    // rounds: group score
        }
        int chosen[kRouterMaxExperts];
        topk_select(gs, G, a.group_topk, chosen);
        C masked[kRouterMaxExperts];
        for (int e = 0; e < E; ++e) masked[e] = -INFINITY;
        for (int j = 0; j < a.group_topk; ++j)
          for (int i = 0; i < per; ++i) masked[chosen[j] * per + i] = s[chosen[j] * per + i];
        topk_select(masked, E, k, idx);
      } else {
        topk_select(s, E, k, idx);
      }
    };

    if (a.score == ScoreFunction::Softmax) {
      if (a.pre_softmax) {
        softmax_s(xf, E, scores);
        choose(scores, InScores);
        for (int j = 0; j < k; ++j) top[j] = scores[idx[j]];
      } else {
        choose(x, InR);
        float sel[kRouterMaxExperts];
        for (int j = 0; j < k; ++j) sel[j] = xf[idx[j]];
        softmax_s(sel, k, top);  // softmax over the k chosen logits
      }
    } else {
      for (int e = 0; e < E; ++e)  // rounds: the score function in fp32, then held
        scores[e] = hold(static_cast<C>(sigmoid_path_score(xf[e], a.score)), InScores);
      if (expert_bias) {
        // The bias (fp32) only chooses; the sum is held in promote(scores' dtype, fp32).
        C biased[kRouterMaxExperts];
        for (int e = 0; e < E; ++e) biased[e] = hold(scores[e] + static_cast<C>(expert_bias[e]), InBiased);
        choose(biased, InBiased);
      } else {
        choose(scores, InScores);
      }
      for (int j = 0; j < k; ++j) top[j] = scores[idx[j]];
      if (k > 1) {  // renormalise over the k chosen: sum, + 1e-20, division, each held
        C sum = 0;
        for (int j = 0; j < k; ++j) sum += top[j];
        const C denom = hold(hold(sum, InScores) + static_cast<C>(1e-20), InScores);
        for (int j = 0; j < k; ++j) top[j] = hold(top[j] / denom, InScores);
      }
    }
    if (a.scaling_factor != 0.0f)
      for (int j = 0; j < k; ++j) top[j] = hold(top[j] * static_cast<C>(a.scaling_factor), InScores);  // rounds
    for (int j = 0; j < k; ++j) top[j] = round_r<R>(top[j]);  // probs.type_as(logits): a no-op when held in R

    R* prow = probs + t * E;
    std::uint8_t* mrow = routing_map + t * E;
    for (int e = 0; e < E; ++e) {
      prow[e] = Io<R>::store(0);
      mrow[e] = 0;
    }
    for (int j = 0; j < k; ++j) {
      prow[idx[j]] = Io<R>::store(top[j]);
      mrow[idx[j]] = 1;
    }

    const bool pad = padding && padding[t];
    if (a.aux_scores) {
      C s[kRouterMaxExperts];
      if (a.score == ScoreFunction::Softmax) {
        // torch.softmax(logits, dim=-1, dtype=torch.float32): fp32, no type_as
        float m = xf[0];
        for (int e = 1; e < E; ++e) m = fmaxf(m, xf[e]);
        float ex[kRouterMaxExperts], sum = 0.0f;
        for (int e = 0; e < E; ++e) sum += (ex[e] = expf(xf[e] - m));
        for (int e = 0; e < E; ++e) s[e] = static_cast<C>(ex[e] / sum);
      } else if (a.aux_scores_fp32) {
        // the score function of logits.float(), normalised in fp32: sum, + 1e-20, division
        float f[kRouterMaxExperts], sum = 0.0f;
        for (int e = 0; e < E; ++e) sum += (f[e] = sigmoid_path_score(xf[e], a.score));
        const float denom = sum + 1e-20f;
        for (int e = 0; e < E; ++e) s[e] = static_cast<C>(f[e] / denom);
      } else {
        C sum = 0;  // sigmoid in R, then normalised: sum, + 1e-20, division, each stored in R
        for (int e = 0; e < E; ++e) sum += (s[e] = round_r<R>(static_cast<C>(1) / (static_cast<C>(1) + exp(-x[e]))));
        const C denom = round_r<R>(round_r<R>(sum) + static_cast<C>(1e-20));
        for (int e = 0; e < E; ++e) s[e] = round_r<R>(s[e] / denom);
      }
      int ai[kRouterMaxExperts];
      topk_select(s, E, k, ai);
      float* srow = aux_scores + t * E;
      std::uint8_t* arow = aux_map + t * E;
      for (int e = 0; e < E; ++e) {
        srow[e] = pad ? 0.0f : static_cast<float>(s[e]);
        arow[e] = 0;
      }
      if (!pad)
        for (int j = 0; j < k; ++j) arow[ai[j]] = 1;
    }
    if (a.z_loss) {
      float m = xf[0];
      for (int e = 1; e < E; ++e) m = fmaxf(m, xf[e]);
      float sum = 0.0f;
      for (int e = 0; e < E; ++e) sum += expf(xf[e] - m);
      const float lse = m + logf(sum);
      z[t] = pad ? 0.0f : lse * lse;
    }
  }
}

// get_capacity: ceil(num_tokens / num_experts * capacity_factor), in double as Python's floats.
__host__ __device__ inline std::int64_t expert_capacity(std::int64_t num_tokens, std::int64_t num_experts,
                                                        double capacity_factor) {
  return static_cast<std::int64_t>(ceil((static_cast<double>(num_tokens) / num_experts) * capacity_factor));
}

// apply_router_token_dropping: one thread per (token, expert). The key is the probability
// ("probs") or the map ("position"); a pair is kept when fewer than capacity tokens of its expert
// rank before it (a larger key, or an equal key and a lower token index). pad: the map becomes
// the capacity mask itself. probs_in/map_in are the routing before the drop.
template <class R>
__global__ void router_capacity_kernel(const R* probs_in, const std::uint8_t* map_in, R* probs_out,
                                       std::uint8_t* map_out, std::int64_t T, int E, std::int64_t capacity,
                                       bool by_probs, bool pad) {
  using C = RouterCompute<R>;
  const std::int64_t n = T * E;
  for (std::int64_t i = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += std::int64_t(gridDim.x) * blockDim.x) {
    const std::int64_t t = i / E;
    const int e = static_cast<int>(i % E);
    auto key = [&](std::int64_t u) -> C {
      const std::int64_t j = u * E + e;
      return by_probs ? static_cast<C>(Io<R>::load(probs_in[j])) : static_cast<C>(map_in[j]);
    };
    bool keep = true;
    if (capacity <= T) {
      const C mine = key(t);
      std::int64_t before = 0;
      for (std::int64_t u = 0; u < T && before < capacity; ++u) {
        const C other = key(u);
        if (other > mine || (other == mine && u < t)) ++before;
      }
      keep = before < capacity;
    }
    const bool routed = pad ? keep : (map_in[i] && keep);
    map_out[i] = routed ? 1 : 0;
    probs_out[i] = routed ? probs_in[i] : Io<R>::store(0);
  }
}

struct LossArgs {
  AuxLossKind kind = AuxLossKind::AuxLoss;
  std::int64_t tokens = 0;  // T
  int experts = 0;          // E
  int bsz = 1, topk = 1;
  bool with_padding_mask = false;
  double coeff = 0.0;
  // global_aux_loss: the running tokens-per-expert sum (after adding this call's) and the step count.
  double* global_tokens = nullptr;  // [E] device, persists across forwards
  double ga_steps = 1.0;
  // Tensor parallelism with sequence parallelism (each rank routes its slice of the tokens):
  // tp_counts [cols] the map's column counts summed over the tp ranks (router_map_column_counts,
  // then an all-reduce), which the loss takes in place of its own as Megatron's
  // get_tokens_per_expert_and_token_count does, with tp x the rank's rows as the total tokens.
  const double* tp_counts = nullptr;
  int tp = 1;
  int loss_dtype = 0;  // 0: fp32, 1: bf16, 2: fp16, 3: fp64 (the dtype the loss tensor is stored in)
};

__host__ __device__ inline double round_loss(double x, int dt) {
  switch (dt) {
    case 1:
      return __bfloat162float(__float2bfloat16(static_cast<float>(x)));
    case 2:
      return __half2float(__float2half(static_cast<float>(x)));
    case 3:
      return x;
    default:
      return static_cast<float>(x);
  }
}

// One block. aux_scores [T, E] fp32, aux_map [T, E], z [T]. Out: out[0] = loss / coeff as logged
// (in fp32), out_tokens [E] (or [b * E] for seq_aux_loss): the map's column counts.
static __global__ void router_loss_kernel(const float* aux_scores, const std::uint8_t* aux_map, const float* z,
                                          const std::uint8_t* padding, LossArgs a, double* column_scratch, float* out) {
  const std::int64_t T = a.tokens;
  const int E = a.experts;
  if (a.kind == AuxLossKind::ZLoss) {
    if (threadIdx.x != 0) return;
    float sum = 0.0f, count = 0.0f;
    for (std::int64_t t = 0; t < T; ++t) {
      if (padding && padding[t]) continue;
      sum += z[t];
      count += 1.0f;
    }
    const double denom = padding ? (count > 1.0f ? count : 1.0f) : static_cast<double>(T);
    const double zl = round_loss(sum / denom * a.coeff, a.loss_dtype);  // rounds: z_loss in the loss dtype
    out[0] = static_cast<float>(round_loss(zl / a.coeff, a.loss_dtype));
    return;
  }
  // Columns: E, or with seq_aux_loss the [s, b * E] view (rows of b tokens are one sequence position).
  const bool seq = a.kind == AuxLossKind::SeqAuxLoss;
  const int cols = seq ? a.bsz * E : E;
  const std::int64_t rows = seq ? T / a.bsz : T;
  // column_scratch: [cols] sums of scores, [cols] token counts
  for (int c = threadIdx.x; c < cols; c += blockDim.x) {
    float s = 0.0f;
    double n = 0.0;
    for (std::int64_t r = 0; r < rows; ++r) {
      s += aux_scores[r * cols + c];
      n += aux_map[r * cols + c];
    }
    if (a.tp_counts) n = a.tp_counts[c];
    column_scratch[c] = s;
    column_scratch[cols + c] = n;
    if (a.kind == AuxLossKind::GlobalAuxLoss) a.global_tokens[c] += n;
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  double routed = 0.0;
  for (int c = 0; c < cols; ++c) routed += column_scratch[cols + c];
  const int topk_cols = seq ? a.topk * a.bsz : a.topk;
  const double total_tokens = a.with_padding_mask ? routed / topk_cols : static_cast<double>(rows) * a.tp;
  float s = 0.0f;
  for (int c = 0; c < cols; ++c) {
    const double tokens =
        a.kind == AuxLossKind::GlobalAuxLoss ? a.global_tokens[c] / a.ga_steps : column_scratch[cols + c];
    s += static_cast<float>(column_scratch[c] * tokens);
  }
  double loss = s * (E * a.coeff / (a.topk * total_tokens * total_tokens));
  if (seq) loss /= a.bsz;
  out[0] = static_cast<float>(round_loss(round_loss(loss, a.loss_dtype) / a.coeff, a.loss_dtype));
}

// ---- launchers -------------------------------------------------------------------------------

template <class F>
void dispatch_router_dtype(DType dt, const char* op, F&& f) {
  if (dt == DType::F64) return f(double{});
  dispatch_dtype(dt, op, std::forward<F>(f));
}

inline void router_topk_forward(DType rdt, const void* logits, const float* expert_bias, const std::uint8_t* padding,
                                void* probs, std::uint8_t* routing_map, float* aux_scores, std::uint8_t* aux_map,
                                float* z, const RouterArgs& a, cudaStream_t stream) {
  require(a.experts > 0 && a.experts <= kRouterMaxExperts, "router_topk_forward: num_moe_experts " +
                                                               std::to_string(a.experts) + " outside [1, " +
                                                               std::to_string(kRouterMaxExperts) + "]");
  require(a.topk >= 1 && a.topk <= a.experts, "router_topk_forward: moe_router_topk " + std::to_string(a.topk) +
                                                  " outside [1, num_moe_experts " + std::to_string(a.experts) + "]");
  if (a.group_topk > 0)
    require(a.num_groups > 0 && a.experts % a.num_groups == 0 && a.group_topk <= a.num_groups &&
                a.topk <= a.group_topk * (a.experts / a.num_groups),
            "router_topk_forward: group-limited top-k needs num_groups dividing num_moe_experts, group_topk <= "
            "num_groups and topk <= group_topk * experts per group (got groups " +
                std::to_string(a.num_groups) + ", group_topk " + std::to_string(a.group_topk) + ")");
  require(logits && probs && routing_map, "router_topk_forward: null logits / probs / routing_map");
  require(!a.aux_scores || (aux_scores && aux_map), "router_topk_forward: aux scores requested without buffers");
  require(!a.z_loss || z, "router_topk_forward: z-loss requested without a buffer");
  {
    // cost: the logits [T, E] read, probs written, the routing map written, the expert bias and
    // padding mask read; the losses' per-token scores and maps (fp32) and z when asked for.
    // ~10 FLOPs per score (exponential, sums, the top-k compares).
    const double r = rdt == DType::F64 ? 8 : dtype_size(rdt), te = double(a.tokens) * a.experts;
    rt::declare_cost("router_topk_forward",
                     te * (2 * r + 1) + (expert_bias ? 4.0 * a.experts : 0.0) + (padding ? double(a.tokens) : 0.0) +
                         (a.aux_scores ? te * (4 + 1) : 0.0) + (a.z_loss ? 4.0 * a.tokens : 0.0),
                     10.0 * te);
  }
  if (a.tokens == 0) return;
  dispatch_router_dtype(rdt, "router_topk_forward", [&](auto tag) {
    using R = decltype(tag);
    const unsigned threads = elementwise_threads(a.tokens);
    launch_kernel(router_topk_kernel<R>, dim3(elementwise_blocks(a.tokens, threads)), dim3(threads), 0, stream,
                  static_cast<const R*>(logits), expert_bias, padding, static_cast<R*>(probs), routing_map, aux_scores,
                  aux_map, z, a);
  });
}

inline void router_capacity_forward(DType rdt, const void* probs_in, const std::uint8_t* map_in, void* probs_out,
                                    std::uint8_t* map_out, std::int64_t T, int E, std::int64_t capacity,
                                    const std::string& drop_policy, bool pad, cudaStream_t stream) {
  require(drop_policy == "probs" || drop_policy == "position",
          "router_capacity_forward: drop_policy '" + drop_policy + "' (probs | position)");
  require(capacity >= 0 && E > 0, "router_capacity_forward: bad capacity " + std::to_string(capacity));
  {
    // cost: probs and map [T, E] read and written once; the per-expert top-capacity selection at
    // ~log2(T) compares per score.
    const double r = rdt == DType::F64 ? 8 : dtype_size(rdt), te = double(T) * E;
    rt::declare_cost("router_capacity_forward", 2.0 * te * (r + 1),
                     te * std::log2(double(std::max<std::int64_t>(T, 2))));
  }
  if (T == 0) return;
  dispatch_router_dtype(rdt, "router_capacity_forward", [&](auto tag) {
    using R = decltype(tag);
    const std::int64_t n = T * E;
    const unsigned threads = elementwise_threads(n);
    launch_kernel(router_capacity_kernel<R>, dim3(elementwise_blocks(n, threads)), dim3(threads), 0, stream,
                  static_cast<const R*>(probs_in), map_in, static_cast<R*>(probs_out), map_out, T, E, capacity,
                  drop_policy == "probs", pad);
  });
}

inline int loss_dtype_code(DType dt) {
  switch (dt) {
    case DType::BF16:
      return 1;
    case DType::F16:
      return 2;
    case DType::F64:
      return 3;
    default:
      return 0;
  }
}

// The tokens column c of loss a's map routes: E columns, or with seq_aux_loss the [s, b * E] view's
// b * E; padding rows skipped. An exact integer in fp64.
__host__ __device__ inline double map_column_count(const std::uint8_t* aux_map, const std::uint8_t* padding,
                                                   const LossArgs& a, int c) {
  const int E = a.experts;
  const bool seq = a.kind == AuxLossKind::SeqAuxLoss;
  const int cols = seq ? a.bsz * E : E;
  const std::int64_t rows = seq ? a.tokens / a.bsz : a.tokens;
  double n = 0.0;
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int64_t i = r * cols + c;  // = t * E + e
    if (padding && padding[i / E]) continue;
    n += aux_map[i] ? 1.0 : 0.0;
  }
  return n;
}

// One block: counts[c] = map_column_count, the rank's part of tp_counts before the all-reduce.
static __global__ void router_map_column_counts_kernel(const std::uint8_t* aux_map, const std::uint8_t* padding,
                                                       LossArgs a, double* counts) {
  const int cols = a.kind == AuxLossKind::SeqAuxLoss ? a.bsz * a.experts : a.experts;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) counts[c] = map_column_count(aux_map, padding, a, c);
}

// counts [cols] (E, or b * E for seq_aux_loss): this rank's routed tokens per column of the
// loss `a` (exact integers in fp64, so their all-reduce over the ranks is exact too).
inline void router_map_column_counts(const std::uint8_t* aux_map, const std::uint8_t* padding, const LossArgs& a,
                                     double* counts, cudaStream_t stream) {
  require(aux_map && counts && a.experts > 0, "router_map_column_counts: null map or counts");
  const int cols = a.kind == AuxLossKind::SeqAuxLoss ? a.bsz * a.experts : a.experts;
  // cost: the map [T, E] and the padding mask read once, the counts written; an add per entry.
  rt::declare_cost("router_map_column_counts",
                   double(a.tokens) * a.experts + (padding ? double(a.tokens) : 0.0) + 8.0 * cols,
                   double(a.tokens) * a.experts);
  launch_kernel(router_map_column_counts_kernel, dim3(1), dim3(elementwise_threads(cols)), 0, stream, aux_map, padding,
                a, counts);
}

// column_scratch: 2 * b * E doubles; out: one fp32.
inline void router_loss_forward(const float* aux_scores, const std::uint8_t* aux_map, const float* z,
                                const std::uint8_t* padding, const LossArgs& a, double* column_scratch, float* out,
                                cudaStream_t stream) {
  require(a.coeff != 0.0, "router_loss_forward: zero coefficient");
  require(a.kind != AuxLossKind::SeqAuxLoss || (a.bsz > 0 && a.tokens % a.bsz == 0),
          "router_loss_forward: seq_aux_loss needs tokens divisible by the batch size");
  {
    // cost: the fp32 scores and the map [T, E] (or z [T]) and the padding mask read once, one fp32
    // written; a multiply-add per score.
    const double te = double(a.tokens) * a.experts;
    rt::declare_cost(
        "router_loss_forward",
        (a.kind == AuxLossKind::ZLoss ? 4.0 * a.tokens : te * (4 + 1)) + (padding ? double(a.tokens) : 0.0) + 4.0,
        a.kind == AuxLossKind::ZLoss ? 2.0 * a.tokens : 2.0 * te);
  }
  launch_kernel(router_loss_kernel, dim3(1), dim3(32), 0, stream, aux_scores, aux_map, z, padding, a, column_scratch,
                out);
}

// fp64 gating: logits[t, e] = sum_i x[t, i] w[e, i] (+ bias[e]) in double, in index order.
static __global__ void gating_fp64_kernel(const double* x, const double* w, const double* bias, double* logits,
                                          std::int64_t T, int E, int h) {
  const std::int64_t n = T * E;
  for (std::int64_t i = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += std::int64_t(gridDim.x) * blockDim.x) {
    const std::int64_t t = i / E;
    const int e = static_cast<int>(i % E);
    double s = 0.0;
    for (int j = 0; j < h; ++j) s += x[t * h + j] * w[std::int64_t(e) * h + j];
    logits[i] = bias ? s + bias[e] : s;
  }
}

// Launcher: fp64 gating of T tokens [T, h] by the router weight [E, h] (+ bias [E]) into logits [T, E].
inline void gating_fp64(const double* x, const double* w, const double* bias, double* logits, std::int64_t T, int E,
                        int h, cudaStream_t stream) {
  // cost: the fp64 input [T, h], weight [E, h] and bias read once, the logits [T, E] written; a
  // multiply-add per input and weight pair.
  rt::declare_cost("gating_fp64", 8.0 * (double(T) * h + double(E) * h + E + double(T) * E), 2.0 * T * E * h);
  if (T == 0) return;
  const unsigned threads = elementwise_threads(T * E);
  launch_kernel(gating_fp64_kernel, dim3(elementwise_blocks(T * E, threads)), dim3(threads), 0, stream, x, w, bias,
                logits, T, E, h);
}

// fp64 gating's backward: dx [T, h] = dlogits [T, E] @ w [E, h]; dw [E, h] = dlogits^T @ x [T, h];
// each sum in double in index order (one thread per output element).
static __global__ void gating_fp64_backward_kernel(const double* dlogits, const double* w, const double* x, double* dx,
                                                   double* dw, std::int64_t T, int E, int h) {
  const std::int64_t n_dx = T * h, n = n_dx + std::int64_t(E) * h;
  for (std::int64_t i = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += std::int64_t(gridDim.x) * blockDim.x) {
    double s = 0.0;
    if (i < n_dx) {
      const std::int64_t t = i / h, j = i % h;
      for (int e = 0; e < E; ++e) s += dlogits[t * E + e] * w[std::int64_t(e) * h + j];
      dx[i] = s;
    } else {
      const std::int64_t e = (i - n_dx) / h, j = (i - n_dx) % h;
      for (std::int64_t t = 0; t < T; ++t) s += dlogits[t * E + e] * x[t * h + j];
      dw[i - n_dx] = s;
    }
  }
}

// Launcher: fp64 gating's backward, dx [T, h] and dw [E, h] from dlogits [T, E].
inline void gating_fp64_backward(const double* dlogits, const double* w, const double* x, double* dx, double* dw,
                                 std::int64_t T, int E, int h, cudaStream_t stream) {
  // cost: d logits read twice, the weight and the input once, both gradients written; a
  // multiply-add per (token, expert, column) for each.
  rt::declare_cost("gating_fp64_backward", 8.0 * (2.0 * T * E + 2.0 * T * h + 2.0 * E * h), 4.0 * T * E * h);
  const std::int64_t n = T * h + std::int64_t(E) * h;
  if (T == 0) return;
  const unsigned threads = elementwise_threads(n);
  launch_kernel(gating_fp64_backward_kernel, dim3(elementwise_blocks(n, threads)), dim3(threads), 0, stream, dlogits, w,
                x, dx, dw, T, E, h);
}

// A dtype cast of n elements (the gating input into the router dtype).
template <class A, class B>
__global__ void cast_kernel(const A* in, B* out, std::int64_t n) {
  for (std::int64_t i = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += std::int64_t(gridDim.x) * blockDim.x)
    out[i] = Io<B>::store(static_cast<RouterCompute<B>>(Io<A>::load(in[i])));
}

inline void cast_forward(DType from, DType to, const void* in, void* out, std::int64_t n, cudaStream_t stream) {
  auto size = [](DType d) { return d == DType::F64 ? 8.0 : double(dtype_size(d)); };
  rt::declare_cost("cast_forward", double(n) * (size(from) + size(to)), 0.0);  // cost: read and written once
  if (n == 0) return;
  dispatch_router_dtype(from, "cast_forward", [&](auto a) {
    dispatch_router_dtype(to, "cast_forward", [&](auto b) {
      using A = decltype(a);
      using B = decltype(b);
      const unsigned threads = elementwise_threads(n);
      launch_kernel(cast_kernel<A, B>, dim3(elementwise_blocks(n, threads)), dim3(threads), 0, stream,
                    static_cast<const A*>(in), static_cast<B*>(out), n);
    });
  });
}

// ---- backward --------------------------------------------------------------------------------
// TopKRouter's backward before the gating GEMM (reference TopKRouter::backward; autograd through
// moe_utils.py topk_routing_with_score_function, compute_routing_scores_for_aux_loss, z_loss_func
// and MoEAuxLossAutoScaler, which hands each loss the gradient 1.0):
//  - router_aux_scores_grad: the load-balancing losses' gradient of the aux-loss scores (what the
//    reference's forward stores as saved.aux_scores_grad), loss by loss: one block counts the aux
//    map's columns and finishes the loss's scale, then one thread per token adds its row.
//  - router_topk_backward: one thread per token: the capacity drop's and the scatter's masks, the
//    scaling factor's backward, the score function's (softmax over the row or the k chosen; the
//    sigmoid path's renormalisation, then its score function), then the aux scores' backward and
//    the z-loss's, each added into the logits' gradient in R.
// Sums run in index order in one thread: no atomics, two runs give the same bits.

// Threads per block of the backward kernels (elementwise_threads' largest block).
constexpr int kRouterBackwardThreads = 256;

struct RouterBackwardArgs {
  std::int64_t tokens = 0;  // T
  int experts = 0;          // E
  int topk = 1;
  ScoreFunction score = ScoreFunction::Softmax;
  bool pre_softmax = false;
  float scaling_factor = 0.0f;   // 0: none
  bool scores_fp32 = false;      // MegatronSwitches::router_scores_fp32 (the forward's scores dtype: fp32, else R)
  bool aux_scores_fp32 = false;  // MegatronSwitches::aux_loss_scores_fp32
  bool z_loss = false;           // add the z-loss's gradient
  double z_coeff = 0.0;
};

// The aux-loss scores' (and their losses') dtype: fp32 for softmax (softmax(..., dtype=float32)) or
// with aux_loss_scores_fp32, else the router dtype (reference TopKRouter::aux_scores_dtype).
inline DType router_aux_scores_dtype(DType rdt, ScoreFunction score, bool aux_scores_fp32) {
  return score == ScoreFunction::Softmax || aux_scores_fp32 ? DType::F32 : rdt;
}

// The sigmoid path's score function backward of one element (reference sigmoid_path_backward): x
// the fp32 logit, ds d score. sigmoid: ds y (1 - y) from the fp32 output y; sqrtsoftplus: sqrt's
// backward ds / (2 y) stored in fp32, then softplus's (the identity's above the threshold 20, else
// times sigmoid(x)). Returns the value stored in fp32 (the caller stores it in R: .float()'s backward).
template <class C>
__host__ __device__ inline C sigmoid_path_grad(C ds, float x, ScoreFunction score) {
  const C y = static_cast<C>(sigmoid_path_score(x, score));  // the forward's fp32 output
  if (score == ScoreFunction::SqrtSoftplus) {
    const C dsp = round_f32(ds / (static_cast<C>(2) * y));  // rounds: sqrt's backward, fp32
    return round_f32(x > 20.0f ? dsp : dsp * static_cast<C>(1.0f / (1.0f + expf(-x))));  // rounds: fp32
  }
  return round_f32(ds * y * (static_cast<C>(1) - y));  // rounds: fp32
}

// aux_map's column counts of one loss (Megatron get_tokens_per_expert_and_token_count), one block:
// one thread per column adds its rows in row order (padding rows skipped), thread 0 finishes the
// token count and the loss's scale E coeff / (k total^2) (/ b for seq_aux_loss) stored in the aux
// scores' dtype (aux_dt: round_loss's code). scratch[c] ends holding the tokens the gradient of
// column c uses (the count, or for global_aux_loss the running sum / ga_steps), scratch[cols] the
// scale. Columns as router_loss_kernel: E, or with seq_aux_loss the [s, b * E] view.
// rounds: the scale, in the aux scores' dtype (the counts are exact).
static __global__ void router_aux_counts_kernel(const std::uint8_t* aux_map, const std::uint8_t* padding, LossArgs a,
                                                int aux_dt, double* scratch) {
  const int E = a.experts;
  const bool seq = a.kind == AuxLossKind::SeqAuxLoss;
  const int cols = seq ? a.bsz * E : E;
  const std::int64_t rows = seq ? a.tokens / a.bsz : a.tokens;
  for (int c = threadIdx.x; c < cols; c += blockDim.x)
    scratch[c] = a.tp_counts ? a.tp_counts[c] : map_column_count(aux_map, padding, a, c);
  __syncthreads();
  if (threadIdx.x == 0) {
    double routed = 0.0;
    for (int c = 0; c < cols; ++c) routed += scratch[c];
    const int topk_cols = seq ? a.topk * a.bsz : a.topk;
    const double total = a.with_padding_mask ? routed / topk_cols : static_cast<double>(rows) * a.tp;
    double scale = E * a.coeff / (a.topk * total * total);  // the reference's expression, in its order
    if (seq) scale /= static_cast<double>(a.bsz);
    scratch[cols] = round_loss(scale, aux_dt);
  }
  __syncthreads();
  if (a.kind == AuxLossKind::GlobalAuxLoss)
    for (int c = threadIdx.x; c < cols; c += blockDim.x) scratch[c] = a.global_tokens[c] / a.ga_steps;
}

// One thread per token: aux_grad[t, e] (+)= scale x tokens[column of (t, e)] (reference
// apply_load_balancing_losses' add_grad); padding rows stay 0. first: the row is written (the
// gradient starts at zero), else added to.
// rounds: the product, then the sum, each in the aux scores' dtype (aux_dt: round_loss's code).
static __global__ void router_aux_grad_kernel(const std::uint8_t* padding, const double* scratch, LossArgs a,
                                              int aux_dt, bool first, float* aux_grad) {
  const int E = a.experts;
  const bool seq = a.kind == AuxLossKind::SeqAuxLoss;
  const int cols = seq ? a.bsz * E : E;
  for (std::int64_t t = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; t < a.tokens;
       t += std::int64_t(gridDim.x) * blockDim.x) {
    float* g = aux_grad + t * E;  // [E]
    if (padding && padding[t]) {
      if (first)
        for (int e = 0; e < E; ++e) g[e] = 0.0f;
      continue;
    }
    const double scale = scratch[cols];
    const double* tokens = scratch + (seq ? (t % a.bsz) * E : 0);  // token t = s_idx * b + b_idx: block b_idx
    for (int e = 0; e < E; ++e) {
      const double v = round_loss(scale * tokens[e], aux_dt);                       // rounds: the product
      g[e] = static_cast<float>(first ? v : round_loss(double(g[e]) + v, aux_dt));  // rounds: the sum
    }
  }
}

// One thread per token (reference TopKRouter::backward before the gating GEMM: the capacity drop's
// mask, topk_routing_backward, aux_scores_backward, z_loss_backward, autograd's sums).
// rounds: the scaling factor's backward (scores dtype); softmax: its backward in fp32 (the output
// y recomputed in fp32, dx = y (dy - sum dy y)), stored in fp32 then in R; sigmoid path with k > 1:
// the renormalisation's backward d / denom and d denom = -sum(dp s) / denom^2 and their sum, each
// in the scores dtype (the forward's scores, sum and + 1e-20 recomputed as it stored them), then
// the score function's backward in fp32 and the store in R; the aux scores' backward the same way
// in the aux scores' dtype (the pin's sigmoid in R: ds s (1 - s) in R), then the sum in R; the
// z-loss: coeff / count, logsumexp, 2 lse dvalue, dlse exp(x - lse) and the sum, each in R.
template <class R>
__global__ void router_topk_backward_kernel(const R* logits, const R* dprobs, const std::uint8_t* routing_map,
                                            const std::uint8_t* selected, const float* aux_grad,
                                            const std::uint8_t* padding, R* dlogits, RouterBackwardArgs a) {
  using C = RouterCompute<R>;
  const int E = a.experts, k = a.topk;
  // The z-loss is a mean over the non-padding tokens (at least 1): every block counts them (an
  // integer count: the order does not matter), before any thread leaves.
  double z_count = static_cast<double>(a.tokens);
  if (a.z_loss && padding) {
    __shared__ long long partial[kRouterBackwardThreads];
    long long n = 0;
    for (std::int64_t t = threadIdx.x; t < a.tokens; t += blockDim.x) n += padding[t] ? 0 : 1;
    partial[threadIdx.x] = n;
    __syncthreads();
    long long total = 0;
    for (unsigned i = 0; i < blockDim.x; ++i) total += partial[i];
    z_count = total > 1 ? static_cast<double>(total) : 1.0;
  }
  // rounds: the mean's backward, coeff / count: the coefficient stored in R, the quotient (in
  // double, then stored once in R, as the reference's) in R
  const C dvalue = round_r<R>(static_cast<C>(static_cast<double>(round_r<R>(static_cast<C>(a.z_coeff))) / z_count));

  auto hold_s = [&](C v) -> C { return a.scores_fp32 ? round_f32(v) : round_r<R>(v); };      // scores dtype
  auto hold_a = [&](C v) -> C { return a.aux_scores_fp32 ? round_f32(v) : round_r<R>(v); };  // aux (sigmoid path)
  for (std::int64_t t = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; t < a.tokens;
       t += std::int64_t(gridDim.x) * blockDim.x) {
    const R* lrow = logits + t * E;  // [E]
    const R* prow = dprobs + t * E;  // [E]
    C x[kRouterMaxExperts];          // the logits
    float xf[kRouterMaxExperts];     // cast to fp32
    C dp[kRouterMaxExperts];         // d probs through the drop's and the scatter's masks, x scaling factor
    bool sel[kRouterMaxExperts];
    for (int e = 0; e < E; ++e) {
      x[e] = static_cast<C>(Io<R>::load(lrow[e]));
      xf[e] = static_cast<float>(x[e]);
      sel[e] = selected[t * E + e] != 0;
      dp[e] = routing_map[t * E + e] && sel[e] ? static_cast<C>(Io<R>::load(prow[e])) : static_cast<C>(0);
      if (a.scaling_factor != 0.0f) dp[e] = hold_s(dp[e] * static_cast<C>(a.scaling_factor));  // rounds: scores dt
    }
    // softmax's backward over n fp32 inputs in[] (recomputing its fp32 output y) from dy[]:
    // out[i] = y_i (dy_i - sum_j dy_j y_j), stored in fp32.
    auto softmax_grad = [&](const float* in, const C* dy, int n, C* out) {
      float m = in[0];
      for (int i = 1; i < n; ++i) m = fmaxf(m, in[i]);
      float ex[kRouterMaxExperts], sum = 0.0f;
      for (int i = 0; i < n; ++i) sum += (ex[i] = expf(in[i] - m));
      C dot = 0;
      for (int i = 0; i < n; ++i) dot += dy[i] * static_cast<C>(ex[i] / sum);
      for (int i = 0; i < n; ++i) out[i] = round_f32(static_cast<C>(ex[i] / sum) * (dy[i] - dot));  // rounds: fp32
    };

    C d[kRouterMaxExperts];  // d logits, in R
    if (a.score == ScoreFunction::Softmax) {
      int cols[kRouterMaxExperts], n = 0;  // the softmax's input: the row, or the k chosen (index order)
      for (int e = 0; e < E; ++e)
        if (a.pre_softmax || sel[e]) cols[n++] = e;
      float in[kRouterMaxExperts];
      C dy[kRouterMaxExperts], dx[kRouterMaxExperts];
      for (int i = 0; i < n; ++i) {
        in[i] = xf[cols[i]];
        dy[i] = dp[cols[i]];
      }
      softmax_grad(in, dy, n, dx);
      for (int e = 0; e < E; ++e) d[e] = 0;
      for (int i = 0; i < n; ++i) d[cols[i]] = round_r<R>(dx[i]);  // rounds: .float()'s backward, R
    } else {
      C ds[kRouterMaxExperts];
      for (int e = 0; e < E; ++e) ds[e] = dp[e];
      if (k > 1) {  // probs = scores / (sum over the k chosen + 1e-20)
        C s[kRouterMaxExperts], sum = 0, dot = 0;
        for (int e = 0; e < E; ++e)
          if (sel[e]) sum += (s[e] = hold_s(static_cast<C>(sigmoid_path_score(xf[e], a.score))));
        const C denom = hold_s(hold_s(sum) + static_cast<C>(1e-20));
        for (int e = 0; e < E; ++e)
          if (sel[e]) dot += dp[e] * s[e];
        const C ddenom = hold_s(-dot / (denom * denom));  // rounds: the division's backward for the denominator
        for (int e = 0; e < E; ++e)
          ds[e] = sel[e] ? hold_s(hold_s(dp[e] / denom) + ddenom) : static_cast<C>(0);  // rounds: / denom, + d denom
      }
      for (int e = 0; e < E; ++e) d[e] = round_r<R>(sigmoid_path_grad(ds[e], xf[e], a.score));  // rounds: R
    }

    if (aux_grad) {  // aux_scores_backward, added in R
      const float* grow = aux_grad + t * E;
      C da[kRouterMaxExperts];
      if (a.score == ScoreFunction::Softmax) {  // torch.softmax(logits, dtype=float32): fp32, no type_as
        C dy[kRouterMaxExperts];
        for (int e = 0; e < E; ++e) dy[e] = static_cast<C>(grow[e]);
        softmax_grad(xf, dy, E, da);
        for (int e = 0; e < E; ++e) da[e] = round_r<R>(da[e]);  // rounds: to R
      } else {
        // the scores as the forward stored them: the score function of the fp32 logits in fp32, or
        // the pin's sigmoid in R; / (sum + 1e-20), each in the aux scores' dtype
        C s[kRouterMaxExperts], sum = 0, dot = 0;
        for (int e = 0; e < E; ++e) {
          s[e] = a.aux_scores_fp32 ? round_f32(static_cast<C>(sigmoid_path_score(xf[e], a.score)))
                                   : round_r<R>(static_cast<C>(1) / (static_cast<C>(1) + exp(-x[e])));
          sum += s[e];
        }
        const C denom = hold_a(hold_a(sum) + static_cast<C>(1e-20));
        for (int e = 0; e < E; ++e) dot += static_cast<C>(grow[e]) * s[e];
        const C ddenom = hold_a(-dot / (denom * denom));  // rounds: aux dt
        for (int e = 0; e < E; ++e) {
          const C ds = hold_a(hold_a(static_cast<C>(grow[e]) / denom) + ddenom);  // rounds: aux dt
          da[e] = a.aux_scores_fp32 ? round_r<R>(sigmoid_path_grad(ds, xf[e], a.score))
                                    : round_r<R>(ds * s[e] * (static_cast<C>(1) - s[e]));  // rounds: R
        }
      }
      for (int e = 0; e < E; ++e) d[e] = round_r<R>(d[e] + da[e]);  // rounds: the accumulated gradient
    }

    if (a.z_loss && !(padding && padding[t])) {  // z_loss_backward, added in R; padding rows add nothing
      C m = static_cast<C>(-INFINITY);
      for (int e = 0; e < E; ++e) m = x[e] > m ? x[e] : m;
      C sum = 0;
      for (int e = 0; e < E; ++e) sum += exp(x[e] - m);
      const C lse = round_r<R>(m + log(sum));                       // rounds: the forward's logsumexp, R
      const C dlse = round_r<R>(static_cast<C>(2) * lse * dvalue);  // rounds: square's backward, R
      for (int e = 0; e < E; ++e)
        d[e] = round_r<R>(d[e] + round_r<R>(dlse * exp(x[e] - lse)));  // rounds: logsumexp's backward, the sum
    }

    R* drow = dlogits + t * E;
    for (int e = 0; e < E; ++e) drow[e] = Io<R>::store(d[e]);
  }
}

// The load-balancing losses' gradient of the aux-loss scores, as MoEAuxLossAutoScaler hands each
// loss the gradient 1.0 (reference apply_load_balancing_losses' add_grad): for each of the n_losses
// losses in order (AuxLoss, SeqAuxLoss, GlobalAuxLoss; each LossArgs as router_loss_forward took it,
// global_tokens the running sum after this forward's update), aux_grad[t, e] += tokens[e] E coeff /
// (k total^2) (/ b, and the [s, b * E] column view, for seq_aux_loss), the scale, each product and
// each sum stored in the aux scores' dtype (router_aux_scores_dtype); padding rows stay 0. The token
// counts are aux_map's column counts over the non-padding rows, recomputed here in a fixed order.
// aux_grad [T, E] fp32 holds values already rounded to that dtype (an fp64 one is held in fp32):
// written by the first loss, added to by the others; with no loss nothing is written.
// scratch: device doubles, at least max over the losses of cols + 1, cols = b * E for seq_aux_loss,
// else E (2 * b * E always suffices); reused loss by loss.
inline void router_aux_scores_grad(DType rdt, const std::uint8_t* aux_map, const std::uint8_t* padding,
                                   const LossArgs* losses, int n_losses, ScoreFunction score, bool aux_scores_fp32,
                                   float* aux_grad, double* scratch, cudaStream_t stream) {
  require(n_losses >= 0 && (n_losses == 0 || (losses && aux_map && scratch)),
          "router_aux_scores_grad: null losses / aux_map / scratch");
  require(aux_grad, "router_aux_scores_grad: null aux_grad");
  const std::int64_t T = n_losses ? losses[0].tokens : 0;
  const int E = n_losses ? losses[0].experts : 0;
  for (int i = 0; i < n_losses; ++i) {
    const LossArgs& l = losses[i];
    require(l.kind != AuxLossKind::ZLoss, "router_aux_scores_grad: the z-loss has no aux-scores gradient");
    require(l.tokens == T && l.experts == E, "router_aux_scores_grad: losses of different [T, E]");
    require(l.experts > 0 && l.experts <= kRouterMaxExperts, "router_aux_scores_grad: num_moe_experts " +
                                                                 std::to_string(l.experts) + " outside [1, " +
                                                                 std::to_string(kRouterMaxExperts) + "]");
    require(l.topk >= 1 && l.topk <= l.experts,
            "router_aux_scores_grad: moe_router_topk " + std::to_string(l.topk) + " outside [1, num_moe_experts]");
    require(l.kind != AuxLossKind::SeqAuxLoss || (l.bsz > 0 && l.tokens % l.bsz == 0),
            "router_aux_scores_grad: seq_aux_loss needs tokens divisible by the batch size");
    require(l.kind != AuxLossKind::GlobalAuxLoss || (l.global_tokens && l.ga_steps > 0),
            "router_aux_scores_grad: global_aux_loss needs the running tokens per expert and ga_steps > 0");
  }
  const int aux_dt = loss_dtype_code(router_aux_scores_dtype(rdt, score, aux_scores_fp32));
  if (n_losses == 0 || T == 0) return;  // no loss: nothing is written
  const double te = double(T) * E;
  for (int i = 0; i < n_losses; ++i) {
    const LossArgs& l = losses[i];
    const int cols = l.kind == AuxLossKind::SeqAuxLoss ? l.bsz * E : E;
    // cost: the counts: the map [T, E] and the padding mask read once, the counts written; the
    // gradient: [T, E] fp32 written (read too after the first loss), a multiply and an add per score.
    rt::declare_cost("router_aux_counts", te + (padding ? double(T) : 0.0) + 8.0 * (cols + 1), te);
    rt::declare_cost("router_aux_grad", (i == 0 ? 4.0 : 8.0) * te + 8.0 * (cols + 1), 2.0 * te);
    launch_kernel(router_aux_counts_kernel, dim3(1), dim3(elementwise_threads(cols)), 0, stream, aux_map, padding, l,
                  aux_dt, scratch);
    const unsigned threads = elementwise_threads(T);
    launch_kernel(router_aux_grad_kernel, dim3(elementwise_blocks(T, threads)), dim3(threads), 0, stream, padding,
                  static_cast<const double*>(scratch), l, aux_dt, i == 0, aux_grad);
  }
}

inline void router_topk_backward(DType rdt, const void* logits, const void* dprobs, const std::uint8_t* routing_map,
                                 const std::uint8_t* selected, const float* aux_grad, const std::uint8_t* padding,
                                 void* dlogits, const RouterBackwardArgs& a, cudaStream_t stream) {
  require(a.experts > 0 && a.experts <= kRouterMaxExperts, "router_topk_backward: num_moe_experts " +
                                                               std::to_string(a.experts) + " outside [1, " +
                                                               std::to_string(kRouterMaxExperts) + "]");
  require(a.topk >= 1 && a.topk <= a.experts, "router_topk_backward: moe_router_topk " + std::to_string(a.topk) +
                                                  " outside [1, num_moe_experts " + std::to_string(a.experts) + "]");
  require(logits && dprobs && routing_map && selected && dlogits,
          "router_topk_backward: null logits / dprobs / routing_map / selected / dlogits");
  {
    // cost: the logits, d probs and d logits [T, E] in R, both maps, the aux gradient (fp32) when
    // given and the padding mask read or written once; ~20 FLOPs per score (the recomputed
    // exponentials and scores, the softmax's or the renormalisation's backward; the aux scores'
    // and the z-loss's again).
    const double r = rdt == DType::F64 ? 8 : dtype_size(rdt), te = double(a.tokens) * a.experts;
    rt::declare_cost("router_topk_backward",
                     te * (3 * r + 2) + (aux_grad ? 4.0 * te : 0.0) + (padding ? double(a.tokens) : 0.0),
                     te * (20.0 + (aux_grad ? 20.0 : 0.0) + (a.z_loss ? 10.0 : 0.0)));
  }
  // counts: as the reference's TopKRouter::backward before the gating GEMM (count_score_rounding:
  // the score function's fp32 reduction and store(s), the scores dtype's stores, the final cast;
  // then the aux scores' backward and the z-loss's, each with its sum, in R).
  const DType sdt = a.scores_fp32 ? DType::F32 : rdt;
  const bool sigmoid_path = a.score != ScoreFunction::Softmax;
  rounding_reduce(a.experts);
  rounding_store(DType::F32, a.score == ScoreFunction::SqrtSoftplus ? 2 : 1);
  rounding_store(sdt, 1 + (sigmoid_path && a.topk > 1 ? 3 : 0) + (a.scaling_factor != 0.0f ? 1 : 0));
  if (sdt != rdt) rounding_store(rdt);
  if (aux_grad) {
    rounding_reduce(a.experts);
    rounding_store(rdt, 3);
  }
  if (a.z_loss) rounding_store(rdt, 4);
  if (a.tokens == 0) return;
  dispatch_router_dtype(rdt, "router_topk_backward", [&](auto tag) {
    using R = decltype(tag);
    const unsigned threads = elementwise_threads(a.tokens);
    launch_kernel(router_topk_backward_kernel<R>, dim3(elementwise_blocks(a.tokens, threads)), dim3(threads), 0, stream,
                  static_cast<const R*>(logits), static_cast<const R*>(dprobs), routing_map, selected, aux_grad,
                  padding, static_cast<R*>(dlogits), a);
  });
}

}  // namespace twin::opt::TWIN_BACKEND
