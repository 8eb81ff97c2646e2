// The arguments host code hands the kernels' launchers, as plain types shared by both backends
// (the launchers in twin::opt::sim / ::cuda take these very types), so a layer's host side is
// compiled once and calls either backend's launchers through layer/kernels.h. The kernels read
// the members marked TWIN_HOST_DEVICE on the device too.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "optimized/layer/kernel_types.h"  // MaskMode

#if defined(__CUDACC__)
#define TWIN_HOST_DEVICE __host__ __device__
#else
#define TWIN_HOST_DEVICE
#endif

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

}  // namespace twin::opt
