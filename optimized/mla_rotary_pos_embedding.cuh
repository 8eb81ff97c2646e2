/* Multi-latent attention's rotary position embedding (reference/multi_latent_attention.cpp mla_rope;
 * Megatron's rope_utils.py _apply_rotary_pos_emb_bshd with multi_latent_attention, the unfused
 * path): the rotated part's (the first rot of each row's pe channels; rot < pe when RoPE's
 * rotary_percent < 1) even then odd channels (t[..., 0::2] | t[..., 1::2]) rotated by halves
 * with cos_ = (cos(f) * mscale).to(T), sin_ likewise (mscale: YaRN's concentration factor, 1 for
 * plain RoPE), the other channels passing. For pair i (angles f = cat(freqs, freqs), rot of them):
 *   out[i]           = x[2i] cos_[i] - x[2i + 1] sin_[i]
 *   out[i + rot / 2] = x[2i + 1] cos_[i + rot/2] + x[2i] sin_[i + rot/2]
 * each product and the sum stored in T, as torch's unfused ops do.
 * Backward (mla_rope_backward): the non-interleaved RoPE's backward, then the reorder's transpose:
 *   d x[2i]     = d out[i] cos_[i] + d out[i + rot/2] sin_[i + rot/2]
 *   d x[2i + 1] = d out[i + rot/2] cos_[i + rot/2] - d out[i] sin_[i]
 *
 * Design: in place on rows addressed by NormRows (the q heads' last pe channels inside the q
 * projection's output; k_pos_emb, the last pe columns of linear_kv_down_proj's output), one thread
 * per row: the reorder moves channels between pairs, so a thread reads its whole row before
 * writing it. */
#pragma once

#include "torch_norm.cuh"  // NormRows

