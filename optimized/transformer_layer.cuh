/* One tensor-parallel rank of the dense TransformerLayer forward and backward
 * (reference/transformer_layer.h; megatron/core/transformer/transformer_layer.py, attention.py,
 * mlp.py), as a sequence of kernel launches, GEMMs (the GEMM interface: cuBLASLt on the GPU) and
 * collectives on one stream: the attention half every kind shares (layer/attention_half.cuh), then
 * the dense MLP half here.
 *
 * Design: everything is enqueued on one stream with no host synchronisation, so the whole layer
 * can be captured into a CUDA graph. The fused linear_qkv output is the one buffer attention works
 * in: qk-layernorm and RoPE update the q/k heads in place, and the attention kernel reads q, k and
 * v (GQA: the group's head by index) from it directly, so no split/transpose copies exist. The
 * linear_qkv bias is fused into the GEMM epilogue (cuBLASLt BIAS); fc1's bias is fused with the
 * activation (cuBLASLt's GELU epilogue is the tanh form, Megatron's gelu is erf); the proj/fc2
 * biases stay in the bias-dropout-add, after the tensor-parallel reduction, as in Megatron.
 * Tensor parallelism as Megatron shards: column-parallel linear_qkv (by query groups) and fc1,
 * row-parallel linear_proj and fc2 followed by all-reduce, or with sequence parallelism an
 * all-gather before the column-parallel GEMM and a reduce-scatter after the row-parallel one. */
#pragma once

#include "optimized/activations.cuh"
#include "optimized/fused_bias_dropout.cuh"
#include "optimized/layer/attention_half.cuh"
#include "optimized/linear.cuh"
#include "optimized/mlp_backward.cuh"

namespace twin::opt::TWIN_BACKEND {

// The dense MLP half: linear_fc1, activation, linear_fc2, mlp_bda.
inline void dense_mlp_forward_impl(const RankPlan& p, cudaStream_t st) {
  const DType dt = p.dt;
  const std::int64_t n_local = std::int64_t(p.s_local()) * p.b, n_full = std::int64_t(p.s) * p.b;
  auto tap = [&](TapPoint t) {
    if (p.on_tap) p.on_tap(t);
  };
  const std::uint64_t element_base = tensor_parallel(p).element_base(n_full, p.h);
  // ---- mlp: linear_fc1 (column parallel), bias + activation (+ GLU) fused, linear_fc2 (row parallel)
  const int f_l = p.ffn_local();
  const std::int64_t fc1_w = (p.glu ? 2 : 1) * std::int64_t(f_l);
  linear_forward(dt, p.sp ? p.ln2_full : p.ln2, p.fc1_w, nullptr, p.fc1, n_full, p.h, fc1_w, st);  // [s, b, fc1_w]
  tap(TapPoint::LinearFc1);
  bias_activation_forward(dt, p.fc1, p.fc1_b, p.act_out, n_full, f_l, p.act, p.glu,
                          st);                                                        // [s, b, f_l]
  row_parallel_linear_forward(p, p.act_out, p.fc2_w, f_l, p.fc2_partial, p.fc2, st);  // [s_local, b, h]
  tap(TapPoint::LinearFc2);

  // ---- mlp_bda: out = h1 + dropout(fc2 + bias)           // [s_local, b, h]
  bias_dropout_add_forward(dt, p.fc2, p.fc2_b, p.post_ln_residual ? p.ln2 : p.h1, p.out, n_local, p.h,
                           DropoutArgs::make(p.hidden_dropout, p.training, p.seed, p.offset_mlp_bda), element_base, st);
}

inline void rank_forward_impl(const RankPlan& p, cudaStream_t st) {
  attention_forward_impl(p, st);
  dense_mlp_forward_impl(p, st);
}

// ---- backward ------------------------------------------------------------------------------------
// The dense layer's backward on one rank: mlp_half_backward from the output's gradient to d h1,
// then attention_half_backward from d h1 to the input's gradient, each on the forward's kept
// buffers (x, ln1 (SP: all-gathered), qkv after RoPE, ctx, h1, ln2 (SP: all-gathered), fc1 before
// its bias, act_out; the softmax statistics), with the tensor-parallel collectives the forward's
// duals (tensor_parallel/layers.py).

inline MlpHalfBackward mlp_half_backward_args(const RankPlan& p, const RankGrads& g) {
  MlpHalfBackward m;
  m.dt = p.dt;
  m.n = std::int64_t(p.s) * p.b;
  m.h = p.h;
  m.ffn = p.ffn_local();
  m.glu = p.glu;
  m.rms = p.rms;
  m.zero_centered_gamma = p.zero_centered_gamma;
  m.act = p.act;
  m.eps = p.eps;
  m.drop = DropoutArgs::make(p.hidden_dropout, p.training, p.seed, p.offset_mlp_bda);
  m.tp = tensor_parallel(p);
  m.hidden = p.h1;
  m.ln2 = p.ln2_full;
  m.fc1 = p.fc1;
  m.act_out = p.act_out;
  m.ln2_w = p.ln2_w;
  m.fc1_w = p.fc1_w;
  m.fc1_b = p.fc1_b;
  m.fc2_w = p.fc2_w;
  m.fc2_bias = p.fc2_b != nullptr;
  m.dout = g.dout;
  m.dhidden = g.dh1;
  m.d_ln2_w = g.ln2_w;
  m.d_ln2_b = g.ln2_b;
  m.d_fc1_w = g.fc1_w;
  m.d_fc1_b = g.fc1_b;
  m.d_fc2_w = g.fc2_w;
  m.d_fc2_b = g.fc2_b;
  m.d_mlp = g.d_mlp;
  m.d_act = g.d_act;
  m.d_fc1 = g.d_fc1;
  m.d_ln2 = g.d_ln2;
  m.d_ln2_partial = g.d_ln2_partial;
  m.d_mlp_full = g.d_mlp_full;
  m.workspace = g.workspace;
  m.workspace_bytes = g.workspace_bytes;
  return m;
}

inline std::size_t rank_backward_workspace_bytes_impl(const RankPlan& p) {
  const RankGrads none;
  return std::max(mlp_half_backward_workspace_bytes(p.rms, std::int64_t(p.s) * p.b, p.h, p.ffn_local(), p.glu),
                  attention_half_backward_workspace_bytes(attention_half_backward_args(p, none)));
}

inline void rank_backward_impl(const RankPlan& p, const RankGrads& g, cudaStream_t st) {
  mlp_half_backward(mlp_half_backward_args(p, g), st);
  attention_half_backward(attention_half_backward_args(p, g), st);
}

}  // namespace twin::opt::TWIN_BACKEND
