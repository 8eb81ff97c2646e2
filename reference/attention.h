// megatron/core/transformer/attention.py: SelfAttention and CrossAttention (tensor parallel 1).
//
// SelfAttention.get_query_key_value_tensors: the fused linear_qkv weight is grouped per query
// group. With np heads, ng = num_query_groups groups, hn = kv_channels and r = np / ng, its
// rows (output features) are, for g = 0 .. ng-1, a block of (r + 2) * hn rows:
//     [ q heads g*r .. g*r+r-1 (hn rows each) | k head g (hn) | v head g (hn) ]
// (with attention_output_gate: [ q heads | gate heads (r * hn) | k | v ]). So mixed_qkv
// [s, b, ng * (r + 2) * hn] is viewed as [s, b, ng, (r + 2) * hn] and split along the last dim.
// q_layernorm / k_layernorm normalise each head over hn, before RoPE.
//
// forward: qkv -> (q/k layernorm) -> RoPE(q, k) -> core_attention -> (output gate) -> linear_proj,
// returning (output, bias) with linear_proj's bias separate (skip_bias_add).
// Taps (relative to the module prefix, e.g. "self_attention."): linear_qkv.0, q_layernorm,
// k_layernorm, core_attention, linear_proj.0, linear_proj.1, then 0 and 1 (own output).
//
// CrossAttention: linear_kv(key_value_states) -> [sk, b, np, 2 hn] split into (key, value)
// halves; linear_q(hidden_states) -> [sq, b, np, hn]; no GQA (num_query_groups must equal
// num_attention_heads). Taps: linear_kv.0, linear_q.0, core_attention, linear_proj.0/.1, 0, 1.
//
// AttentionModule is the interface of the layer's self_attention and cross_attention slots; the
// Retro helper plugs its own cross-attention in through it.
//
// CrossAttention's backward: linear_proj, core attention, the (key, value) split's transpose into
// mixed_kv's rows, linear_kv (-> d key_value_states) and linear_q (-> d hidden_states); the
// forward saves what it needs in CrossAttentionSaved. A cross-attention slot module with a
// backward implements CrossAttentionBackward, whose backward runs through the module's bda as
// well (Retro's modules return a dict / tuples only the bda built for them reads).
//
// SelfAttention's backward runs the forward's steps in reverse: linear_proj (dgrad, wgrad, bias
// grad), core attention, RoPE, q/k layernorm, the split of mixed_qkv (its transpose: the grads
// of q, k, v written back into their rows of the fused layout), linear_qkv. The forward saves the
// activations it needs in SelfAttentionSaved. The output gate's backward is not implemented
// (ConfigError).
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "reference/dot_product_attention.h"
#include "reference/linear.h"
#include "reference/philox.h"
#include "reference/precision.h"
#include "reference/state_dict.h"
#include "reference/taps.h"
#include "reference/torch_norm.h"

namespace twin::reference {

struct AttentionArgs {
  int s = 0, b = 0;                          // hidden_states is [s, b, h]
  const Tensor* attention_mask = nullptr;    // self: attention_mask; cross: context_mask
  const Tensor* key_value_states = nullptr;  // cross: context [sk, b, h]
  const Tensor* rotary_pos_emb = nullptr;    // [s, 1, 1, rot_dim]
  bool training = false;
  DropoutRng rng;  // attention dropout stream
};

// (output, bias) plus what a dict-returning attention (Retro) hands to its bda.
struct AttentionOutput : OutputWithBias {
  std::optional<Tensor> context;      // a dict output's "context" (Retro), else none
  std::shared_ptr<const void> extra;  // module-specific payload for a matching bda
};

class AttentionModule {
 public:
  virtual ~AttentionModule() = default;
  // hidden_states [s * b, h] rows. Records its taps (own output last as "0", "1").
  virtual AttentionOutput forward(const Mat& hidden_states, const AttentionArgs& args, const Taps& taps) = 0;
  virtual void load_state_dict(const StateDict& sd, const std::string& prefix) = 0;
};

// Submodules of SelfAttention (SelfAttentionSubmodules): q/k layernorm builders, empty = IdentityOp.
using QKNormBuilder =
    std::function<std::unique_ptr<Norm>(const TransformerConfig&, int hidden_size, double eps, Precision)>;
struct SelfAttentionSubmodules {
  QKNormBuilder q_layernorm;  // empty: IdentityOp
  QKNormBuilder k_layernorm;
};

// What SelfAttention's backward needs from its forward.
struct SelfAttentionSaved {
  LinearSaved linear_qkv;
  Mat query_pre_norm, key_pre_norm;  // [s*b*np, hn], [s*b*ng, hn]: the q/k layernorm inputs
  Mat query, key, value;             // the core attention's inputs (after q/k layernorm and RoPE)
  Mat freqs;                         // RoPE angles [s, rot_dim]; empty without RoPE
  LinearSaved linear_proj;
};

// linear_proj's output, recorded as linear_proj.0 / .1 and again as the module's own output 0 / 1
// (the same tensors: the module returns linear_proj's pair). Continues with what the taps return.
void record_output(const Taps& taps, AttentionOutput& out, int s, int b, const Precision& p);

struct AttentionGrads {
  Mat hidden_states;  // [s*b, h]
  ParamGrads params;  // relative to the module ("linear_qkv.weight", ...)
};

class SelfAttention : public AttentionModule {
 public:
  SelfAttention(const TransformerConfig& config, const SelfAttentionSubmodules& submodules, int layer_number,
                AttnMaskType attn_mask_type, Precision p);

