// RetroEncoderCrossAttention, RetroEncoderBiasDropoutAdd and RetroEncoderLayerNorm: the neighbour
// split (batch column (b*l + chunk)*k + n), the neighbour-major stack of the bda output, the
// per-neighbour residual, and the layernorm's split/stack.
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <string>

#include "reference/retro/chunking.h"
#include "reference/retro/encoder_attention.h"
#include "tests/case_id.h"
#include "tests/reference/retro/retro_test_util.h"

using namespace twin;
using namespace twin::reference;
using namespace twin::reference::retro;

// Output row (t, n*N + j) of the bda is neighbour n's residual + (attention_output + bias) at (t, j).
TEST(RetroEncoderAttention, BiasDropoutAddStacksNeighbourMajor) {
  const std::int64_t r = 3, N = 4, k = 2, d = 2;
  std::vector<RetroEncoderAttentionTuple> tuples;
  for (std::int64_t n = 0; n < k; ++n) {
    RetroEncoderAttentionTuple t;
    t.attention_output = Mat(r * N, d);
    t.residual = Mat(r * N, d);
    for (std::int64_t i = 0; i < r * N; ++i)
      for (std::int64_t e = 0; e < d; ++e) {
        t.attention_output(i, e) = 100.0 * n + i + 0.125 * e;
        t.residual(i, e) = 1000.0 * (n + 1);
      }
    t.attention_bias = RowVec::Constant(d, 0.5);
    tuples.push_back(t);
  }
  const Mat out = retro_encoder_bias_dropout_add(tuples, N, 0.0, false, DropoutRng{}, Precision{});
  ASSERT_EQ(out.rows(), r * k * N);
  for (std::int64_t t = 0; t < r; ++t)
    for (std::int64_t n = 0; n < k; ++n)
      for (std::int64_t j = 0; j < N; ++j)
        for (std::int64_t e = 0; e < d; ++e)
          EXPECT_EQ(out(t * k * N + n * N + j, e), 1000.0 * (n + 1) + 100.0 * n + (t * N + j) + 0.125 * e + 0.5);
}

TEST(RetroEncoderAttention, BiasDropoutAddRejectsMismatchedNeighbours) {
  std::vector<RetroEncoderAttentionTuple> tuples(2);
  tuples[0].attention_output = tuples[0].residual = Mat::Zero(6, 2);
  tuples[1].attention_output = tuples[1].residual = Mat::Zero(4, 2);
  EXPECT_THROW(retro_encoder_bias_dropout_add(tuples, 2, 0.0, false, DropoutRng{}, Precision{}), ShapeError);
  EXPECT_THROW(retro_encoder_bias_dropout_add(tuples, 4, 0.0, false, DropoutRng{}, Precision{}), ShapeError);  // 6 % 4
}

// The split into k column blocks, norm, stack back equals norming every row: the blocks return
// to the rows they came from.
// One encoder-norm case: k neighbours, N columns each, r rows, the stored dtype, the data seed.
struct EncoderNormCase : proptest::PropertyCase {
  static constexpr const char* kKind = "retro_encoder_norm";
  int k = 1, N = 1, r = 1;
  DType dtype = DType::F32;
  std::uint64_t seed = 3;
  template <class V>
  void fields(V& v) {
    v("k", k);
    v("N", N);
    v("r", r);
    v("dtype", dtype);
    v("seed", seed);
  }
};

// In each stored dtype (parameters and input held in it): bitwise, as the same rows are normed.
RC_GTEST_PROP(RetroEncoderLayerNorm, SplitNormStackIsPerRow, ()) {
  const EncoderNormCase ec = *proptest::rerunnable<EncoderNormCase>(rc::gen::exec([] {
    EncoderNormCase c;
    c.k = *rc::gen::inRange(1, 4);
    c.N = *rc::gen::inRange(1, 4);
    c.r = *rc::gen::inRange(1, 4);
    c.dtype = *proptest::gen_case_dtype();
    c.seed = *rc::gen::inRange<std::uint32_t>(1, 1000);
    return c;
  }));
  const int k = ec.k, N = ec.N, r = ec.r, d = 8;
  const auto seed = static_cast<std::uint32_t>(ec.seed);
  RetroEncoderLayerNorm ln(k, std::make_unique<LayerNorm>(d, 1e-5, false, Precision{ComputeMode::FP32, ec.dtype}));
  ln.norm->load_state_dict(StateDict({{"weight", test::random_tensor({d}, seed).to(ec.dtype)},
                                      {"bias", test::random_tensor({d}, seed + 1).to(ec.dtype)}}),
                           "");
  const Mat x = to_mat(test::random_tensor({r, k * N, d}, seed + 2).to(ec.dtype), r * k * N, d, "x");
  const Mat a = ln.forward(x), b = ln.forward_split(x, k * N);
  RC_ASSERT(a == b);
  RC_ASSERT(a == ln.norm->forward(x));
}

TEST(RetroEncoderLayerNorm, UnevenSplitIsAClearError) {
  RetroEncoderLayerNorm ln(2, std::make_unique<LayerNorm>(4, 1e-5, false, Precision{}));
  EXPECT_THROW(ln.forward_split(Mat::Zero(9, 4), 3), ShapeError);
}

// Neighbour n of chunk j attends with Q = hidden_states[:, j*k + n]; its residual is that slice.
TEST(RetroEncoderAttention, EachNeighbourAttendsToItsChunk) {
  const TransformerConfig config = test::retro_config(4, 2, 2);  // r = 8, k = 2
  RetroEncoderCrossAttention attn(config, 1, AttnMaskType::padding, Precision{});
  StateDict sd;
  for (const auto& name :
       test::first_layer_fixture().names_with_prefix("param.cross_attention.encoder.layers.0.cross_attention."))
    sd.set(name.substr(std::string("param.cross_attention.encoder.layers.0.cross_attention.").size()),
           test::first_layer_fixture().tensor(name));
  attn.load_state_dict(sd, "");
  const std::int64_t N = 3, r = 8, k = 2, d = 64;
  const Tensor hidden = test::random_tensor({r, k * N, d}, 11);
  const Tensor context = test::random_tensor({4, N, d}, 12);
  AttentionArgs args;
  args.s = r;
  args.b = static_cast<int>(k * N);
  args.key_value_states = &context;
  TapRecord rec;
  const auto tuples = attn.forward_tuples(to_mat(hidden, r * k * N, d, "h"), args, Taps(&rec));
  ASSERT_EQ(tuples.size(), 2u);
  const Mat kv = to_mat(context, 4 * N, d, "kv");
  for (std::int64_t n = 0; n < k; ++n) {
    const Mat q = gather_rows(to_mat(hidden, r * k * N, d, "h"), split_neighbors_map(r, N, k, n));
    EXPECT_TRUE(tuples[n].residual == q);
    const AttentionOutput direct = attn.attn.forward_mats(q, 8, 3, kv, 4, nullptr, false, DropoutRng{}, Taps());
    EXPECT_TRUE(tuples[n].attention_output == direct.output);
    EXPECT_NE(rec.find(std::to_string(n) + ".2"), nullptr);
  }
  // hidden_states not [r, k * bs*l, d]
  args.b = 5;
  EXPECT_THROW(attn.forward_tuples(Mat::Zero(8 * 5, d), args, Taps()), ShapeError);
}
