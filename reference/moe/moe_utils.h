// MoE helpers, mirroring megatron/core/transformer/moe/moe_utils.py (Megatron-LM 93ddc24):
// the load-balancing and z losses, capacity, top-k routing with a score function, group-limited
// top-k, token dropping, and permute / unpermute between token order and expert-major order.
//
// Values are held as double and rounded to the dtype torch stores them in at the rounding points
// named in the comments (Rounding below). Tokens are flattened sequence-major: t = s_idx * b + b_idx.
//
// Ties: torch.topk's choice among equal values is implementation-defined. The reference breaks
// every tie the same way: the lower index wins (the lower expert id when choosing experts, the
// earlier token when choosing which tokens an expert keeps under a capacity).
#pragma once

#include <Eigen/Core>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/tensor.h"
#include "reference/precision.h"
#include "reference/state_dict.h"

namespace twin::reference::moe {

using Index = std::int64_t;
using Mat = RowMatrix<double>;                                                         // values
using BoolMat = Eigen::Matrix<bool, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;  // masks
using IndexMat = Eigen::Matrix<Index, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

// Bad MoE config or input: a message naming the field and the values.
struct MoEError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

// Rounding points for a named dtype (the router dtype can differ from the activation dtype):
// where Megatron's tensor is stored in dtype `dt`, the reference rounds to dt (bf16 / fp16 through
// fp32, as torch's kernels compute in fp32 and store once; see reference/precision.h).
// exact = true (ComputeMode::Exact) skips every rounding.
struct Rounding {
  bool exact = false;
  static Rounding of(const Precision& p) { return Rounding{p.exact()}; }
  double operator()(DType dt, double x) const {
    if (exact || dt == DType::F64) return x;
    const double f = round_to(DType::F32, x);
    return dt == DType::F32 ? f : round_to(dt, f);
  }
  Mat operator()(DType dt, Mat m) const {
    if (!exact && dt != DType::F64)
      for (Index i = 0; i < m.size(); ++i) m.data()[i] = (*this)(dt, m.data()[i]);
    return m;
  }
};

// Conversions between host tensors and the matrices used here (float ones: reference::to_mat).
Tensor to_tensor(const Mat& m, DType dt, Shape shape);
BoolMat to_bool_mat(const Tensor& t, Index rows, Index cols);
Tensor to_tensor(const BoolMat& m);

// torch.topk(v, k) with sorted=True: indices of the k largest values, largest first; equal values
// keep index order (lower index first). NaN counts as the largest value, as in torch.
std::vector<Index> topk_indices(const Eigen::Ref<const Eigen::RowVectorXd>& v, Index k);

// switch_load_balancing_loss_func: E * coeff / (k * T^2) * sum_e (sum_t probs[t, e]) * tokens[e].
double switch_load_balancing_loss_func(const Mat& probs,                              // [T, E']
                                       const std::vector<double>& tokens_per_expert,  // [E']
                                       double total_num_tokens, int topk, int num_experts, double moe_aux_loss_coeff);

// z_loss_func: mean over tokens of logsumexp(logits)^2, times coeff. With padding_mask
// (True = padding) the mean runs over the valid tokens only (at least 1).
double z_loss_func(const Mat& logits, double z_loss_coeff, const std::vector<bool>* padding_mask);

// get_capacity: ceil(num_tokens / num_experts * capacity_factor).
Index get_capacity(Index num_tokens, Index num_experts, double capacity_factor);

struct TokenCounts {
  std::vector<double> global_tokens_per_expert;  // routing_map.sum(0)
  double local_num_tokens = 0;
  double total_num_tokens = 0;
};
// get_tokens_per_expert_and_token_count at one rank: with a padding mask the token count is the
// routed count / topk (padding rows of the map are already zero), else the map's row count.
TokenCounts get_tokens_per_expert_and_token_count(const BoolMat& routing_map, int topk, bool with_padding_mask);

struct TopK {
  Mat values;        // [T, k], largest first
  IndexMat indices;  // [T, k]
};
// torch.topk(scores, k, dim=1).
TopK topk_rows(const Mat& scores, int k);
// group_limited_topk: choose group_topk groups per token by the sum of each group's top
// (topk / group_topk) scores, then the top-k experts inside the chosen groups.
TopK group_limited_topk(const Mat& scores, int topk, int num_groups, int group_topk, DType rdt, const Rounding& rnd);

struct RoutingOptions {
  int topk = 2;
  bool use_pre_softmax = false;
  std::optional<int> num_groups;
  std::optional<int> group_topk;
  std::optional<double> scaling_factor;
  std::string score_function = "softmax";  // softmax | sigmoid | sqrtsoftplus
  // MegatronSwitches::router_scores_fp32: the scores, the sigmoid renormalisation and the scaling
  // factor in fp32, one cast to the router dtype at the end; else each stored in the router dtype.
  bool scores_fp32 = false;
  // Megatron's own top-k choice [T, E] (k experts per token), taken instead of the twin's: a golden
  // whose choice flipped on a near tie is compared downstream on its routing. The probabilities
  // are computed over these experts as over a choice of the twin's.
  const BoolMat* selection = nullptr;
};

struct Routing {
  Mat probs;            // [T, E] routing probabilities, zero off the map
  BoolMat routing_map;  // [T, E]
};
// topk_routing_with_score_function. `logits` are in router dtype `rdt`; expert_bias (fp32, [E])
// only changes which experts are chosen (sigmoid scoring).
// A given choice (a golden's) for T tokens of E experts: MoEError unless it is [T, E] with k
// experts per token.
void check_given_selection(const BoolMat& selection, Index T, Index E, int k);
Routing topk_routing_with_score_function(const Mat& logits, const RoutingOptions& opt,
                                         const std::vector<double>* expert_bias, DType rdt, const Rounding& rnd);

// Backward of topk_routing_with_score_function: dprobs [T, E] is the gradient of its probs (only
// the entries the top-k chose carry one: the scatter's backward gathers them), `selected` [T, E]
// its routing_map; recomputes the forward's scores from logits and returns d logits [T, E] in the
// router dtype. Each rounding point is the dtype torch stores that gradient in (the score function
// in fp32, cast back to rdt by the .float()'s backward).
Mat topk_routing_backward(const Mat& logits, const Mat& dprobs, const BoolMat& selected, const RoutingOptions& opt,
                          DType rdt, const Rounding& rnd);

struct AuxScores {
  BoolMat routing_map;  // [T, E] top-k of the scores, padding rows cleared
  Mat scores;           // [T, E] full softmax (fp32) or normalised sigmoid, padding rows zero
};
// compute_routing_scores_for_aux_loss: the separate full-score computation the losses use.
// `scores_fp32` (MegatronSwitches::aux_loss_scores_fp32): sigmoid and sqrtsoftplus scores and their
// normalisation in fp32, else in the router dtype `rdt`; softmax is fp32 either way.
AuxScores compute_routing_scores_for_aux_loss(const Mat& logits, int topk, const std::string& score_function,
                                              bool scores_fp32, const std::vector<bool>* padding_mask, DType rdt,
                                              const Rounding& rnd);

// Backward of compute_routing_scores_for_aux_loss's scores: dscores [T, E] (zero on padding rows,
// whose scores the valid mask zeroed) -> d logits [T, E] in the router dtype.
Mat aux_scores_backward(const Mat& logits, const Mat& dscores, const std::string& score_function, bool scores_fp32,
                        DType rdt, const Rounding& rnd);

// Backward of z_loss_func with the autoscaler's gradient 1.0: d logits [T, E] =
// coeff 2 logsumexp(l_t) softmax(l_t) / (valid tokens), padding rows zero; router dtype.
Mat z_loss_backward(const Mat& logits, double z_loss_coeff, const std::vector<bool>* padding_mask, DType rdt,
                    const Rounding& rnd);

// apply_router_token_dropping: each expert keeps at most capacity = ceil(T * k / E * factor)
// tokens, chosen by the highest probability ("probs") or by the routing map, earliest token first
// ("position"). pad_to_capacity makes every expert hold exactly capacity tokens.
Routing apply_router_token_dropping(const Routing& routing, int router_topk, double capacity_factor,
                                    const std::string& drop_policy, bool pad_to_capacity);

struct Permuted {
  Mat tokens;                         // [N, H] expert-major, token order within an expert
  std::vector<double> probs;          // [N] when probs were given
  std::vector<Index> sorted_indices;  // [N] source token of each row
};
// permute: tokens routed to expert 0 first (in token order), then expert 1, ... With
// drop_and_pad each expert takes exactly num_out_tokens / E rows.
Permuted permute(const Mat& tokens, const BoolMat& routing_map, const Mat* probs, std::optional<Index> num_out_tokens,
                 bool drop_and_pad);

// unpermute: scatter-add the expert rows back to their tokens (rows added in permuted order,
// each sum stored in dtype `dt`). With probs [T, E] (and the routing_map that permuted), each row
// is first multiplied by its probability, probs.T.masked_select(routing_map.T).
Mat unpermute(const Mat& permuted_tokens, const std::vector<Index>& sorted_indices, Index restore_rows, DType dt,
              const Rounding& rnd, const Mat* probs = nullptr, const BoolMat* routing_map = nullptr);

// sort_chunks_by_idxs: split rows into chunks of split_sizes and concatenate them in sorted_idxs order.
Mat sort_chunks_by_idxs(const Mat& input, const std::vector<Index>& split_sizes, const std::vector<Index>& sorted_idxs,
                        std::vector<double>* probs = nullptr);

}  // namespace twin::reference::moe
