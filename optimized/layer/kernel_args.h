// The arguments host code hands the kernels' launchers, as plain types shared by both backends
// (the launchers in twin::opt::sim / ::cuda take these very types), so a layer's host side is
// compiled once and calls either backend's launchers through layer/kernels.h. The kernels read
// the members marked TWIN_HOST_DEVICE on the device too.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "core/dtype.h"
#include "optimized/layer/kernel_types.h"  // MaskMode, Act

#if defined(__CUDACC__)
#define TWIN_HOST_DEVICE __host__ __device__
#else
#define TWIN_HOST_DEVICE
#endif

namespace twin::rt {
class Communicator;
}

namespace twin::opt {

// ---- dropout (philox.cuh) -------------------------------------------------------------------

// The keep threshold of reference::dropout_keep_threshold: ceil((1 - p) 2^24) in double, p in [0, 1].
inline std::uint32_t dropout_threshold(double p) {
  if (!(p >= 0.0 && p <= 1.0))
    throw std::invalid_argument("dropout probability must be in [0, 1], got " + std::to_string(p));
  double t = (1.0 - p) * 16777216.0;
  std::uint32_t i = static_cast<std::uint32_t>(t);
  if (static_cast<double>(i) < t) ++i;  // ceil
  return i;
}

// One dropout call: active when training with p > 0. Elements are numbered globally (flat index
// of the whole unsharded tensor), so TP/SP ranks draw the same mask as TP = 1.
struct DropoutArgs {
  bool active = false;
  std::uint64_t seed = 0;
  std::uint64_t offset = 0;
  std::uint32_t threshold = 0;
  double scale = 1.0;  // 1 / (1 - p) in double: the product x * scale rounds once to fp32, as the reference's
  static DropoutArgs make(double p, bool training, std::uint64_t seed, std::uint64_t offset) {
    DropoutArgs d;
    d.threshold = dropout_threshold(p);
    d.active = training && p > 0.0;
    d.seed = seed;
    d.offset = offset;
    d.scale = p == 1.0 ? 0.0 : 1.0 / (1.0 - p);
    return d;
  }
};

// ---- norms (torch_norm.cuh) -----------------------------------------------------------------

// Row r starts at (r / rows_per_chunk) * chunk_stride + (r % rows_per_chunk) * row_stride
// elements from the base pointer and holds `width` contiguous elements.
struct NormRows {
  std::int64_t n_rows = 0;
  int width = 0;
  std::int64_t rows_per_chunk = 1;
  std::int64_t chunk_stride = 0;
  std::int64_t row_stride = 0;
  TWIN_HOST_DEVICE std::int64_t offset(std::int64_t r) const {
    return (r / rows_per_chunk) * chunk_stride + (r % rows_per_chunk) * row_stride;
  }
  static NormRows dense(std::int64_t n_rows, int width) { return NormRows{n_rows, width, 1, width, 0}; }
};

// ---- core attention (dot_product_attention*.cuh) --------------------------------------------

// Where q, k and v live inside the fused linear_qkv output [s, b, ng_local, (hpg + 2) * hn]:
// token t = s_idx * b + b_idx; q of local head h at t * ld + (h / hpg) * group_stride + (h % hpg) * hn;
// k of local group g at t * ld + g * group_stride + hpg * hn; v right after k.
struct QkvLayout {
  std::int64_t ld = 0;            // elements per token
  std::int64_t group_stride = 0;  // (hpg + 2) * hn
  int hpg = 1;                    // query heads per group
};

// Separate query and key/value layouts (cross attention, Retro's chunks and neighbours): query
// head h of batch column bi at query position i is at
//   q + i * q_tok + bi * q_batch + (h / hpg) * q_group + (h % hpg) * q_head,
// key / value of group g at key position j at k / v + j * kv_tok + bi * kv_batch + g * kv_group.
// Each tensor is read in place by index: a strided batch column (a neighbour's rows inside the
// [r, bs*l*k] layout) costs no copy.
struct AttnOperands {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  std::int64_t q_tok = 0, q_batch = 0, q_group = 0, q_head = 0;
  int hpg = 1;
  std::int64_t kv_tok = 0, kv_batch = 0, kv_group = 0;
  // The fused linear_qkv output of a self attention (QkvLayout) as operands.
  static AttnOperands from_qkv(const void* qkv, const QkvLayout& lay, int b, int hn, std::size_t elem_bytes) {
    AttnOperands o;
    const char* base = static_cast<const char*>(qkv);
    o.q = base;
    o.k = base + std::size_t(lay.hpg) * hn * elem_bytes;
    o.v = base + std::size_t(lay.hpg + 1) * hn * elem_bytes;
    o.q_tok = o.kv_tok = std::int64_t(b) * lay.ld;
    o.q_batch = o.kv_batch = lay.ld;
    o.q_group = o.kv_group = lay.group_stride;
    o.q_head = hn;
    o.hpg = lay.hpg;
    return o;
  }
  // A cross attention's (Megatron's CrossAttention: linear_q, linear_kv) read in place: queries q
  // [sq, N, q_tok / N] with this rank's heads (D = np_l * hn columns) starting at column 0 of q's
  // pointer, keys and values interleaved per head in the linear_kv output kv [sk, N, np_l * 2hn].
  // One head per group.
  static AttnOperands from_q_kv(const void* q, std::int64_t q_tok, const void* kv, std::int64_t N, std::int64_t D,
                                int hn, std::size_t elem_bytes) {
    AttnOperands o;
    o.q = q;
    o.q_tok = q_tok;
    o.q_batch = q_tok / N;
    o.q_group = o.q_head = hn;
    o.hpg = 1;
    o.k = kv;
    o.v = static_cast<const char*>(kv) + std::size_t(hn) * elem_bytes;
    o.kv_tok = N * 2 * D;
    o.kv_batch = 2 * D;
    o.kv_group = 2 * hn;
    return o;
  }
};

// Where dq, dk and dv go: the strides of the AttnOperands they are the gradients of (dq of query head
// h where its q is, dk / dv of group g where its k / v are), so the grads of a self attention land in
// a d_qkv buffer of the fused linear_qkv layout, ready for linear_qkv's backward.
struct AttnGradOperands {
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  // The grad of a fused linear_qkv output (d_qkv, laid out as AttnOperands::from_qkv's qkv).
  static AttnGradOperands from_qkv(void* dqkv, const QkvLayout& lay, int hn, std::size_t elem_bytes) {
    AttnGradOperands g;
    char* base = static_cast<char*>(dqkv);
    g.dq = base;
    g.dk = base + std::size_t(lay.hpg) * hn * elem_bytes;
    g.dv = base + std::size_t(lay.hpg + 1) * hn * elem_bytes;
    return g;
  }
  // The grads of AttnOperands::from_q_kv's operands: dq where q is (its strides), dk and dv
  // interleaved per head in dkv, laid out as the linear_kv output kv.
  static AttnGradOperands from_q_kv(void* dq, void* dkv, int hn, std::size_t elem_bytes) {
    AttnGradOperands g;
    g.dq = dq;
    g.dk = dkv;
    g.dv = static_cast<char*>(dkv) + std::size_t(hn) * elem_bytes;
    return g;
  }
};

struct AttnParams {
  int sq = 0, sk = 0, b = 0;
  int np_local = 0;     // heads on this rank
  int np_total = 0;     // heads of the layer (mask head dim, dropout numbering)
  int head_offset = 0;  // global index of local head 0
  int hn = 0;
  float alpha = 1.0f;        // softmax_scale (already divided by coeff)
  float coeff = 0.0f;        // apply_query_key_layer_scaling: layer_number; 0 when off
  bool softmax_fp32 = true;  // softmax input/output in fp32 (attention_softmax_in_fp32 for bf16/fp16)
  MaskMode mask = MaskMode::None;
  const std::uint8_t* mask_ptr = nullptr;  // [mask_b, mask_h, sq, sk], nonzero = masked
  int mask_b = 1, mask_h = 1;
  DropoutArgs drop;  // attention dropout over the flat [b, np_total, sq, sk] probabilities
  // [b, np_local, sq, 2]: each row's online max m and sum l of exp(s - m) after pass 1 (what pass 2
  // divides by), written by the forward when not null; the backward recomputes the probabilities
  // from them. Null: not saved (the forward's output is the same either way).
  float* softmax_stats = nullptr;
};

// ---- Retro's reshuffles (retro/retro_kernels.cuh) --------------------------------------------

enum class RetroMap : int {
  ChunkEncoderContext,   // [ns, bs] -> [m, N]: first ns % m tokens right-padded into chunk 0
  PadAttendingChunks,    // [ns, bs] -> [m, N]: tokens from pad = (ns - 1) % m, right-padded to l*m
  UnchunkDecoderOutput,  // [m, N] -> [ns, bs]: pad zero rows prepended, cut to ns
  SplitNeighbors,        // [r, N*k] -> [r, N] of neighbour n (column j*k + n)
  StackNeighbors,        // k parts [r, N] one after another -> [r, k*N] (column n*N + j)
};

struct RetroMapArgs {
  RetroMap map = RetroMap::ChunkEncoderContext;
  std::int64_t ns = 0, bs = 0, m = 1, l = 0, pad = 0;  // chunking
  std::int64_t r = 0, N = 0, k = 1, n = 0;             // neighbours
  // Rows of the map's output.
  TWIN_HOST_DEVICE std::int64_t out_rows() const {
    switch (map) {
      case RetroMap::ChunkEncoderContext:
      case RetroMap::PadAttendingChunks:
        return m * bs * l;
      case RetroMap::UnchunkDecoderOutput:
        return ns * bs;
      case RetroMap::SplitNeighbors:
        return r * N;
      case RetroMap::StackNeighbors:
        return r * k * N;
    }
    return 0;
  }
};

// ---- tensor parallelism (tensor_parallel/layers.py and mappings.py; linear.cuh's collectives) --

// One rank's place among the tensor-parallel ranks. A sum over the ranks is counted as size - 1 stores: the
// threaded group adds rank by rank in a fixed order, rounding to T after each addition (NCCL
// rounds per hop likewise).
struct TensorParallel {
  int size = 1, rank = 0;
  bool sp = false;                   // sequence parallelism: [s, b, h] tensors split by s over the ranks
  rt::Communicator* comm = nullptr;  // size > 1
  std::int64_t rows_local(std::int64_t rows) const { return sp ? rows / size : rows; }
  // The first element of this rank's slice of a [rows, cols] tensor split by rows (dropout's
  // Philox counter continues across the ranks' slices as over the full tensor).
  std::uint64_t element_base(std::int64_t rows, std::int64_t cols) const {
    return sp ? std::uint64_t(rank) * std::uint64_t(rows_local(rows)) * std::uint64_t(cols) : 0;
  }
};

// ---- multi-latent attention (layer/mla_attention.cuh) ----------------------------------------

// MLASelfAttention's numbers on one tensor-parallel rank (on: the layer's self attention is MLA,
// in place of linear_qkv and its q/k-layernorms; the core attention's head dim is q_head()).
struct MlaShape {
  bool on = false;
  int q_lora = 0;  // q_lora_rank; 0: linear_q_proj, no down projection
  int kv_lora = 0, qk = 0, pe = 0, v = 0;
  float rope_mscale = 1.0f;  // the RoPE's concentration factor (YaRN's; 1 for plain RoPE)
  bool yarn = false;         // rope_type "yarn" (its module returns (angles, mscale): taps name .0)
  int q_head() const { return qk + pe; }
  int kv_width() const { return kv_lora + pe; }  // linear_kv_down_proj's output
};

// Its activations on one rank of np_l heads, n = s * b tokens. The down projections' outputs and
// the latent norms are whole on every rank (the values Megatron's column-parallel down projection
// and its all-gather give), the up projections' this rank's heads.
struct MlaActivations {
  void* q_compressed = nullptr;  // [n, q_lora] linear_q_down_proj's output, q_layernorm's input
  void* q_normed = nullptr;      // [n, q_lora] q_layernorm's output (= q_compressed without it)
  void* kv_combined = nullptr;   // [n, kv_width] linear_kv_down_proj's output; its last pe columns
                                 // (k_pos_emb) rotated in place once the taps have read them
  void* kv_normed = nullptr;     // [n, kv_width] kv_layernorm's output in the first kv_lora columns
                                 // (= kv_combined without it)
  void* query = nullptr;         // [n, np_l, q_head] the q projection's output, its last pe channels rotated
  void* kv = nullptr;            // [n, np_l, qk + v] linear_kv_up_proj's output
  void* key_value = nullptr;     // [n, np_l, 2 q_head] the core attention's key | value (zero-padded)
  void* context = nullptr;       // [n, np_l, q_head] the core attention's output over the padded value
};

// Its backward's scratch (each null where the layer has no such step).
struct MlaGradScratch {
  void* d_context = nullptr;       // [n, np_l, q_head] d context, zero past v
  void* d_query = nullptr;         // [n, np_l, q_head] d of the q projection's output (after RoPE's backward)
  void* d_key_value = nullptr;     // [n, np_l, 2 q_head]
  void* d_kv = nullptr;            // [n, np_l, qk + v] d linear_kv_up_proj's output
  void* d_q_normed = nullptr;      // [n, q_lora] d linear_q_up_proj's input (summed over the ranks)
  void* d_q_compressed = nullptr;  // [n, q_lora] d linear_q_down_proj's output (= d_q_normed without q_layernorm)
  void* d_kv_latent = nullptr;     // [n, kv_width] d kv_normed | d k_pos_emb (summed over the ranks)
  void* d_kv_combined = nullptr;   // [n, kv_width] d linear_kv_down_proj's output (= d_kv_latent without kv_layernorm)
};

// ---- the attention and MLP halves' backward (attention_backward.cuh, mlp_backward.cuh) -----

struct AttentionHalfBackward {
  DType dt = DType::F32;
  int s = 0, b = 0, h = 0;
  int np = 0, ng = 0, hn = 0;
  bool rms = false, zero_centered_gamma = false;
  double eps = 1e-5;
  int rot_dim = 0;  // 0: no RoPE
  bool rope_interleaved = false;
  const float* freqs = nullptr;  // [s, rot_dim] fp32 angles (with RoPE)
  AttnParams attn;               // the forward's core attention (mask, scale, attention dropout)
  DropoutArgs drop;              // the forward's self_attn_bda dropout
  TensorParallel tp;             // np and ng are this rank's heads and groups
  bool qk_layernorm = false;
  bool post_ln_residual = false;  // refused (checked here so no caller forgets)
  MlaShape mla;                   // on: MLA's self attention (hn = mla.q_head(), ng = np)
  // The forward's saved tensors.
  const void* x = nullptr;               // [n_local, h] input_layernorm's input (the layer's input)
  const void* ln1 = nullptr;             // [n, h] its output (with SP all-gathered), linear_qkv's input
  const void* qkv = nullptr;             // [n, qw] linear_qkv's output after RoPE (core attention's q, k, v)
  const void* qkv_pre_norm = nullptr;    // [n, qw] linear_qkv's output before qk-layernorm (with it)
  const void* ctx = nullptr;             // [n, ctx_width] core attention's output, linear_proj's input
  const float* softmax_stats = nullptr;  // [b, np, s, 2] the forward's row max and sum
  // Parameters (biases null when the layer has none).
  const void *ln1_w = nullptr, *qkv_w = nullptr, *qkv_b = nullptr, *proj_w = nullptr;
  const void *qln_w = nullptr, *qln_b = nullptr, *kln_w = nullptr, *kln_b = nullptr;  // with qk_layernorm
  // MLA's (q_layernorm / kv_layernorm in qln / kln): the down projections whole, the up
  // projections this rank's heads; q_up_w is linear_q_proj's without q_lora.
  const void *q_down_w = nullptr, *q_up_w = nullptr, *kv_down_w = nullptr, *kv_up_w = nullptr;
  MlaActivations mla_acts;
  bool proj_bias = false;
  // Gradients: dh1 in, the rest out (param grads null where the parameter is absent).
  const void* dh1 = nullptr;  // [n_local, h]
  void* dx = nullptr;         // [n_local, h]
  void *d_ln1_w = nullptr, *d_ln1_b = nullptr, *d_qkv_w = nullptr, *d_qkv_b = nullptr, *d_proj_w = nullptr,
       *d_proj_b = nullptr;
  void *d_qln_w = nullptr, *d_qln_b = nullptr, *d_kln_w = nullptr, *d_kln_b = nullptr;  // with qk_layernorm
  // MLA's: the down projections' this rank's rows (Megatron's column-parallel shard), the up
  // projections' this rank's heads.
  void *d_q_down_w = nullptr, *d_q_up_w = nullptr, *d_kv_down_w = nullptr, *d_kv_up_w = nullptr;
  MlaGradScratch d_mla;
  // Scratch in dt: d proj [n_local, h], d ctx [n, ctx_width], d qkv [n, qw], d qkv_pre [n, qw] (with
  // qk_layernorm), d ln1 [n_local, h]; at tp > 1 d ln1_partial [n, h] (this rank's part of d ln1)
  // and with SP d proj_full [n, h]; `workspace` as attention_half_backward_workspace_bytes says.
  void *d_proj = nullptr, *d_ctx = nullptr, *d_qkv = nullptr, *d_qkv_pre = nullptr, *d_ln1 = nullptr;
  void *d_ln1_partial = nullptr, *d_proj_full = nullptr;
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;

