// The magnitudes a parameter gradient's rounding error scales with (the reference's ParamGrad:
// the largest sum of absolute terms one element of the gradient accumulates), computed on the host
// from the output gradients and inputs a rank's backward left in its buffers, for any layer kind.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "optimized/layer/rank_plan.h"

namespace twin::opt {

// |t| in double.
std::vector<double> abs_values(const Tensor& t);
// A weight's: max over (o, i) of sum_rows |dy[r, o]| |x[r, i]| (dy [rows, out], x [rows, in], both |.|).
double weight_magnitude(const std::vector<double>& dy, const std::vector<double>& x, std::int64_t rows,
                        std::int64_t out, std::int64_t in);
// A bias's (and a LayerNorm bias's): max over columns of sum_rows |dy[r, c]|.
double column_magnitude(const std::vector<double>& dy, std::int64_t rows, std::int64_t cols);
// A norm weight's: max over columns of sum_rows |dy[r, c] x_hat[r, c]|, x_hat the normalised input
// (LayerNorm: (x - mean) rstd; RMSNorm: x rstd), in double.
double norm_weight_magnitude(const std::vector<double>& dy, const Tensor& x, std::int64_t rows, std::int64_t cols,
                             bool rms, double eps);
// The q rows or the k rows ([rows, hn], heads in layout order) of a [n, qw] tensor in the fused
// linear_qkv layout of `p`: token t, group g holds hpg q heads then k then v, each hn wide.
std::vector<double> gather_heads(const std::vector<double>& full, std::int64_t n, const RankPlan& p, bool keys);

// The attention half's parameters' magnitudes, for any layer kind with one, from its tensors as
// the full layer's (every rank's parts put together), each read once when a magnitude needs it:
//   d_ln1, d_proj, d_ln2, x (the layer input), h1 (pre_mlp_layernorm's input) [n, h];
//   d_qkv (core attention's q, k, v gradient), d_qkv_pre (linear_qkv's output gradient, qk-norms
//   only), qkv_pre_norm (linear_qkv's output before the qk-norms) [n, qkv_width]; ln1 [n, h];
//   ctx [n, ctx_width]; with MLA (mla_magnitude_sources): d_query [n, np * q_head], d_kv
//   [n, np * (qk + v)], q_compressed, q_normed, d_q_normed, d_q_compressed [n, q_lora],
//   kv_combined, kv_normed, d_kv_latent, d_kv_combined [n, kv_lora + pe].
class AttentionHalfMagnitudes {
 public:
  using Source = std::function<Tensor()>;
  // plan: the full layer's (tp = 1); n tokens.
  AttentionHalfMagnitudes(const RankPlan& plan, std::int64_t n, std::map<std::string, Source> sources);
  // The magnitude of the attention half's parameter `key`; nullopt for a key not the half's.
  std::optional<double> operator()(const std::string& key);

 private:
  const Tensor& tensor(const std::string& name);
  const std::vector<double>& abs(const std::string& name);
  double qk_norm(bool keys, bool bias);
  std::optional<double> mla(const std::string& key);
  // The first `cols` columns of the [n, width] tensor `name` (F64).
  Tensor first_cols(const std::string& name, std::int64_t width, std::int64_t cols);
  RankPlan p_;
  std::int64_t n_;
  std::map<std::string, Source> sources_;
  std::map<std::string, Tensor> tensors_;
  std::map<std::string, std::vector<double>> abs_;
};

// MLA's sources of AttentionHalfMagnitudes, each read by `read(ptr, cols, per_head)`: `ptr` picks
// a rank's buffer from its plan and gradients, per_head tensors are each rank's heads' columns
// ([n, cols / tp] on each, put together by heads), the others whole on every rank.
using MlaBufferOf = std::function<const void*(const RankPlan&, const RankGrads&)>;
using MlaRead = std::function<Tensor(const MlaBufferOf& ptr, std::int64_t cols, bool per_head)>;
void add_mla_magnitude_sources(const RankPlan& full_plan, const MlaRead& read,
                               std::map<std::string, AttentionHalfMagnitudes::Source>& sources);

// Every source of AttentionHalfMagnitudes for a layer whose ranks hold the attention half as
// `full_plan` splits it (MLA's included), each read as the full layer's [n, cols] tensor from the
// ranks' buffer `ptr` picks: `rows` from each rank's rows (its sequence slice under SP, else
// rank 0's whole) with h columns, `heads` from each rank's heads' columns, `whole` rank 0's.
struct RankTensorReaders {
  std::function<Tensor(const MlaBufferOf& ptr)> rows;
  std::function<Tensor(const MlaBufferOf&ptr, std::int64_t cols)> heads, whole;
};
std::map<std::string, AttentionHalfMagnitudes::Source> attention_half_magnitude_sources(const RankPlan& full_plan,
                                                                                        const RankTensorReaders& read);

}  // namespace twin::opt
