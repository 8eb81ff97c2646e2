// RetroDecoderCrossAttention / RetroDecoderBiasDropoutAdd inside a whole Retro decoder layer
// (fixture weights, random inputs): which tokens the retrieved neighbours can reach, sequence
// lengths divisible and not divisible by the chunk length, and clear errors for shapes and
// configs that do not fit.
//
// A token's output is a function of its own row only after the cross attention (MLP, norms and
// bias-dropout-add are per token), and the encoder processes each chunk's neighbours
// independently, so "unaffected" tokens are compared for exact (bitwise) equality.
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <functional>
#include <set>
#include <string>

#include "reference/retro/chunking.h"
#include "reference/retro/decoder_attention.h"
#include "tests/case_id.h"
#include "tests/reference/retro/retro_test_util.h"

using namespace twin;
using namespace twin::test;
using twin::reference::LayerInputs;

namespace {

// One neighbour-reach case: chunk length m, k neighbours, retrieved chunks, ns tokens of bs
// samples, whether the layer is the first (owns the encoder); the chunk (pick_b, pick_c) whose
// neighbours are perturbed; the stored dtype and the seed of the inputs.
struct Case : proptest::PropertyCase {
  static constexpr const char* kKind = "retro_reach";
  int m = 1, k = 1, chunks = 1, ns = 1, bs = 1;
  bool with_encoder = true;
  int pick_b = 0, pick_c = 0;
  DType dtype = DType::F32;
  std::uint64_t seed = 1;
  std::int64_t l() const { return (ns + m - 1) / m; }
  std::int64_t pad() const { return (ns - 1) % m; }
  std::int64_t r() const { return static_cast<std::int64_t>(chunks) * m; }
  // neighbour embeddings [r, k*bs*l, d] (first layer) or encoder output [r*k, bs*l, d]
  Shape context_shape(std::int64_t d) const {
    return with_encoder ? Shape{r(), k * bs * l(), d} : Shape{r() * k, bs * l(), d};
  }
  template <class V>
  void fields(V& v) {
    v("m", m);
    v("k", k);
    v("chunks", chunks);
    v("ns", ns);
    v("bs", bs);
    v("encoder", with_encoder);
    v("pick_b", pick_b);
    v("pick_c", pick_c);
    v("dtype", dtype);
    v("seed", seed);
  }
};

Case fixed_case(int m, int k, int chunks, int ns, int bs, bool with_encoder) {
  Case c;
  c.m = m;
  c.k = k;
  c.chunks = chunks;
  c.ns = ns;
  c.bs = bs;
  c.with_encoder = with_encoder;
  return c;
}

rc::Gen<Case> gen_case(bool with_encoder) {
  return proptest::rerunnable<Case>(rc::gen::exec([with_encoder] {
    Case c;
    c.m = *rc::gen::inRange(1, 5);
    c.k = *rc::gen::inRange(1, 3);
    c.chunks = *rc::gen::inRange(1, 3);
    c.ns = *rc::gen::inRange(1, 3 * c.m + 2);
    c.bs = *rc::gen::inRange(1, 3);
    c.with_encoder = with_encoder;
    c.pick_b = *rc::gen::inRange(0, c.bs);
    c.pick_c = *rc::gen::inRange(0, static_cast<int>(c.l()));
    c.dtype = *proptest::gen_case_dtype();
    c.seed = *rc::gen::inRange<std::uint32_t>(1, 1000);
    return c;
  }));
}

std::pair<Tensor, std::optional<Tensor>> run(reference::TransformerLayer& layer, const Tensor& hidden,
                                             const Tensor& context) {
  LayerInputs in;
  in.context = &context;
  return layer.forward(hidden, in);
}

// Copy of `context` with every value of chunk (b, c) changed: the k neighbour columns
// (b*l + c)*k + n of the neighbour embeddings, or column b*l + c of the encoder output.
Tensor perturb_chunk(const Tensor& context, const Case& cs, std::int64_t b, std::int64_t c) {
  Tensor out = context.clone();
  float* v = out.data_mut<float>();
  const std::int64_t rows = context.size(0), cols = context.size(1), d = context.size(2);
  for (std::int64_t t = 0; t < rows; ++t)
    for (std::int64_t j = 0; j < cols; ++j) {
      const bool hit = cs.with_encoder ? j / cs.k == b * cs.l() + c : j == b * cs.l() + c;
      if (!hit) continue;
      for (std::int64_t e = 0; e < d; ++e) v[(t * cols + j) * d + e] += 0.5f + 0.25f * static_cast<float>(e % 3);
    }
  return out;
}

// The (s, b) tokens whose hidden vector differs between a and b ([s, b, d]).
std::set<std::pair<std::int64_t, std::int64_t>> changed_tokens(const Tensor& a, const Tensor& b) {
  std::set<std::pair<std::int64_t, std::int64_t>> out;
  const auto av = a.to_f64(), bv = b.to_f64();
  const std::int64_t S = a.size(0), B = a.size(1), d = a.size(2);
  for (std::int64_t s = 0; s < S; ++s)
    for (std::int64_t j = 0; j < B; ++j)
      for (std::int64_t e = 0; e < d; ++e) {
        const auto i = static_cast<std::size_t>((s * B + j) * d + e);
        if (av[i] != bv[i]) {
          out.insert({s, j});
          break;
        }
      }
  return out;
}

// In the case's dtype: parameters, hidden states and neighbours held in it, the layer storing in it.
void check_neighbour_reach(const Case& cs) {
  TransformerConfig config = retro_config(cs.m, cs.k, cs.chunks);
  set_params_dtype(config, cs.dtype);
  auto layer = retro_decoder_layer(config, cs.with_encoder);
  const std::int64_t d = config.hidden_size;
  const auto seed = static_cast<std::uint32_t>(cs.seed);
  const Tensor hidden = random_tensor({cs.ns, cs.bs, d}, seed).to(cs.dtype);
  const Tensor context = random_tensor(cs.context_shape(d), seed + 1);
  const auto [out, ctx] = run(*layer, hidden, context.to(cs.dtype));
  RC_ASSERT(out.dtype() == cs.dtype);
  RC_ASSERT(out.shape() == (Shape{cs.ns, cs.bs, d}));
  RC_ASSERT(ctx.has_value());
  RC_ASSERT(ctx->shape() == (Shape{cs.r() * cs.k, cs.bs * cs.l(), d}));
  // Changing the neighbours of chunk (b, c) changes exactly the tokens that attend to it:
  // positions pad + c*m .. pad + c*m + m - 1 (those < ns) of sample b.
  const std::int64_t b = cs.pick_b, c = cs.pick_c;
  const auto [out2, ctx2] = run(*layer, hidden, perturb_chunk(context, cs, b, c).to(cs.dtype));
  std::set<std::pair<std::int64_t, std::int64_t>> expected;
  for (std::int64_t s = cs.pad() + c * cs.m; s < cs.pad() + (c + 1) * cs.m && s < cs.ns; ++s) expected.insert({s, b});
  RC_ASSERT(changed_tokens(out, out2) == expected);

  // The first pad tokens are unaffected by the retrieved neighbours: all neighbours replaced.
  const auto [out3, ctx3] = run(*layer, hidden, random_tensor(cs.context_shape(d), seed + 2).to(cs.dtype));
  for (const auto& [s, j] : changed_tokens(out, out3)) RC_ASSERT(s >= cs.pad());
  // ... and every attending token is.
  RC_ASSERT(static_cast<std::int64_t>(changed_tokens(out, out3).size()) == (cs.ns - cs.pad()) * cs.bs);
}

}  // namespace

