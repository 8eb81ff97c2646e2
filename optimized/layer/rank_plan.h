// The work of one tensor-parallel rank of a layer with an attention half, as plain numbers and
// device pointers (no host tensors, no Eigen), so the same struct crosses from the host side
// (compiled once) into the per-backend kernel sequences (compiled once for the simulator and once
// by nvcc; called through layer/kernels.h). The attention half's fields are filled by
// layer/attention_half.h for the dense and the MoE layer (the MoE plan holds one); the MLP's are
// the dense layer's (transformer_layer.cpp), as is the backward's RankGrads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

#include <cuda_runtime_api.h>

#include "core/dtype.h"
#include "optimized/layer/kernel_args.h"  // MlaShape, MlaActivations, MlaGradScratch

namespace twin::rt {
class Communicator;
}

namespace twin::opt {

// Where the rank's forward has just produced a tensor a tap names (the host downloads it there).
enum class TapPoint {
  InputLayernorm,
  LinearQkv,
  QkLayernorm,
  // multi-latent attention's, in its order (the q path, then the kv path)
  MlaRotaryPosEmb,
  MlaQDownProj,
  MlaQLayernorm,
  MlaQUpProj,
  MlaKvDownProj,
  MlaKvLayernorm,
  MlaKvUpProj,
  CoreAttention,
  LinearProj,
  PreMlpLayernorm,
  LinearFc1,
  LinearFc2
};

struct RankPlan {
  // ---- shape (full layer) and this rank
  int s = 0, b = 0, h = 0;
  int np = 0, ng = 0, hn = 0, ffn = 0;
  int tp = 1, rank = 0;
  bool sp = false;
  int s_local() const { return sp ? s / tp : s; }
  int np_local() const { return np / tp; }
  int ng_local() const { return ng / tp; }
  int ffn_local() const { return ffn / tp; }
  int hpg() const { return np / ng; }
  std::int64_t qkv_width() const { return mla.on ? 0 : std::int64_t(ng_local()) * (hpg() + 2) * hn; }
  // linear_proj's input per token: this rank's heads' core-attention outputs
  std::int64_t ctx_width() const { return std::int64_t(np_local()) * (mla.on ? mla.v : hn); }

  // ---- numerics
  DType dt = DType::F32;
  bool rms = false;
  double eps = 1e-5;
  bool zero_centered_gamma = false;
  bool qk_layernorm = false;  // with MLA: its q_layernorm and kv_layernorm
  MlaShape mla;               // on: multi-latent attention (hn = mla.q_head(), ng = np; no linear_qkv)
  bool glu = false;
  Act act = Act::Gelu;
  bool post_ln_residual = false;  // apply_residual_connection_post_layernorm
  int rot_dim = 0;                // 0: no RoPE
  bool rope_interleaved = false;
  MaskMode mask_mode = MaskMode::None;
  int mask_b = 1, mask_h = 1;
  float alpha = 1.0f, coeff = 0.0f;
  bool softmax_fp32 = true;
  // dropout
  bool training = false;
  double hidden_dropout = 0.0, attention_dropout = 0.0;
  std::uint64_t seed = 0;
  std::uint64_t offset_attention = 0, offset_self_attn_bda = 0, offset_mlp_bda = 0;

  // ---- weights (this rank's shards, dt; biases may be null)
  const void* ln1_w = nullptr;
  const void* ln1_b = nullptr;  // [h]
  const void* qkv_w = nullptr;
  const void* qkv_b = nullptr;  // [qkv_width, h], [qkv_width]
  const void* qln_w = nullptr;
  const void* qln_b = nullptr;  // [hn]
  const void* kln_w = nullptr;
  const void* kln_b = nullptr;      // [hn]
  const void* q_down_w = nullptr;   // MLA: [q_lora, h] linear_q_down_proj (whole on every rank)
  const void* q_up_w = nullptr;     // MLA: [np_local * q_head, q_lora] linear_q_up_proj (or linear_q_proj's [.., h])
  const void* kv_down_w = nullptr;  // MLA: [kv_width, h] linear_kv_down_proj (whole on every rank)
  const void* kv_up_w = nullptr;    // MLA: [np_local * (qk + v), kv_lora] linear_kv_up_proj
  const void* proj_w = nullptr;
  const void* proj_b = nullptr;  // [h, ctx_width], [h] (full bias)
  const void* ln2_w = nullptr;
  const void* ln2_b = nullptr;  // [h]
  const void* fc1_w = nullptr;
  const void* fc1_b = nullptr;  // [(glu ? 2 : 1) * ffn_local, h]
  const void* fc2_w = nullptr;
  const void* fc2_b = nullptr;  // [h, ffn_local], [h] (full bias)