  std::int64_t n() const { return std::int64_t(s) * b; }
  std::int64_t n_local() const { return tp.rows_local(n()); }
  int hpg() const { return np / ng; }
  std::int64_t qkv_width() const { return mla.on ? 0 : std::int64_t(ng) * (hpg() + 2) * hn; }
  std::int64_t ctx_width() const { return std::int64_t(np) * (mla.on ? mla.v : hn); }  // linear_proj's input
  QkvLayout layout() const { return QkvLayout{qkv_width(), std::int64_t(hpg() + 2) * hn, hpg()}; }
  // The q rows and the k rows of the fused layout, as the forward's qk-layernorm and RoPE address them.
  NormRows q_rows() const { return NormRows{n() * ng * hpg(), hn, hpg(), std::int64_t(hpg() + 2) * hn, hn}; }
  NormRows k_rows() const { return NormRows{n() * ng, hn, 1, std::int64_t(hpg() + 2) * hn, 0}; }
  std::size_t k_offset_bytes() const { return std::size_t(hpg()) * hn * dtype_size(dt); }
};

struct MlpHalfBackward {
  DType dt = DType::F32;
  std::int64_t n = 0;  // tokens: s * b (all the ranks' rows)
  int h = 0, ffn = 0;  // ffn: this rank's columns (ffn_hidden_size / tp)
  bool glu = false, rms = false, zero_centered_gamma = false;
  Act act = Act::Gelu;
  double eps = 1e-5;
  DropoutArgs drop;  // the forward's mlp_bda dropout
  TensorParallel tp;
  // The forward's saved tensors.
  const void* hidden = nullptr;   // [n_local, h] pre_mlp_layernorm's input
  const void* ln2 = nullptr;      // [n, h] its output (with SP all-gathered), linear_fc1's input
  const void* fc1 = nullptr;      // [n, w] linear_fc1's GEMM output before its bias (w = glu ? 2 ffn : ffn)
  const void* act_out = nullptr;  // [n, ffn] linear_fc2's input
  // Parameters: this rank's shards (biases null when the layer has none).
  const void *ln2_w = nullptr, *fc1_w = nullptr, *fc1_b = nullptr, *fc2_w = nullptr;
  bool fc2_bias = false;
  // Gradients: dout in, the rest out (param grads null where the parameter is absent; shaped as
  // the rank's shards).
  const void* dout = nullptr;  // [n_local, h]
  void* dhidden = nullptr;     // [n_local, h]
  void *d_ln2_w = nullptr, *d_ln2_b = nullptr, *d_fc1_w = nullptr, *d_fc1_b = nullptr, *d_fc2_w = nullptr,
       *d_fc2_b = nullptr;
  // Scratch in dt: d mlp [n_local, h], d act [n, ffn], d fc1 [n, w], d ln2 [n_local, h]; at tp > 1
  // d ln2_partial [n, h] (this rank's part of d ln2) and with SP d mlp_full [n, h]; `workspace` as
  // mlp_half_backward_workspace_bytes says.
  void *d_mlp = nullptr, *d_act = nullptr, *d_fc1 = nullptr, *d_ln2 = nullptr;
  void *d_ln2_partial = nullptr, *d_mlp_full = nullptr;
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
};

}  // namespace twin::opt
