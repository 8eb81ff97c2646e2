// megatron/core/models/common/embeddings/rotary_pos_embedding.py (RotaryEmbedding) and
// rope_utils.py (_rotate_half, _apply_rotary_pos_emb_bshd, the unfused path).
//
// The angles `freqs` are [s, 1, 1, rot_dim] (fp32): non-interleaved cat(f, f), interleaved
// [f0, f0, f1, f1, ...]. Applying them to t [s, b, heads, hn]:
//   t, t_pass = t[..., :rot_dim], t[..., rot_dim:]        (rotary_percent < 1 rotates a prefix)
//   t = t * cos(freqs) + _rotate_half(t) * sin(freqs)
//   _rotate_half: halves [x1 | x2] -> [-x2 | x1]; interleaved pairs (x0, x1) -> (-x1, x0)
//   return cat(t, t_pass)
// Backward: dt = dout cos + _rotate_half^T(dout sin), _rotate_half^T: [y1 | y2] -> [y2 | -y1]
// (interleaved (y0, y1) -> (y1, -y0)); each mul's grad stored in the activation dtype, their sum
// too; t_pass passes dout through.
#pragma once

#include "core/rotary_embedding.h"
#include "core/tensor.h"
#include "reference/precision.h"

namespace twin::reference {

// Megatron's RotaryEmbedding (the angles, core/rotary_embedding.h: both twins compute them alike).
using twin::RotaryEmbedding;

// Checks rotary_pos_emb against the sequence length and head size and returns it as a
// [s, rot_dim] matrix. ShapeError when it is not [s, 1, 1, rot_dim], is shorter than the
// sequence (or longer: torch's broadcasting in the unfused path requires exactly s), has an odd
// rot_dim or one larger than head_dim.
Mat rotary_freqs(const Tensor& rotary_pos_emb, int s, int head_dim);

// cos_ = (cos(freqs) * mscale).to(t.dtype) and sin_ likewise, [s, rot_dim] each (torch.cos /
// torch.sin in fp32 first; mscale is YaRN's concentration factor, 1 otherwise): what the unfused
// path computes for q and again for k, the same values both times.
struct RopeTables {
  Mat cos_, sin_;
};
RopeTables rope_tables(const Mat& freqs, const Precision& p, double mscale = 1.0);

// t: [s, b, heads, hn] as (s * b * heads) x hn rows; freqs [s, rot_dim]. rows_per_position =
// b * heads. Each torch op's output stored in the activation dtype; cos/sin in fp32 first.
Mat apply_rotary_pos_emb(const Mat& t, const Mat& freqs, int rows_per_position, bool rotary_interleaved,
                         const Precision& p);
// The same with the tables of freqs computed once (rope_tables), for q and k.
Mat apply_rotary_pos_emb(const Mat& t, const RopeTables& tables, int rows_per_position, bool rotary_interleaved,
                         const Precision& p);

// Gradient of apply_rotary_pos_emb for dout (same layout as t).
Mat apply_rotary_pos_emb_backward(const Mat& dout, const Mat& freqs, int rows_per_position, bool rotary_interleaved,
                                  const Precision& p, double mscale = 1.0);

}  // namespace twin::reference
