#include "reference/dot_product_attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "core/attention_bound.h"
#include "reference/dot_product_attention_mask.h"
#include "reference/parallel.h"

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
                                         std::optional<double> softmax_scale_, std::optional<int> k_channels,
                                         std::optional<int> v_channels)
    : layer_number(std::max(1, layer_number_)),
      attn_mask_type(mask_type),
      attention_dropout(attention_dropout_.value_or(config.attention_dropout)),
      np_(config.num_attention_heads),
      ng_(config.query_groups()),
      hn_(k_channels.value_or(config.head_dim())),
      hv_(v_channels.value_or(config.head_dim())),
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
      value.cols() != hv_)
    throw ShapeError("DotProductAttention: key/value expected [" + std::to_string(sk) + ", " + std::to_string(b) +
                     ", " + std::to_string(ng_) + ", " + std::to_string(hn_) + " / " + std::to_string(hv_) + "]");
  if (attention_mask) check_attention_mask(*attention_mask, b, np_, sq, sk, "attention_mask");

  const int group = np_ / ng_;
  const bool dropout = training && attention_dropout > 0.0;
  Mat context;                  // [sq, b, np * hv]
  if (p_.fast() && !dropout) {  // with dropout, fast mode takes the loops below (same math, slower)
    context = forward_fast(query, key, value, sq, sk, b, attention_mask);
  } else {
    context.resize(static_cast<Eigen::Index>(sq) * b, static_cast<Eigen::Index>(np_) * hv_);
    // One (b, h) at a time, each on any thread: its context columns are its own.
    for_chunks(static_cast<Eigen::Index>(b) * np_, 1, [&](Eigen::Index bh, Eigen::Index) {
      const int bi = static_cast<int>(bh / np_), h = static_cast<int>(bh % np_);
      {
        const int g = h / group;  // repeat_interleave(np / ng, dim=2)
        const Mat probs = probabilities(query, key, sq, sk, b, bi, h, attention_mask, training, rng);
        // context = bmm(probs, v): [sq, hv] for this (b, h)
        for (int i = 0; i < sq; ++i) {
          for (int c = 0; c < hv_; ++c) {
            double acc = 0.0;
            for (int j = 0; j < sk; ++j)
              acc += probs(i, j) * value((static_cast<Eigen::Index>(j) * b + bi) * ng_ + g, c);
            context(static_cast<Eigen::Index>(i) * b + bi, static_cast<Eigen::Index>(h) * hv_ + c) =
                p_.act(acc);  // rounds: bmm output
          }
        }
      }
    });
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

Tensor DotProductAttention::error_magnitudes(const Mat& query, const Mat& key, const Mat& value, int sq, int sk, int b,
                                             const Tensor* attention_mask, bool training) const {
  const int group = np_ / ng_;
  const double scale = softmax_scale * coeff.value_or(1.0);
  const double dropout = training ? attention_dropout : 0.0;
  std::vector<double> magnitudes(static_cast<std::size_t>(sq) * b * np_);  // [sq, b, np]
  for_chunks(static_cast<Eigen::Index>(b) * np_, 1, [&](Eigen::Index bh, Eigen::Index) {
    const int bi = static_cast<int>(bh / np_), h = static_cast<int>(bh % np_), g = h / group;
    const SliceMask masked(*this, sq, sk, bi, h, attention_mask);
    Mat q(sq, hn_), k(sk, hn_);
    double max_v = 0.0;
    for (int i = 0; i < sq; ++i) q.row(i) = query.row((static_cast<Eigen::Index>(i) * b + bi) * np_ + h);
    for (int j = 0; j < sk; ++j) {
      const Eigen::Index row = (static_cast<Eigen::Index>(j) * b + bi) * ng_ + g;
      k.row(j) = key.row(row);
      max_v = std::max(max_v, value.row(row).cwiseAbs().maxCoeff());
    }
    const Mat scores = scale * (q * k.transpose());  // [sq, sk]
    for (int i = 0; i < sq; ++i) {
      double mx = softmax_offset ? (*softmax_offset)[h] : -10000.0;  // masked_fill_(mask, -10000.0)
      for (int j = 0; j < sk; ++j)
        if (!masked(i, j)) mx = std::max(mx, scores(i, j));
      const double term = softmax_row_amplification(mx, softmax_offset ? sk + 1 : sk);
      magnitudes[(static_cast<std::size_t>(i) * b + bi) * np_ + h] =
          core_attention_error_magnitude(max_v, term, dropout);
    }
  });
  return Tensor::from_doubles(DType::F64, {sq, b, np_}, magnitudes);
}

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
    forward_fast(query, key, Mat::Zero(key.rows(), hv_), sq, sk, b, attention_mask, &out);
    return out;
  }
  for (int bi = 0; bi < b; ++bi)
    for (int h = 0; h < np_; ++h)
      out.middleRows((static_cast<Eigen::Index>(bi) * np_ + h) * sq, sq) =
          probabilities(query, key, sq, sk, b, bi, h, attention_mask, training, rng);
  return out;
}