namespace twin::opt::TWIN_BACKEND {

constexpr int kMlaMaxRopeDim = kMaxHeadDim;

// cos_ and sin_ of angle f as the unfused path stores them: fp32 cos / sin, times mscale in fp32,
// stored in T.
template <class T>
__device__ inline void mla_rope_tables(float f, float mscale, float& c, float& s) {
  c = round_to<T>(cosf(f) * mscale);  // rounds: (cos * mscale) in fp32, .to(T)
  s = round_to<T>(sinf(f) * mscale);
}

// One thread per row: the row's rotated channels read, then each pair written (forward: x[2i],
// x[2i + 1] to out[i], out[i + rot/2]; backward: d out[i], d out[i + rot/2] to d x[2i], d x[2i + 1]).
template <class T, bool Backward>
__global__ void mla_rotary_pos_emb_kernel(T* t, const float* freqs, NormRows rows, std::int64_t rows_per_position,
                                          int rot, float mscale) {
  const int half = rot / 2;
  for (std::int64_t r = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; r < rows.n_rows;
       r += std::int64_t(gridDim.x) * blockDim.x) {
    T* row = t + rows.offset(r);
    const float* f = freqs + (r / rows_per_position) * rot;  // [rot]
    float v[kMlaMaxRopeDim];
    for (int c = 0; c < rot; ++c) v[c] = Io<T>::load(row[c]);
    for (int i = 0; i < half; ++i) {
      float cos0, sin0, cos1, sin1;
      mla_rope_tables<T>(f[i], mscale, cos0, sin0);
      mla_rope_tables<T>(f[i + half], mscale, cos1, sin1);
      if (!Backward) {
        const float x0 = v[2 * i], x1 = v[2 * i + 1];                       // the reorder: even, then odd channels
        const float y0 = round_to<T>(x0 * cos0) + round_to<T>(-x1 * sin0);  // rounds: t * cos_, rotate_half(t) * sin_
        const float y1 = round_to<T>(x1 * cos1) + round_to<T>(x0 * sin1);
        row[i] = Io<T>::store(y0);  // rounds: sum, T
        row[i + half] = Io<T>::store(y1);
      } else {
        const float g0 = v[i], g1 = v[i + half];
        const float d0 = round_to<T>(g0 * cos0) + round_to<T>(g1 * sin1);  // rounds: mul's grads
        const float d1 = round_to<T>(g1 * cos1) - round_to<T>(g0 * sin0);
        row[2 * i] = Io<T>::store(d0);  // rounds: the grads' sum, T; the reorder's transpose
        row[2 * i + 1] = Io<T>::store(d1);
      }
    }
  }
}

// The preconditions and the cost model both directions share: the first rot channels of each row
// rotated as one.
inline void mla_rotary_pos_emb_check(const char* op, DType dt, const void* t, const float* freqs, const NormRows& rows,
                                     std::int64_t rows_per_position, int rot) {
  require(rot > 0 && rot % 2 == 0 && rot <= kMlaMaxRopeDim && rot <= rows.width,
          std::string(op) + ": rot_dim " + std::to_string(rot) + " must be even, in (0, " +
              std::to_string(kMlaMaxRopeDim) + "] and at most the rows' width " + std::to_string(rows.width));
  require(rows_per_position > 0 && rows.n_rows % rows_per_position == 0,
          std::string(op) + ": rows_per_position must be > 0 and divide the rows");
  require(t && freqs, std::string(op) + ": null tensor");
  // cost: each row's rotated channels read and written once, the fp32 angles of each position
  // once (cos and sin computed on chip); 3 FLOPs per channel.
  rt::declare_cost(
      op, double(dtype_size(dt)) * 2.0 * rows.n_rows * rot + 4.0 * double(rows.n_rows / rows_per_position) * rot,
      3.0 * rows.n_rows * rot);
}

// t: rows addressed by `rows` (width: their channels), the first rot rotated in place; freqs
// [s, rot] fp32 angles of position r / rows_per_position.
inline void mla_rotary_pos_emb_forward(DType dt, void* t, const float* freqs, const NormRows& rows,
                                       std::int64_t rows_per_position, int rot, float mscale, cudaStream_t stream) {
  mla_rotary_pos_emb_check("mla_rotary_pos_emb_forward", dt, t, freqs, rows, rows_per_position, rot);
  // counts: (cos, sin) * mscale in fp32 where it is not 1; t * cos_, rotate_half(t) * sin_, the sum.
  if (mscale != 1.0f) rounding_store(DType::F32);
  rounding_store(dt, 3);
  if (rows.n_rows == 0) return;
  dispatch_dtype(dt, "mla_rotary_pos_emb_forward", [&](auto tag) {
    using T = decltype(tag);
    const unsigned threads = elementwise_threads(rows.n_rows);
    launch_kernel((mla_rotary_pos_emb_kernel<T, false>), dim3(elementwise_blocks(rows.n_rows, threads)), dim3(threads),
                  0, stream, static_cast<T*>(t), freqs, rows, rows_per_position, rot, mscale);
  });
}

// In place on the gradient of the rotated rows (layout and angles as the forward took them).
inline void mla_rotary_pos_emb_backward(DType dt, void* dout, const float* freqs, const NormRows& rows,
                                        std::int64_t rows_per_position, int rot, float mscale, cudaStream_t stream) {
  mla_rotary_pos_emb_check("mla_rotary_pos_emb_backward", dt, dout, freqs, rows, rows_per_position, rot);
  // counts: as the reference's backward: the mul's grads, then their sum, each stored in T.
  rounding_store(dt, 2);
  if (rows.n_rows == 0) return;
  dispatch_dtype(dt, "mla_rotary_pos_emb_backward", [&](auto tag) {
    using T = decltype(tag);
    const unsigned threads = elementwise_threads(rows.n_rows);
    launch_kernel((mla_rotary_pos_emb_kernel<T, true>), dim3(elementwise_blocks(rows.n_rows, threads)), dim3(threads),
                  0, stream, static_cast<T*>(dout), freqs, rows, rows_per_position, rot, mscale);
  });
}

}  // namespace twin::opt::TWIN_BACKEND