RC_GTEST_PROP(RetroDecoderAttention, NeighboursReachOnlyTheirChunkFirstLayer, ()) {
  check_neighbour_reach(*gen_case(true));
}

RC_GTEST_PROP(RetroDecoderAttention, NeighboursReachOnlyTheirChunkLaterLayer, ()) {
  check_neighbour_reach(*gen_case(false));
}

// Sequence lengths divisible and not divisible by the chunk length, explicitly (the properties
// above draw both too): the first pad = (ns - 1) % m tokens keep the self-attention result.
TEST(RetroDecoderAttention, DivisibleAndNonDivisibleSequenceLengths) {
  for (int ns : {8, 9, 10, 11, 3}) {
    SCOPED_TRACE("ns = " + std::to_string(ns));
    const Case cs = fixed_case(4, 2, 2, ns, 2, true);
    const TransformerConfig config = retro_config(cs.m, cs.k, cs.chunks);
    auto layer = retro_decoder_layer(config, true);
    const Tensor hidden = random_tensor({ns, 2, config.hidden_size}, 7);
    const Tensor context = random_tensor(cs.context_shape(config.hidden_size), 8);
    const auto [out, ctx] = run(*layer, hidden, context);
    ASSERT_EQ(out.shape(), (Shape{ns, 2, config.hidden_size}));
    ASSERT_EQ(ctx->shape(), (Shape{cs.r() * cs.k, 2 * cs.l(), config.hidden_size}));
    const auto [out2, ctx2] = run(*layer, hidden, random_tensor(cs.context_shape(config.hidden_size), 9));
    const auto changed = changed_tokens(out, out2);
    EXPECT_EQ(static_cast<std::int64_t>(changed.size()), (ns - cs.pad()) * 2);
    for (const auto& [s, b] : changed) EXPECT_GE(s, cs.pad());
  }
}

