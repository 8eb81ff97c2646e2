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

template <>
struct Io<double> {
  __host__ __device__ static double load(double x) { return x; }
  __host__ __device__ static double store(double x) { return x; }
};

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
    column_scratch[c] = s;
    column_scratch[cols + c] = n;
    if (a.kind == AuxLossKind::GlobalAuxLoss) a.global_tokens[c] += n;
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  double routed = 0.0;
  for (int c = 0; c < cols; ++c) routed += column_scratch[cols + c];
  const int topk_cols = seq ? a.topk * a.bsz : a.topk;
  const double total_tokens = a.with_padding_mask ? routed / topk_cols : static_cast<double>(rows);
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

}  // namespace twin::opt::TWIN_BACKEND
