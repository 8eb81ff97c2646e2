#include "reference/rotary_pos_embedding.h"

#include <cmath>
#include <string>
#include <vector>

namespace twin::reference {

Mat rotary_freqs(const Tensor& rotary_pos_emb, int s, int head_dim) {
  const Shape& sh = rotary_pos_emb.shape();
  if (sh.size() != 4 || sh[1] != 1 || sh[2] != 1)
    throw ShapeError("rotary_pos_emb: expected shape [" + std::to_string(s) + ", 1, 1, rot_dim], got " + shape_str(sh));
  if (sh[0] < s)
    throw ShapeError("rotary_pos_emb: " + shape_str(sh) + " is shorter than the sequence (s = " + std::to_string(s) +
                     ")");
  if (sh[0] != s)
    throw ShapeError("rotary_pos_emb: " + shape_str(sh) + " is longer than the sequence (s = " + std::to_string(s) +
                     "); the unfused RoPE broadcasts it against exactly s positions");
  const std::int64_t rot_dim = sh[3];
  if (rot_dim % 2 != 0 || rot_dim > head_dim || rot_dim == 0)
    throw ShapeError("rotary_pos_emb: rot_dim " + std::to_string(rot_dim) +
                     " must be even, positive and at most the head dimension " + std::to_string(head_dim) + " (got " +
                     shape_str(sh) + ")");
  return to_mat(rotary_pos_emb, s, rot_dim, "rotary_pos_emb");
}

RopeTables rope_tables(const Mat& freqs, const Precision& p, double mscale) {
  // cos_ = (cos(freqs) * mscale).to(t.dtype): torch.cos in fp32, the fp32 product (exact for
  // mscale 1), then stored in the activation dtype
  RopeTables t{Mat(freqs.rows(), freqs.cols()), Mat(freqs.rows(), freqs.cols())};
  for (Eigen::Index i = 0; i < freqs.size(); ++i) {
    t.cos_.data()[i] = p.act(p.f32(p.f32(std::cos(freqs.data()[i])) * mscale));  // rounds: cos, * mscale, .to
    t.sin_.data()[i] = p.act(p.f32(p.f32(std::sin(freqs.data()[i])) * mscale));  // rounds: sin, * mscale, .to
  }
  return t;
}

Mat apply_rotary_pos_emb(const Mat& t, const Mat& freqs, int rows_per_position, bool rotary_interleaved,
                         const Precision& p) {
  return apply_rotary_pos_emb(t, rope_tables(freqs, p), rows_per_position, rotary_interleaved, p);
}

TWIN_VECTOR_CLONES Mat apply_rotary_pos_emb(const Mat& t, const RopeTables& tables, int rows_per_position,
                                            bool rotary_interleaved, const Precision& p) {
  const Mat &cos_ = tables.cos_, &sin_ = tables.sin_;
  const Eigen::Index rot_dim = cos_.cols();
  if (rot_dim > t.cols())
    throw ShapeError("apply_rotary_pos_emb: rot_dim " + std::to_string(rot_dim) + " exceeds head dim " +
                     std::to_string(t.cols()));
  if (t.rows() != cos_.rows() * rows_per_position)
    throw ShapeError("apply_rotary_pos_emb: " + std::to_string(t.rows()) + " rows do not cover " +
                     std::to_string(cos_.rows()) + " positions x " + std::to_string(rows_per_position));
  Mat out = t;  // t_pass columns stay as they are
  const Eigen::Index half = rot_dim / 2;
  p.with_act([&](auto act) {
    for (Eigen::Index r = 0; r < t.rows(); ++r) {
      const Eigen::Index pos = r / rows_per_position;
      const double *tr = t.data() + r * t.cols(), *cr = cos_.data() + pos * rot_dim, *sr = sin_.data() + pos * rot_dim;
      double* o = out.data() + r * out.cols();
      if (!rotary_interleaved) {                 // _rotate_half(t) = [-t2, t1]: two loops without a per-element branch
        for (Eigen::Index c = 0; c < half; ++c)  // rounds: t * cos_, _rotate_half(t) * sin_, sum
          o[c] = act(act(tr[c] * cr[c]) + act(-tr[c + half] * sr[c]));
        for (Eigen::Index c = half; c < rot_dim; ++c) o[c] = act(act(tr[c] * cr[c]) + act(tr[c - half] * sr[c]));
      } else {
        for (Eigen::Index c = 0; c < rot_dim; ++c) {
          const double rotated = c % 2 == 0 ? -tr[c + 1] : tr[c - 1];  // _rotate_half(t)[c]
          o[c] = act(act(tr[c] * cr[c]) + act(rotated * sr[c]));       // rounds: as above
        }
      }
    }
  });
  return out;
}

Mat apply_rotary_pos_emb_backward(const Mat& dout, const Mat& freqs, int rows_per_position, bool rotary_interleaved,
                                  const Precision& p, double mscale) {
  const Eigen::Index rot_dim = freqs.cols();
  if (rot_dim > dout.cols() || dout.rows() != freqs.rows() * rows_per_position)
    throw ShapeError("apply_rotary_pos_emb_backward: grad_output does not match freqs and rows_per_position");
  const RopeTables tables = rope_tables(freqs, p, mscale);  // the forward's tables
  const Mat &cos_ = tables.cos_, &sin_ = tables.sin_;
  Mat dt = dout;  // t_pass columns
  const Eigen::Index half = rot_dim / 2;
  for (Eigen::Index r = 0; r < dout.rows(); ++r) {
    const Eigen::Index pos = r / rows_per_position;
    for (Eigen::Index c = 0; c < rot_dim; ++c) {
      // _rotate_half(t)[c'] reads t[c] with sign: the transpose sends (dout sin)[c'] back to c.
      Eigen::Index src;
      double sign;
      if (!rotary_interleaved) {
        src = c < half ? c + half : c - half;  // rotated[src] = (src < half ? -t[src + half] : t[src - half])
        sign = c < half ? 1.0 : -1.0;
      } else {
        src = c % 2 == 0 ? c + 1 : c - 1;
        sign = c % 2 == 0 ? 1.0 : -1.0;
      }
      const double a = p.act(dout(r, c) * cos_(pos, c));             // rounds: mul's grad of t
      const double b = p.act(dout(r, src) * sin_(pos, src)) * sign;  // rounds: mul's grad of _rotate_half(t)
      dt(r, c) = p.act(a + b);                                       // rounds: the two grads' sum
    }
  }
  p.count_act(2);
  return dt;
}

}  // namespace twin::reference