CoreAttentionGrads DotProductAttention::backward(const Mat& dcontext, const Mat& query, const Mat& key,
                                                 const Mat& value, int sq, int sk, int b, const Tensor* attention_mask,
                                                 bool training, const DropoutRng& rng) const {
  if (dcontext.rows() != static_cast<Eigen::Index>(sq) * b || dcontext.cols() != static_cast<Eigen::Index>(np_) * hv_)
    throw ShapeError("DotProductAttention backward: grad of context expected [" + std::to_string(sq) + ", " +
                     std::to_string(b) + ", " + std::to_string(np_ * hv_) + "]");
  if (query.rows() != static_cast<Eigen::Index>(sq) * b * np_ || query.cols() != hn_ ||
      key.rows() != static_cast<Eigen::Index>(sk) * b * ng_ || key.cols() != hn_ || value.rows() != key.rows() ||
      value.cols() != hv_)
    throw ShapeError("DotProductAttention backward: query / key / value do not match [" + std::to_string(sq) + ", " +
                     std::to_string(b) + ", " + std::to_string(np_) + " / " + std::to_string(ng_) + ", " +
                     std::to_string(hn_) + " / " + std::to_string(hv_) + "]");
  if (attention_mask) check_attention_mask(*attention_mask, b, np_, sq, sk, "attention_mask");
  if (softmax_type_ == "learnable")
    throw ConfigError("DotProductAttention backward: the learnable softmax offset's gradient is not implemented");
  const bool upcast = input_in_float16_ && softmax_in_fp32_;
  const bool dropout = training && attention_dropout > 0.0;
  const int group = np_ / ng_;
  CoreAttentionGrads g;
  g.query = Mat::Zero(query.rows(), hn_);
  g.key = Mat::Zero(key.rows(), hn_);
  g.value = Mat::Zero(value.rows(), hv_);
  // One (b, query group) at a time, each on any thread: its key and value rows are its own, and
  // its heads add into them in head order at any thread count.
  for_chunks(static_cast<Eigen::Index>(b) * ng_, 1, [&](Eigen::Index bg, Eigen::Index) {
    const int bi = static_cast<int>(bg / ng_), kv = static_cast<int>(bg % ng_);
    Mat softmax_out;
    std::vector<bool> masked;
    for (int h = kv * group; h < (kv + 1) * group; ++h) {
      const Mat probs =
          probabilities(query, key, sq, sk, b, bi, h, attention_mask, training, rng, &softmax_out, &masked);
      Mat q(sq, hn_), k(sk, hn_), v(sk, hv_), dctx(sq, hv_);  // this (b, h) slice
      for (int i = 0; i < sq; ++i) {
        q.row(i) = query.row((static_cast<Eigen::Index>(i) * b + bi) * np_ + h);
        dctx.row(i) =
            dcontext.row(static_cast<Eigen::Index>(i) * b + bi).segment(static_cast<Eigen::Index>(h) * hv_, hv_);
      }
      for (int j = 0; j < sk; ++j) {
        k.row(j) = key.row((static_cast<Eigen::Index>(j) * b + bi) * ng_ + kv);
        v.row(j) = value.row((static_cast<Eigen::Index>(j) * b + bi) * ng_ + kv);
      }
      // bmm(probs, v)'s backward
      Mat dprobs = p_.act(dctx * v.transpose());        // rounds: [sq, sk] grad of probs, activation dtype
      const Mat dv = p_.act(probs.transpose() * dctx);  // rounds: [sk, hv] grad of v (this head)
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
  });
  p_.count_reduce(hv_);  // dctx . v
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
