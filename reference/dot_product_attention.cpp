#include "reference/dot_product_attention.h"

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "reference/fast_gemm.h"

namespace twin::reference {

AttnMaskType attn_mask_type_from_name(const std::string& name) {
  if (name == "padding") return AttnMaskType::padding;
  if (name == "causal") return AttnMaskType::causal;
  if (name == "no_mask") return AttnMaskType::no_mask;
  if (name == "padding_causal") return AttnMaskType::padding_causal;
  if (name == "arbitrary") return AttnMaskType::arbitrary;
  throw ConfigError("attn_mask_type: unknown value '" + name +
                    "' (padding, causal, no_mask, padding_causal, arbitrary)");
}

DotProductAttention::DotProductAttention(const TransformerConfig& config, int layer_number_, AttnMaskType mask_type,
                                         Precision p, std::optional<double> attention_dropout_,
                                         std::optional<double> softmax_scale_)
    : layer_number(std::max(1, layer_number_)),
      attn_mask_type(mask_type),
      attention_dropout(attention_dropout_.value_or(config.attention_dropout)),
      np_(config.num_attention_heads),
      ng_(config.query_groups()),
      hn_(config.head_dim()),
      // TransformerConfig.__post_init__: apply_query_key_layer_scaling sets attention_softmax_in_fp32.
      softmax_in_fp32_(config.attention_softmax_in_fp32 || config.apply_query_key_layer_scaling),
      input_in_float16_(config.fp16 || config.bf16),
      softmax_type_(config.softmax_type),
      window_size_(config.window_size),
      p_(p) {
  if (ng_ <= 0 || np_ % ng_ != 0)
    throw ConfigError("num_attention_heads (" + std::to_string(np_) + ") must be a multiple of num_query_groups (" +
                      std::to_string(ng_) + ")");
  const std::optional<double> scale = softmax_scale_ ? softmax_scale_ : config.softmax_scale;
  softmax_scale = scale ? *scale : 1.0 / std::sqrt(static_cast<double>(hn_));
  if (config.apply_query_key_layer_scaling) {
    coeff = layer_number;
    softmax_scale /= *coeff;
  }
  if (softmax_type_ == "off-by-one") {
    softmax_offset = RowVec::Zero(np_);
  } else if (softmax_type_ == "learnable") {
    softmax_offset = RowVec::Zero(np_);
  } else if (softmax_type_ != "vanilla") {
    throw ConfigError("softmax_type: '" + softmax_type_ + "' is not supported (vanilla, off-by-one, learnable)");
  }
  if (window_size_ && window_size_->size() != 2)
    throw ConfigError("window_size: expected two values (left, right), got " + std::to_string(window_size_->size()));
}

void DotProductAttention::load_state_dict(const StateDict& sd, const std::string& prefix) {
  if (softmax_type_ == "learnable") softmax_offset = sd.vector(prefix + "softmax_offset", np_);
}

void check_attention_mask(const Tensor& mask, int b, int np, int sq, int sk, const std::string& what) {
  const Shape& sh = mask.shape();
  const Shape want = {b, 1, sq, sk};
  if (mask.dtype() != DType::BOOL)
    throw ShapeError(what + ": expected a BOOL mask (True = masked) of shape " + shape_str(want) + ", got " +
                     mask.describe());
  const bool ok =
      sh.size() == 4 && (sh[0] == b || sh[0] == 1) && (sh[1] == 1 || sh[1] == np) && sh[2] == sq && sh[3] == sk;
  if (!ok)
    throw ShapeError(what + ": expected shape " + shape_str(want) + " (dims 0 and 1 may also be 1 / " +
                     std::to_string(np) + "), got " + shape_str(sh));
}

// The mask actually applied to the [sq, sk] slice (batch bi, head h) of the scores
// (FusedScaleMaskSoftmax.forward_torch_softmax): masked(i, j) is true where the score is filled.
struct DotProductAttention::SliceMask {
  enum class Source { None, Given, Causal, Window } source = Source::None;
  const DotProductAttention& a;
  int sq, sk, bi, h;
  const Tensor* attention_mask;

  const std::vector<double>* mask_values;  // attention_mask->to_f64(), read once per forward, or nullptr

