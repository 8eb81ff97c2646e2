// ComputeMode::Fast's core attention (DotProductAttention::forward_fast, declared beside the readable
// forward in reference/dot_product_attention.h): per (batch, head) slice, q k^T and probs v as
// fp32 GEMMs (fast_gemm.h) with the readable path's rounding points. test_fast_mode checks it
// against the readable path.
#include <cmath>
#include <cstdint>
#include <vector>

#include "reference/dot_product_attention.h"
#include "reference/dot_product_attention_mask.h"
#include "reference/fast/fast_gemm.h"

namespace twin::reference {

namespace {
using RowArrayF = Eigen::Array<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using RowArrayD = Eigen::Array<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

// Rows of one (batch, head) slice of a [s, b, heads, hn] tensor ((i * b + bi) * heads + head) as a
// contiguous [s, hn] matrix.
FMat slice_rows(const FMat& t, int s, int b, int bi, int heads, int head) {
  FMat out(s, t.cols());
  for (int i = 0; i < s; ++i) out.row(i) = t.row((static_cast<Eigen::Index>(i) * b + bi) * heads + head);
  return out;
}

// The softmax of each row of `scores` [sq, n] (the first sk columns kept): exp(x - max) / sum in
// double. exp(d) is exactly 0 in double for d < -746 (below the least subnormal, 2^-1074): masked
// scores (-10000) skip libm's slow underflow path with the value it would return.
RowArrayD softmax_rows(const RowArrayD& scores, int sk) {
  const Eigen::Array<double, Eigen::Dynamic, 1> mx = scores.rowwise().maxCoeff();
  const RowArrayD e = (scores.colwise() - mx).unaryExpr([](double x) { return x < -746.0 ? 0.0 : std::exp(x); });
  const Eigen::Array<double, Eigen::Dynamic, 1> sum = e.rowwise().sum();
  return e.leftCols(sk).colwise() / sum;
}

// Rounds fp32 values to bf16 in place (round to nearest even; NaN stays NaN): Precision::act's
// bf16 case on values that are already fp32.
void round_bf16_inplace(float* v, Eigen::Index n) {
  for (Eigen::Index i = 0; i < n; ++i) {
    const std::uint32_t u = float_bits(v[i]);
    const std::uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    const std::uint32_t nan = (u | 0x00400000u) & 0xffff0000u;
    v[i] = bits_float((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
  }
}
}  // namespace

Mat DotProductAttention::forward_fast(const Mat& query, const Mat& key, const Mat& value, int sq, int sk, int b,
                                      const Tensor* attention_mask, Mat* probs_out) const {
  const bool upcast = input_in_float16_ && softmax_in_fp32_;
  auto sm = [&](double x) { return upcast ? p_.f32(x) : p_.act(x); };
  const int group = np_ / ng_;
  const bool bf16 = p_.params_dtype == DType::BF16;  // q, k, v and the stored probs are bf16 values
  // With 16-bit activations the softmax runs in fp32 arithmetic, as torch's kernels run it: its
  // exp (Eigen's, a few fp32 ulps), shift and division err by a few 2^-24, under 2^-10 of the
  // store to bf16 (2^-8) or fp16 (2^-11) that every probability passes through next (each
  // probability is stored in the activation dtype before probs @ v), as apply_activation_fast
  // argues for the activations; fp32 activations keep double arithmetic between their stores.
  const bool fp32_softmax = p_.params_dtype == DType::BF16 || p_.params_dtype == DType::F16;
  Mat context(static_cast<Eigen::Index>(sq) * b, static_cast<Eigen::Index>(np_) * hv_);   // [sq, b, np * hv]
  const FMat qf = query.cast<float>(), kf = key.cast<float>(), vf = value.cast<float>();  // exact in fp32
  const int n = softmax_offset ? sk + 1 : sk;  // with the sink logit's column
  Mat scores(sq, n);
  RowArrayF sf(sq, n), ef(sq, n), prf(sq, sk);
  Mat pr(sq, sk);
  const std::vector<double> mask_values = attention_mask ? attention_mask->to_f64() : std::vector<double>();
  // The slice's mask, recomputed only when the slice it depends on changes (a given
  // mask broadcast over heads or batch, or the causal / window mask shared by all slices).
  std::vector<std::int32_t> masked_words(static_cast<std::size_t>(sq) * sk);  // fp32's width: vectorised selects
  std::vector<int> row_last(static_cast<std::size_t>(sq));                    // each row's last unmasked column, or -1
  std::int64_t mask_of = -2;  // which slice masked_words and row_last hold (-1: one for all slices)
  for (int bi = 0; bi < b; ++bi) {
    for (int g = 0; g < ng_; ++g) {
      const GemmOperand k(slice_rows(kf, sk, b, bi, ng_, g), bf16);  // [sk, hn]
      const GemmOperand v(slice_rows(vf, sk, b, bi, ng_, g), bf16);  // [sk, hv]
      for (int h = g * group; h < (g + 1) * group; ++h) {            // repeat_interleave(np / ng, dim=2)
        const SliceMask masked(*this, sq, sk, bi, h, attention_mask, &mask_values);
        if (masked.source != SliceMask::Source::None) {
          std::int64_t of = -1;
          if (masked.source == SliceMask::Source::Given) {
            const Shape& sh = attention_mask->shape();
            of = (sh[0] == 1 ? 0 : bi) * sh[1] + (sh[1] == 1 ? 0 : h);
          }
          if (of != mask_of) {
            for (int i = 0; i < sq; ++i) {
              row_last[static_cast<std::size_t>(i)] = -1;
              for (int j = 0; j < sk; ++j) {
                const bool mij = masked(i, j);
                masked_words[static_cast<std::size_t>(i) * sk + j] = mij;
                if (!mij) row_last[static_cast<std::size_t>(i)] = j;
              }
            }
            mask_of = of;
          }
        }
        const FMat qk = matmul_nt(slice_rows(qf, sq, b, bi, np_, h), k, 1.0f, bf16);  // [sq, sk], fp32 sums of q . k
        // The scores [sq, n] in one pass per row into dst (double, or fp32 which holds them exactly:
        // activation-dtype or fp32 values, and so is the sink).
        const bool has_mask = masked.source != SliceMask::Source::None;
        auto fill_scores = [&](auto* dst) {
          const double fill = sm(-10000.0), c = coeff ? *coeff : 1.0;
          p_.with_act([&](auto act) {
            for (int i = 0; i < sq; ++i) {
              const float* qr = qk.data() + static_cast<Eigen::Index>(i) * sk;
              auto* sr = dst + static_cast<Eigen::Index>(i) * n;
              const std::int32_t* mr = masked_words.data() + static_cast<std::size_t>(i) * sk;
              // rounds: baddbmm output (alpha inside), activation dtype; input * scale, fp32 (coeff);
              // then masked_fill_(mask, -10000.0)
              if (coeff && has_mask)
                for (int j = 0; j < sk; ++j) sr[j] = mr[j] ? fill : p_.f32(act(softmax_scale * qr[j]) * c);
              else if (coeff)
                for (int j = 0; j < sk; ++j) sr[j] = p_.f32(act(softmax_scale * qr[j]) * c);
              else if (has_mask)
                for (int j = 0; j < sk; ++j) sr[j] = mr[j] ? fill : act(softmax_scale * qr[j]);
              else
                for (int j = 0; j < sk; ++j) sr[j] = act(softmax_scale * qr[j]);
              if (softmax_offset) sr[sk] = (*softmax_offset)[h];  // SoftmaxOne: the sink logit
            }
          });
        };
        FMat ctx;
        if (fp32_softmax) {
          fill_scores(sf.data());
          // exp(x - max) / sum per row in fp32, with Eigen's vectorised exp (its argument is clamped
          // at about -88.4). exp(d) for d < -88 (at most 6.1e-39, below fp32's least normal) is
          // taken as 0, as for the masked scores (-10000): an absolute error under 2^-126 in terms
          // whose row's largest is 1.
          // rounds: softmax output, fp32; then probs.bfloat16() / .half() (upcast), else the
          // softmax output in the activation dtype
          // A row's masked tail (after its last unmasked score, no sink column) adds exactly 0
          // when the row's other maximum is more than 88 above the fill: its exp is skipped then.
          const float fill = static_cast<float>(sm(-10000.0));
          for (int i = 0; i < sq; ++i) {
            const float* sc = sf.data() + static_cast<Eigen::Index>(i) * n;
            float* e = ef.data() + static_cast<Eigen::Index>(i) * n;
            int m = n;  // the columns whose exp is taken
            float mx = Eigen::Map<const Eigen::ArrayXf>(sc, n).maxCoeff();
            if (has_mask && !softmax_offset && row_last[static_cast<std::size_t>(i)] >= 0) {
              const int head = row_last[static_cast<std::size_t>(i)] + 1;
              const float head_mx = Eigen::Map<const Eigen::ArrayXf>(sc, head).maxCoeff();
              if (head_mx - fill > 88.0f) m = head, mx = head_mx;
            }
            Eigen::Map<Eigen::ArrayXf>(e, m) = (Eigen::Map<const Eigen::ArrayXf>(sc, m) - mx).exp();
            for (int j = 0; j < m; ++j) e[j] = sc[j] - mx < -88.0f ? 0.0f : e[j];
            for (int j = m; j < n; ++j) e[j] = 0.0f;
            const float sum = Eigen::Map<const Eigen::ArrayXf>(e, m).sum();
            float* pr_row = prf.data() + static_cast<Eigen::Index>(i) * sk;
            for (int j = 0; j < sk; ++j) pr_row[j] = e[j] / sum;
          }
          if (bf16) {
            round_bf16_inplace(prf.data(), prf.size());
          } else {
            pr = prf.cast<double>().matrix();
            p_.act_inplace(pr);
            prf = pr.cast<float>().array();
          }
          if (probs_out)
            probs_out->middleRows((static_cast<Eigen::Index>(bi) * np_ + h) * sq, sq) = prf.cast<double>().matrix();
          ctx = matmul_nn(FMat(prf.matrix()), v, bf16);  // [sq, hn]: bmm(probs, v), fp32 sums
        } else {
          fill_scores(scores.data());
          pr = softmax_rows(RowArrayD(scores.array()), sk).matrix();
          if (upcast) {
            p_.f32_inplace(pr);  // rounds: softmax output, fp32
            p_.act_inplace(pr);  // rounds: probs.bfloat16() / .half()
          } else {
            p_.act_inplace(pr);  // rounds: softmax output, activation dtype
          }
          if (probs_out) probs_out->middleRows((static_cast<Eigen::Index>(bi) * np_ + h) * sq, sq) = pr;
          ctx = matmul_nn(FMat(pr.cast<float>()), v, bf16);  // [sq, hn]: bmm(probs, v), fp32 sums
        }
        for (int i = 0; i < sq; ++i)
          context.row(static_cast<Eigen::Index>(i) * b + bi).segment(static_cast<Eigen::Index>(h) * hv_, hv_) =
              ctx.row(i).cast<double>();
      }
    }
  }
  p_.act_inplace(context);  // rounds: bmm output
  return context;
}

}  // namespace twin::reference