// RetroDecoderBiasDropoutAdd on known values: chunk outputs land at pad + chunk*m + i, the
// first pad tokens get only the residual, the bias is added once per attending token.
TEST(RetroDecoderAttention, BiasDropoutAddPlacesChunks) {
  const std::int64_t m = 3, ns = 7, bs = 2, d = 1, l = 3, pad = (ns - 1) % m;  // pad 0
  for (std::int64_t nsx : {ns, std::int64_t{8}}) {
    const std::int64_t padx = (nsx - 1) % m;
    reference::AttentionOutput x;
    x.output = reference::Mat(m * bs * l, d);
    for (std::int64_t i = 0; i < m; ++i)
      for (std::int64_t j = 0; j < bs * l; ++j) x.output(i * bs * l + j, 0) = 100.0 * i + j;  // x[i, b*l + c]
    x.bias = reference::RowVec::Constant(d, 0.5);
    x.extra = std::make_shared<reference::retro::RetroDecoderChunking>(
        reference::retro::RetroDecoderChunking{nsx, bs, d, l, padx, m});
    const reference::Mat residual = reference::Mat::Constant(nsx * bs, d, 1000.0);
    const reference::Mat out = reference::retro::retro_decoder_bias_dropout_add(
        x, residual, 0.0, false, reference::DropoutRng{}, reference::Precision{});
    for (std::int64_t s = 0; s < nsx; ++s)
      for (std::int64_t b = 0; b < bs; ++b) {
        double want = 1000.0;
        if (s >= padx) {
          const std::int64_t c = (s - padx) / m, i = (s - padx) % m;
          want += 100.0 * i + (b * l + c) + 0.5;
        }
        EXPECT_EQ(out(s * bs + b, 0), want) << "s " << s << " b " << b;
      }
  }
  (void)pad;
}

// ---- clear errors -----------------------------------------------------------------------------

void expect_shape_error(const std::function<void()>& f, const std::vector<std::string>& parts) {
  try {
    f();
    FAIL() << "expected ShapeError";
  } catch (const ShapeError& e) {
    for (const auto& p : parts)
      EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what() << "\nmissing: " << p;
  }
}