  SliceMask(const DotProductAttention& a_, int sq_, int sk_, int bi_, int h_, const Tensor* mask,
            const std::vector<double>* values = nullptr)
      : a(a_), sq(sq_), sk(sk_), bi(bi_), h(h_), attention_mask(mask), mask_values(values) {
    if (a.window_size_) {
      source = Source::Window;
    } else if (a.attn_mask_type == AttnMaskType::causal && attention_mask == nullptr && sq > 1) {
      if (sq != sk) throw ShapeError("DotProductAttention: causal mask is only for self attention (sq != sk)");
      source = Source::Causal;
    } else if (attention_mask != nullptr) {
      source = Source::Given;
    }
  }
  bool operator()(int i, int j) const {
    switch (source) {
      case Source::None:
        return false;
      case Source::Causal:
        return j > i;  // triu(ones, diagonal=1)
      case Source::Window: {
        const int d = sk - sq;  // ~(tril(triu(m, d - w0), d + w1))
        return !(j - i >= d - (*a.window_size_)[0] && j - i <= d + (*a.window_size_)[1]);
      }
      case Source::Given: {
        const Shape& sh = attention_mask->shape();
        const std::int64_t b0 = sh[0] == 1 ? 0 : bi, h0 = sh[1] == 1 ? 0 : h;
        const std::int64_t at = ((b0 * sh[1] + h0) * sq + i) * sk + j;
        return (mask_values ? (*mask_values)[static_cast<std::size_t>(at)] : attention_mask->at_f64(at)) != 0.0;
      }
    }
    return false;
  }
};

// One [sq, sk] slice (batch bi, head h) of the attention probabilities after dropout, as the
// forward computes and rounds them; `softmax_out`, when given, receives the softmax's own output
// (fp32 under attention_softmax_in_fp32, before the cast back and dropout), which its backward uses.
Mat DotProductAttention::probabilities(const Mat& query, const Mat& key, int sq, int sk, int b, int bi, int h,
                                       const Tensor* attention_mask, bool training, const DropoutRng& rng,
                                       Mat* softmax_out, std::vector<bool>* masked_out) const {
  const SliceMask masked(*this, sq, sk, bi, h, attention_mask);

  // Softmax storage: fp32 when the input is fp16/bf16 and attention_softmax_in_fp32 (the input is
  // upcast with .float()), else the scores' own dtype (the activation dtype).
  const bool upcast = input_in_float16_ && softmax_in_fp32_;
  auto sm = [&](double x) { return upcast ? p_.f32(x) : p_.act(x); };
  const int g = h / (np_ / ng_);  // repeat_interleave(np / ng, dim=2)
  Mat probs(sq, sk);              // one [sq, sk] slice of [b, np, sq, sk]
  if (softmax_out) softmax_out->resize(sq, sk);
  if (masked_out) masked_out->assign(static_cast<std::size_t>(sq) * sk, false);
  std::vector<double> row(sk + 1);
  for (int i = 0; i < sq; ++i) {
    const auto q = query.row((static_cast<Eigen::Index>(i) * b + bi) * np_ + h);
    for (int j = 0; j < sk; ++j) {
      const auto k = key.row((static_cast<Eigen::Index>(j) * b + bi) * ng_ + g);
      double score = p_.act(softmax_scale * q.dot(k));  // rounds: baddbmm output (alpha inside), activation dtype
      if (coeff) score = p_.f32(score * *coeff);        // rounds: input * scale, fp32 (softmax_in_fp32 asserted)
      if (masked(i, j)) {
        score = sm(-10000.0);  // masked_fill_(mask, -10000.0)
        if (masked_out) (*masked_out)[static_cast<std::size_t>(i) * sk + j] = true;
      }
      row[j] = score;
    }
    int n = sk;
    if (softmax_offset) row[n++] = (*softmax_offset)[h];  // SoftmaxOne: the sink logit
    double mx = row[0];
    for (int j = 1; j < n; ++j) mx = std::max(mx, row[j]);
    double sum = 0.0;
    for (int j = 0; j < n; ++j) sum += std::exp(row[j] - mx);
    for (int j = 0; j < sk; ++j) {
      double pr = sm(std::exp(row[j] - mx) / sum);  // rounds: softmax output (fp32 or activation dtype)
      if (softmax_out) (*softmax_out)(i, j) = pr;
      if (upcast) pr = p_.act(pr);  // rounds: probs.bfloat16() / .half()
      probs(i, j) = pr;
    }
  }
  // attention dropout over the flat [b, np, sq, sk] probabilities
  if (training && attention_dropout > 0.0) {
    const std::uint32_t threshold = dropout_keep_threshold(attention_dropout);
    const double scale = attention_dropout == 1.0 ? 0.0 : 1.0 / (1.0 - attention_dropout);
    const std::uint64_t base = (static_cast<std::uint64_t>(bi) * np_ + h) * sq * sk;
    for (int i = 0; i < sq; ++i)
      for (int j = 0; j < sk; ++j) {
        const bool keep =
            (philox_word(rng.seed, rng.offset, base + static_cast<std::uint64_t>(i) * sk + j) >> 8) < threshold;
        probs(i, j) = keep ? p_.act(probs(i, j) * scale) : 0.0;  // rounds: dropout product, activation dtype
      }
  }
  return probs;
}

Mat DotProductAttention::forward(const Mat& query, const Mat& key, const Mat& value, int sq, int sk, int b,
                                 const Tensor* attention_mask, bool training, const DropoutRng& rng) const {
  if (query.rows() != static_cast<Eigen::Index>(sq) * b * np_ || query.cols() != hn_)
    throw ShapeError("DotProductAttention: query expected [" + std::to_string(sq) + ", " + std::to_string(b) + ", " +
                     std::to_string(np_) + ", " + std::to_string(hn_) + "]");
  if (key.rows() != static_cast<Eigen::Index>(sk) * b * ng_ || key.cols() != hn_ || value.rows() != key.rows() ||
      value.cols() != hn_)
    throw ShapeError("DotProductAttention: key/value expected [" + std::to_string(sk) + ", " + std::to_string(b) +
                     ", " + std::to_string(ng_) + ", " + std::to_string(hn_) + "]");
  if (attention_mask) check_attention_mask(*attention_mask, b, np_, sq, sk, "attention_mask");

  const int group = np_ / ng_;
  const bool dropout = training && attention_dropout > 0.0;
  Mat context;                  // [sq, b, np * hn]
  if (p_.fast() && !dropout) {  // with dropout, fast mode takes the loops below (same math, slower)
    context = forward_fast(query, key, value, sq, sk, b, attention_mask);
  } else {
    context.resize(static_cast<Eigen::Index>(sq) * b, static_cast<Eigen::Index>(np_) * hn_);
    for (int bi = 0; bi < b; ++bi) {
      for (int h = 0; h < np_; ++h) {
        const int g = h / group;  // repeat_interleave(np / ng, dim=2)
        const Mat probs = probabilities(query, key, sq, sk, b, bi, h, attention_mask, training, rng);
        // context = bmm(probs, v): [sq, hn] for this (b, h)
        for (int i = 0; i < sq; ++i) {
          for (int c = 0; c < hn_; ++c) {
            double acc = 0.0;
            for (int j = 0; j < sk; ++j)
              acc += probs(i, j) * value((static_cast<Eigen::Index>(j) * b + bi) * ng_ + g, c);
            context(static_cast<Eigen::Index>(i) * b + bi, static_cast<Eigen::Index>(h) * hn_ + c) =
                p_.act(acc);  // rounds: bmm output
          }
        }
      }
    }
  }
  const bool upcast = input_in_float16_ && softmax_in_fp32_;
  p_.count_reduce(hn_);  // q . k
  p_.count_act();
  if (coeff) p_.count_f32();
  p_.count_reduce(softmax_offset ? sk + 1 : sk);  // the softmax's sum (SoftmaxOne: and the sink's term)
  if (upcast) {
    p_.count_f32();
    p_.count_act();
  } else {
    p_.count_act();
  }
  if (dropout) p_.count_act();
  p_.count_reduce(sk);  // probs @ v
  p_.count_act();
  return context;
}

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

Mat DotProductAttention::stored_probabilities(const Mat& query, const Mat& key, int sq, int sk, int b,
                                              const Tensor* attention_mask, bool training,
                                              const DropoutRng& rng) const {
  if (query.rows() != static_cast<Eigen::Index>(sq) * b * np_ || query.cols() != hn_ ||
      key.rows() != static_cast<Eigen::Index>(sk) * b * ng_ || key.cols() != hn_)
    throw ShapeError("DotProductAttention: query / key do not match [" + std::to_string(sq) + " / " +
                     std::to_string(sk) + ", " + std::to_string(b) + ", " + std::to_string(np_) + " / " +
                     std::to_string(ng_) + ", " + std::to_string(hn_) + "]");
  if (attention_mask) check_attention_mask(*attention_mask, b, np_, sq, sk, "attention_mask");
  Mat out(static_cast<Eigen::Index>(b) * np_ * sq, sk);
  if (p_.fast() && !(training && attention_dropout > 0.0)) {
    forward_fast(query, key, Mat::Zero(key.rows(), hn_), sq, sk, b, attention_mask, &out);
    return out;
  }
  for (int bi = 0; bi < b; ++bi)
    for (int h = 0; h < np_; ++h)
      out.middleRows((static_cast<Eigen::Index>(bi) * np_ + h) * sq, sq) =
          probabilities(query, key, sq, sk, b, bi, h, attention_mask, training, rng);
  return out;
}

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
  Mat context(static_cast<Eigen::Index>(sq) * b, static_cast<Eigen::Index>(np_) * hn_);   // [sq, b, np * hn]
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
      const GemmOperand v(slice_rows(vf, sk, b, bi, ng_, g), bf16);  // [sk, hn]
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
          context.row(static_cast<Eigen::Index>(i) * b + bi).segment(static_cast<Eigen::Index>(h) * hn_, hn_) =
              ctx.row(i).cast<double>();
      }
    }
  }
  p_.act_inplace(context);  // rounds: bmm output
  return context;
}