  AttentionOutput forward(const Mat& hidden_states, const AttentionArgs& args, const Taps& taps) override;
  // The same, filling `saved` (when given) for backward.
  AttentionOutput forward(const Mat& hidden_states, const AttentionArgs& args, const Taps& taps,
                          SelfAttentionSaved* saved);
  // doutput [s*b, h]: the gradient of linear_proj's output (plus its bias, when skip_bias_add
  // hands it out: the same gradient). `args` as in the forward.
  AttentionGrads backward(const Mat& doutput, const SelfAttentionSaved& saved, const AttentionArgs& args) const;
  void load_state_dict(const StateDict& sd, const std::string& prefix) override;

  struct QKV {
    Mat query, key, value;
    std::optional<Mat> gate;
  };  // [s*b*np, hn], [s*b*ng, hn] x2
  QKV get_query_key_value_tensors(const Mat& hidden_states, const AttentionArgs& args, const Taps& taps,
                                  SelfAttentionSaved* saved = nullptr) const;

  Linear linear_qkv;                               // [ng * (np/ng + 2) * hn, h]
  std::unique_ptr<Norm> q_layernorm, k_layernorm;  // null: IdentityOp
  DotProductAttention core_attention;
  Linear linear_proj;  // [h, np * hn]

 private:
  int np_, ng_, hn_, hidden_;
  bool output_gate_, rotary_interleaved_;
  Precision p_;
};

// What CrossAttention's backward needs from its forward.
struct CrossAttentionSaved {
  LinearSaved linear_q, linear_kv, linear_proj;
  Mat query, key, value;  // the core attention's inputs [sq*b*np, hn], [sk*b*np, hn] x2
};

struct CrossAttentionGrads {
  Mat hidden_states;     // [sq*b, h]
  Mat key_value_states;  // [sk*b, h]
  ParamGrads params;     // relative to the module ("linear_q.weight", ...)
};

// The backward of a cross_attention slot module together with its cross_attn_bda (the bda built
// for it by the same spec). forward_saving is the module's forward keeping its activations in
// `saved`; backward_with_bda takes d (the bda's output) [s*b, h] and, when the module returned a
// context (AttentionOutput::context), d_context of it (nullptr: none reaches it), and consumes
// `saved` as TransformerLayer::backward does.
struct CrossAttentionWithBdaGrads {
  Mat hidden_states;                    // d of the module's input (the pre_cross_attn_layernorm output)
  std::optional<Mat> residual;          // d of the layer's residual; none: the bda does not read it
  std::optional<Mat> key_value_states;  // d of args.key_value_states, rows of its [.., .., h] shape
  ParamGrads params;                    // relative to the module
};
struct CrossAttentionBdaArgs {
  double hidden_dropout = 0.0;
  bool training = false;
  DropoutRng rng;  // the bda's dropout stream
};
class CrossAttentionBackward {
 public:
  virtual ~CrossAttentionBackward() = default;
  virtual AttentionOutput forward_saving(const Mat& hidden_states, const AttentionArgs& args, const Taps& taps,
                                         std::shared_ptr<void>* saved) = 0;
  virtual CrossAttentionWithBdaGrads backward_with_bda(const Mat& d, const Mat* d_context, void* saved,
                                                       const AttentionArgs& args,
                                                       const CrossAttentionBdaArgs& bda) const = 0;
  // Why the backward does not cover this module's configuration, or none.
  virtual std::optional<std::string> backward_unsupported() const { return std::nullopt; }
};

class CrossAttention : public AttentionModule {
 public:
  CrossAttention(const TransformerConfig& config, int layer_number, AttnMaskType attn_mask_type, Precision p);

  AttentionOutput forward(const Mat& hidden_states, const AttentionArgs& args, const Taps& taps) override;
  // The same with the context already as a matrix: key_value_states [sk * b, h].
  AttentionOutput forward_mats(const Mat& hidden_states, int sq, int b, const Mat& key_value_states, int sk,
                               const Tensor* attention_mask, bool training, const DropoutRng& rng, const Taps& taps,
                               CrossAttentionSaved* saved = nullptr);
  // doutput [sq*b, h]: the gradient of linear_proj's output (and of its bias when handed out);
  // the other arguments as in forward_mats.
  CrossAttentionGrads backward(const Mat& doutput, const CrossAttentionSaved& saved, int sq, int sk, int b,
                               const Tensor* attention_mask, bool training, const DropoutRng& rng) const;
  void load_state_dict(const StateDict& sd, const std::string& prefix) override;

  Linear linear_q;   // [np * hn, h]
  Linear linear_kv;  // [2 * np * hn, h]
  DotProductAttention core_attention;
  Linear linear_proj;  // [h, np * hn]

 private:
  int np_, hn_, hidden_;
  Precision p_;
};

// Rows of the fused linear_qkv weight for (group g, part), part 0..r-1 = query head g*r + part,
// r = key, r + 1 = value: the first row index of that head's hn rows (the documented layout).
int qkv_row_offset(int num_heads, int num_query_groups, int head_dim, int group, int part);

}  // namespace twin::reference