TEST(RetroDecoderAttention, NeighbourTensorNotRKBsLIsAClearError) {
  const TransformerConfig config = retro_config(4, 2, 2);  // r = 8, k = 2
  auto layer = retro_decoder_layer(config, true);
  const Tensor hidden = random_tensor({8, 2, 64}, 1);  // bs = 2, l = 2: [8, 8, 64] expected
  for (const Shape& bad : {Shape{8, 7, 64}, Shape{7, 8, 64}, Shape{8, 8, 32}, Shape{16, 4, 64}}) {
    const Tensor context = random_tensor(bad, 2);
    expect_shape_error([&] { run(*layer, hidden, context); }, {"[8, 8, 64]", shape_str(bad), "neighbour"});
  }
}

TEST(RetroDecoderAttention, EncoderOutputOfWrongShapeIsAClearError) {
  const TransformerConfig config = retro_config(4, 2, 2);
  auto layer = retro_decoder_layer(config, false);
  const Tensor hidden = random_tensor({9, 1, 64}, 1);  // l = 3: [16, 3, 64] expected
  const Tensor context = random_tensor({16, 2, 64}, 2);
  expect_shape_error([&] { run(*layer, hidden, context); }, {"[16, 3, 64]", "[16, 2, 64]"});
}

TEST(RetroDecoderAttention, ChunkLengthZeroIsAClearError) {
  TransformerConfig config = retro_config(4, 2, 2);
  config.retro_chunk_length = 0;
  config.retro_retrieved_length = 0;
  try {
    retro_decoder_layer(config, true);
    FAIL() << "expected ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("retro_chunk_length"), std::string::npos) << e.what();
  }
}

TEST(RetroDecoderAttention, RetrievedLengthNotChunksTimesChunkLengthIsAClearError) {
  TransformerConfig config = retro_config(4, 2, 2);
  config.retro_retrieved_length = 7;  // 2 * 4 = 8
  for (bool with_encoder : {true, false}) {
    try {
      retro_decoder_layer(config, with_encoder);
      FAIL() << "expected ConfigError";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("retro_retrieved_length"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("7"), std::string::npos) << e.what();
    }
  }
}

// The reach of the neighbours does not depend on the numerics: in bf16 (rounding at Megatron's
// storage points) and in training with dropout (the same seed gives the same masks), the first
// pad tokens stay bitwise unaffected and only the attending tokens change.
TEST(RetroDecoderAttention, ReachHoldsInBf16AndWithDropout) {
  for (int mode = 0; mode < 2; ++mode) {
    SCOPED_TRACE(mode == 0 ? "bf16" : "dropout 0.3, training");
    TransformerConfig config = retro_config(4, 2, 2);
    if (mode == 0) {
      config.bf16 = true;
      config.params_dtype = "bfloat16";
    } else {
      config.hidden_dropout = config.attention_dropout = 0.3;
      config.retro_encoder_hidden_dropout = config.retro_encoder_attention_dropout = 0.3;
    }
    auto layer = retro_decoder_layer(config, true);
    layer->training = mode == 1;
    layer->rng = reference::DropoutRng{1234, 0};
    const Case cs = fixed_case(4, 2, 2, 10, 2, true);  // pad = 1
    const DType dt = mode == 0 ? DType::BF16 : DType::F32;
    const Tensor hidden = random_tensor({10, 2, 64}, 31).to(dt);
    const Tensor context = random_tensor(cs.context_shape(64), 32).to(dt);
    const auto [out, ctx] = run(*layer, hidden, context);
    EXPECT_EQ(out.dtype(), dt);
    EXPECT_EQ(ctx->dtype(), dt);
    const auto [again, ctx_again] = run(*layer, hidden, context);
    EXPECT_EQ(out.to_f64(), again.to_f64());  // reproducible
    const auto [out2, ctx2] = run(*layer, hidden, random_tensor(cs.context_shape(64), 33).to(dt));
    const auto changed = changed_tokens(out, out2);
    EXPECT_EQ(static_cast<std::int64_t>(changed.size()), (10 - cs.pad()) * 2);
    for (const auto& [s, b] : changed) EXPECT_GE(s, cs.pad());
    if (mode == 1) {  // dropout is really applied in training
      layer->training = false;
      EXPECT_NE(run(*layer, hidden, context).first.to_f64(), out.to_f64());
    }
  }
}