  // ---- inputs and activations (device)
  const void* x = nullptr;             // [s_local, b, h]
  const float* freqs = nullptr;        // [s, rot_dim]
  const std::uint8_t* mask = nullptr;  // [mask_b, mask_h, s, s]
  void* ln1 = nullptr;                 // [s_local, b, h]
  void* ln1_full = nullptr;            // [s, b, h] (SP: all-gathered; else = ln1)
  void* qkv = nullptr;                 // [s, b, qkv_width]
  void* ctx = nullptr;                 // [s, b, ctx_width]
  MlaActivations mla_acts;             // MLA's (in place of qkv)
  void* proj_partial = nullptr;        // [s, b, h]
  void* proj = nullptr;                // [s_local, b, h] (reduced)
  void* h1 = nullptr;                  // [s_local, b, h] (after self_attn_bda)
  void* ln2 = nullptr;                 // [s_local, b, h]
  void* ln2_full = nullptr;            // [s, b, h]
  void* fc1 = nullptr;                 // [s, b, (glu ? 2 : 1) * ffn_local]
  void* act_out = nullptr;             // [s, b, ffn_local]
  void* fc2_partial = nullptr;         // [s, b, h]
  void* fc2 = nullptr;                 // [s_local, b, h]
  void* out = nullptr;                 // [s_local, b, h]
  float* softmax_stats = nullptr;      // [b, np_local, s, 2] the attention's row max and sum, kept for
                                       // the backward (null: not kept)
  void* qkv_pre_norm = nullptr;        // [s, b, qkv_width] linear_qkv's output before qk-layernorm
                                       // (which works in place), kept for the norms' backward (null: not kept)

  rt::Communicator* comm = nullptr;      // tp > 1
  std::function<void(TapPoint)> on_tap;  // null: no taps (required for graph capture)
};

// The dense layer's backward on one rank (transformer_layer.cuh rank_backward_impl), after a
// forward that kept its softmax statistics: the gradient of the layer's output in, the gradients of
// its input and of every parameter out (named as RankPlan's weights, shaped as the rank's shards;
// null where the parameter is absent), all in the params dtype. n = s * b, n_local = s_local * b.
// The scratch gradients between the ops stay readable after the run (the host reads them for the
// parameter grads' magnitudes).
struct RankGrads {
  const void* dout = nullptr;  // [n_local, h]
  void* dx = nullptr;          // [n_local, h]
  void *ln1_w = nullptr, *ln1_b = nullptr, *qkv_w = nullptr, *qkv_b = nullptr, *proj_w = nullptr, *proj_b = nullptr;
  void *qln_w = nullptr, *qln_b = nullptr, *kln_w = nullptr,
       *kln_b = nullptr;  // qk-layernorm's (MLA: q/kv_layernorm's)
  // MLA's projections: the down projections' this rank's rows, the up projections' its heads
  void *q_down_w = nullptr, *q_up_w = nullptr, *kv_down_w = nullptr, *kv_up_w = nullptr;
  void *ln2_w = nullptr, *ln2_b = nullptr, *fc1_w = nullptr, *fc1_b = nullptr, *fc2_w = nullptr, *fc2_b = nullptr;
  // scratch
  void* dh1 = nullptr;            // [n_local, h] d h1, the attention half's output
  void* d_mlp = nullptr;          // [n_local, h] d linear_fc2 output
  void* d_mlp_full = nullptr;     // [n, h] SP: d_mlp all-gathered (else null)
  void* d_act = nullptr;          // [n, ffn_local]
  void* d_fc1 = nullptr;          // [n, (glu ? 2 : 1) * ffn_local] d linear_fc1 output
  void* d_ln2_partial = nullptr;  // [n, h] tp > 1: this rank's part of d ln2 (else null)
  void* d_ln2 = nullptr;          // [n_local, h]
  void* d_proj = nullptr;         // [n_local, h] d linear_proj output
  void* d_proj_full = nullptr;    // [n, h] SP: d_proj all-gathered (else null)
  void* d_ctx = nullptr;          // [n, ctx_width]
  MlaGradScratch mla;             // MLA's (in place of d_qkv and d_qkv_pre)
  void* d_qkv = nullptr;          // [n, qkv_width] d of core attention's q, k, v (after RoPE's backward)
  void* d_qkv_pre = nullptr;      // [n, qkv_width] d linear_qkv output (after qk-layernorm's backward)
  void* d_ln1_partial = nullptr;  // [n, h] tp > 1: this rank's part of d ln1 (else null)
  void* d_ln1 = nullptr;          // [n_local, h]
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
};

}  // namespace twin::opt