CoreAttentionGrads DotProductAttention::backward(const Mat& dcontext, const Mat& query, const Mat& key,
                                                 const Mat& value, int sq, int sk, int b, const Tensor* attention_mask,
                                                 bool training, const DropoutRng& rng) const {
  if (dcontext.rows() != static_cast<Eigen::Index>(sq) * b || dcontext.cols() != static_cast<Eigen::Index>(np_) * hn_)
    throw ShapeError("DotProductAttention backward: grad of context expected [" + std::to_string(sq) + ", " +
                     std::to_string(b) + ", " + std::to_string(np_ * hn_) + "]");
  if (query.rows() != static_cast<Eigen::Index>(sq) * b * np_ || query.cols() != hn_ ||
      key.rows() != static_cast<Eigen::Index>(sk) * b * ng_ || key.cols() != hn_ || value.rows() != key.rows() ||
      value.cols() != hn_)
    throw ShapeError("DotProductAttention backward: query / key / value do not match [" + std::to_string(sq) + ", " +
                     std::to_string(b) + ", " + std::to_string(np_) + " / " + std::to_string(ng_) + ", " +
                     std::to_string(hn_) + "]");
  if (attention_mask) check_attention_mask(*attention_mask, b, np_, sq, sk, "attention_mask");
  if (softmax_type_ == "learnable")
    throw ConfigError("DotProductAttention backward: the learnable softmax offset's gradient is not implemented");
  const bool upcast = input_in_float16_ && softmax_in_fp32_;
  const bool dropout = training && attention_dropout > 0.0;
  const int group = np_ / ng_;
  CoreAttentionGrads g;
  g.query = Mat::Zero(query.rows(), hn_);
  g.key = Mat::Zero(key.rows(), hn_);
  g.value = Mat::Zero(value.rows(), hn_);
  Mat softmax_out;
  std::vector<bool> masked;
  for (int bi = 0; bi < b; ++bi) {
    for (int h = 0; h < np_; ++h) {
      const int kv = h / group;
      const Mat probs =
          probabilities(query, key, sq, sk, b, bi, h, attention_mask, training, rng, &softmax_out, &masked);
      Mat q(sq, hn_), k(sk, hn_), v(sk, hn_), dctx(sq, hn_);  // this (b, h) slice
      for (int i = 0; i < sq; ++i) {
        q.row(i) = query.row((static_cast<Eigen::Index>(i) * b + bi) * np_ + h);
        dctx.row(i) =
            dcontext.row(static_cast<Eigen::Index>(i) * b + bi).segment(static_cast<Eigen::Index>(h) * hn_, hn_);
      }
      for (int j = 0; j < sk; ++j) {
        k.row(j) = key.row((static_cast<Eigen::Index>(j) * b + bi) * ng_ + kv);
        v.row(j) = value.row((static_cast<Eigen::Index>(j) * b + bi) * ng_ + kv);
      }
      // bmm(probs, v)'s backward
      Mat dprobs = p_.act(dctx * v.transpose());        // rounds: [sq, sk] grad of probs, activation dtype
      const Mat dv = p_.act(probs.transpose() * dctx);  // rounds: [sk, hn] grad of v (this head)
      if (dropout) {                                    // the forward's mask, regenerated
        const std::uint32_t threshold = dropout_keep_threshold(attention_dropout);
        const double scale = attention_dropout == 1.0 ? 0.0 : 1.0 / (1.0 - attention_dropout);
        const std::uint64_t base = (static_cast<std::uint64_t>(bi) * np_ + h) * sq * sk;
        for (int i = 0; i < sq; ++i)
          for (int j = 0; j < sk; ++j) {
            const bool keep =
                (philox_word(rng.seed, rng.offset, base + static_cast<std::uint64_t>(i) * sk + j) >> 8) < threshold;
            dprobs(i, j) = keep ? p_.act(dprobs(i, j) * scale) : 0.0;  // rounds: dropout's grad, activation dtype
          }
      }
      // softmax's backward on its own output y: dx = y (dy - sum(dy y)), in fp32 under upcast (the
      // cast back's grad is exact), then masked_fill's (0 where masked), the layer-scaling
      // coefficient's (fp32) and .float()'s (a store in the activation dtype).
      Mat dscores(sq, sk);
      for (int i = 0; i < sq; ++i) {
        const double dot = dprobs.row(i).dot(softmax_out.row(i));
        for (int j = 0; j < sk; ++j) {
          double d = softmax_out(i, j) * (dprobs(i, j) - dot);
          d = upcast ? p_.f32(d) : p_.act(d);  // rounds: softmax backward output
          if (masked[static_cast<std::size_t>(i) * sk + j]) d = 0.0;
          if (coeff) d = p_.f32(d * *coeff);  // rounds: grad of input * scale, fp32
          if (upcast) d = p_.act(d);          // rounds: .float()'s backward to the activation dtype
          dscores(i, j) = d;
        }
      }
      // baddbmm(q, k^T, alpha)'s backward, torch's formula grad.bmm(k).mul_(alpha): the bmm stored,
      // then the product with alpha stored (torch 1.13's CPU kernel also takes alpha in the
      // activation dtype, CUDA in fp32: within that second store's u).
      const Mat dq = p_.act(softmax_scale * p_.act(dscores * k));              // rounds: bmm, * alpha; [sq, hn]
      const Mat dk = p_.act(softmax_scale * p_.act(dscores.transpose() * q));  // rounds: bmm, * alpha; [sk, hn]
      for (int i = 0; i < sq; ++i) g.query.row((static_cast<Eigen::Index>(i) * b + bi) * np_ + h) = dq.row(i);
      for (int j = 0; j < sk; ++j) {  // repeat_interleave's backward: the group's heads summed
        g.key.row((static_cast<Eigen::Index>(j) * b + bi) * ng_ + kv) += dk.row(j);
        g.value.row((static_cast<Eigen::Index>(j) * b + bi) * ng_ + kv) += dv.row(j);
      }
    }
  }
  p_.count_reduce(hn_);  // dctx . v
  p_.count_act();
  if (dropout) p_.count_act();
  p_.count_reduce(sk);  // the softmax backward's sum
  if (upcast) {
    p_.count_f32(coeff ? 2 : 1);
    p_.count_act();
  } else {
    p_.count_act();
    if (coeff) p_.count_f32();
  }
  p_.count_reduce(std::max(sq, sk));  // dscores k, dscores^T q, probs^T dctx
  p_.count_act(2);                    // the bmm outputs; dq and dk's * alpha (dv's path has one store)
  if (group > 1) {                    // the GQA sum over the group's heads, stored
    p_.act_inplace(g.key);
    p_.act_inplace(g.value);
    p_.count_act();
  }
  return g;
}

}  // namespace twin::reference
