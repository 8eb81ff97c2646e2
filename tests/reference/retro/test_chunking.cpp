// Retro's reshuffles against Megatron's Python steps written literally with a torch-like array
// (tests/reference/retro/torch_like.h). Exact comparison: no arithmetic happens, values only move.
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <cmath>

#include "reference/retro/chunking.h"
#include "tests/case_id.h"
#include "tests/reference/retro/torch_like.h"

using namespace twin;
using namespace twin::reference::retro;
using twin::test::Nd;

namespace {

// 1, 2, 3, ... in dtype dt (every value drawn here is below 256: exact in bf16 and fp16 too).
Tensor iota(Shape s, DType dt = DType::F32, double start = 1.0) {
  std::vector<double> v(static_cast<std::size_t>(shape_numel(s)));
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = start + static_cast<double>(i);
  return Tensor::from_doubles(dt, s, v);
}

// One chunking case: chunk length m, ns tokens, bs samples, width d, in a stored dtype (values
// only move: the reshuffles keep the dtype and every bit).
struct ChunkCase : proptest::PropertyCase {
  static constexpr const char* kKind = "retro_chunks";
  int m = 1, ns = 1, bs = 1, d = 1;
  DType dtype = DType::F32;
  template <class V>
  void fields(V& v) {
    v("m", m);
    v("ns", ns);
    v("bs", bs);
    v("d", d);
    v("dtype", dtype);
  }
};
rc::Gen<ChunkCase> gen_chunk_case() {
  return proptest::rerunnable<ChunkCase>(rc::gen::exec([] {
    ChunkCase c;
    c.m = *rc::gen::inRange(1, 6);
    c.ns = *rc::gen::inRange(1, 20);
    c.bs = *rc::gen::inRange(1, 4);
    c.d = *rc::gen::inRange(1, 4);
    c.dtype = *proptest::gen_case_dtype();
    return c;
  }));
}

// One neighbour split/stack case: r rows, k neighbours, N = bs * l columns each, width d.
struct SplitCase : proptest::PropertyCase {
  static constexpr const char* kKind = "retro_split";
  int r = 1, k = 1, N = 1, d = 1;
  DType dtype = DType::F32;
  template <class V>
  void fields(V& v) {
    v("r", r);
    v("k", k);
    v("N", N);
    v("d", d);
    v("dtype", dtype);
  }
};

// decoder_attention.py, `if self.encoder:` branch.
Nd python_chunked_output(const Nd& h, std::int64_t m) {
  const std::int64_t ns = h.shape[0], bs = h.shape[1], d = h.shape[2];
  const std::int64_t l = static_cast<std::int64_t>(std::ceil(static_cast<double>(ns) / static_cast<double>(m)));
  const std::int64_t first_ns = ns % m;
  Nd chunked_output = h;
  if (first_ns > 0) {
    Nd first_chunk = h.slice0(0, first_ns), rest_chunk = h.slice0(first_ns, ns);
    first_chunk = first_chunk.pad0(0, m - first_ns);
    chunked_output = Nd::cat0(first_chunk, rest_chunk);
  }
  return chunked_output.reshape({l, m, bs, d}).permute({1, 2, 0, 3}).reshape({m, bs * l, d});
}

// decoder_attention.py, "Attend starting at last token of first chunk."
Nd python_padded_chunked_output(const Nd& h, std::int64_t m) {
  const std::int64_t ns = h.shape[0], bs = h.shape[1], d = h.shape[2];
  const std::int64_t l = static_cast<std::int64_t>(std::ceil(static_cast<double>(ns) / static_cast<double>(m)));
  const std::int64_t pad = (ns - 1) % m;
  Nd padded_chunks = h.slice0(pad, ns).pad0(0, m - 1);
  return padded_chunks.reshape({l, m, bs, d}).permute({1, 2, 0, 3}).reshape({m, bs * l, d});
}

// RetroDecoderBiasDropoutAdd._forward after the bias-dropout-add (residual excluded).
Nd python_unchunk(const Nd& x, std::int64_t m, std::int64_t ns, std::int64_t bs, std::int64_t l, std::int64_t pad) {
  const std::int64_t d = x.shape[2];
  Nd y = x.reshape({m, bs, l, d}).permute({2, 0, 1, 3}).reshape({m * l, bs, d});
  return y.pad0(pad, 0).slice0(0, ns);
}

}  // namespace

RC_GTEST_PROP(RetroChunking, EncoderContextMatchesPython, ()) {
  const ChunkCase cc = *gen_chunk_case();
  const std::int64_t m = cc.m, ns = cc.ns, bs = cc.bs, d = cc.d;
  const Tensor h = iota({ns, bs, d}, cc.dtype);
  const Tensor got = chunk_encoder_context(h, m);
  RC_ASSERT(got.dtype() == cc.dtype);
  const Nd want = python_chunked_output(Nd::from(h), m);
  RC_ASSERT(got.shape() == want.shape);
  RC_ASSERT(got.to_f64() == want.v);
}

RC_GTEST_PROP(RetroChunking, AttendingChunksMatchPython, ()) {
  const ChunkCase cc = *gen_chunk_case();
  const std::int64_t m = cc.m, ns = cc.ns, bs = cc.bs, d = cc.d;
  const Tensor h = iota({ns, bs, d}, cc.dtype);
  const Tensor got = pad_attending_chunks(h, m);
  RC_ASSERT(got.dtype() == cc.dtype);
  const Nd want = python_padded_chunked_output(Nd::from(h), m);
  RC_ASSERT(got.shape() == want.shape);
  RC_ASSERT(got.to_f64() == want.v);
}

RC_GTEST_PROP(RetroChunking, UnchunkMatchesPython, ()) {
  const ChunkCase cc = *gen_chunk_case();
  const std::int64_t m = cc.m, ns = cc.ns, bs = cc.bs, d = cc.d;
  const std::int64_t l = num_chunks(ns, m), pad = attending_pad(ns, m);
  const Tensor x = iota({m, bs * l, d}, cc.dtype);
  const Tensor got = unchunk_decoder_output(x, ns, bs, l, pad);
  RC_ASSERT(got.dtype() == cc.dtype);
  const Nd want = python_unchunk(Nd::from(x), m, ns, bs, l, pad);
  RC_ASSERT(got.shape() == want.shape);
  RC_ASSERT(got.to_f64() == want.v);
}

// Unchunking the attending chunks gives back the sequence, the first pad tokens zeroed: every
// token from pad on goes to exactly one chunk slot and comes back to its own position.
RC_GTEST_PROP(RetroChunking, UnchunkInvertsAttendingChunks, ()) {
  const ChunkCase cc = *gen_chunk_case();  // width 2 here, d unused
  const std::int64_t m = cc.m, ns = cc.ns, bs = cc.bs;
  const Tensor h = iota({ns, bs, 2}, cc.dtype);
  const std::int64_t l = num_chunks(ns, m), pad = attending_pad(ns, m);
  const Tensor back = unchunk_decoder_output(pad_attending_chunks(h, m), ns, bs, l, pad);
  const auto hv = h.to_f64(), bv = back.to_f64();
  for (std::int64_t s = 0; s < ns; ++s)
    for (std::int64_t j = 0; j < bs * 2; ++j) {
      const auto i = static_cast<std::size_t>(s * bs * 2 + j);
      RC_ASSERT(bv[i] == (s < pad ? 0.0 : hv[i]));
    }
}

RC_GTEST_PROP(RetroChunking, NeighbourSplitAndStackMatchPython, ()) {
  const SplitCase sc = *proptest::rerunnable<SplitCase>(rc::gen::exec([] {
    SplitCase c;
    c.r = *rc::gen::inRange(1, 6);
    c.k = *rc::gen::inRange(1, 4);
    c.N = *rc::gen::inRange(1, 5);  // bs * l
    c.d = *rc::gen::inRange(1, 4);
    c.dtype = *proptest::gen_case_dtype();
    return c;
  }));
  const std::int64_t r = sc.r, k = sc.k, N = sc.N, d = sc.d;
  const Tensor h = iota({r, N * k, d}, sc.dtype);
  const auto parts = split_neighbors(h, r, k);
  const Nd chunked_outputs = Nd::from(h).reshape({r, -1, k, d});
  std::vector<Nd> want_parts;
  for (std::int64_t n = 0; n < k; ++n) {
    const Nd want = chunked_outputs.select2(n);
    RC_ASSERT(parts[static_cast<std::size_t>(n)].to_f64() == want.v);
    want_parts.push_back(want);
  }
  // RetroEncoderBiasDropoutAdd: torch.stack(outputs, dim=1).reshape(r, -1, d)
  const Nd stacked = Nd::stack1(want_parts).reshape({r, -1, d});
  RC_ASSERT(stack_neighbors(parts).to_f64() == stacked.v);
  // RetroEncoderLayerNorm: split into k column blocks, stack back: the identity layout.
  const auto blocks = split_columns(h, k);
  std::vector<Nd> block_nds;
  for (const auto& b : blocks) block_nds.push_back(Nd::from(b));
  RC_ASSERT(Nd::stack1(block_nds).reshape({r, -1, d}).v == Nd::from(h).v);
}

// The neighbour batch index is (b * l + chunk) * k + neighbour.
TEST(RetroChunking, NeighbourIndexLayout) {
  const std::int64_t r = 2, k = 3, bs = 2, l = 2, d = 1;
  std::vector<double> v;
  for (std::int64_t t = 0; t < r; ++t)
    for (std::int64_t b = 0; b < bs; ++b)
      for (std::int64_t c = 0; c < l; ++c)
        for (std::int64_t n = 0; n < k; ++n) v.push_back(static_cast<double>(1000 * t + 100 * b + 10 * c + n));
  const Tensor h = Tensor::from_doubles(DType::F32, {r, k * bs * l, d}, v);
  const auto parts = split_neighbors(h, r, k);
  for (std::int64_t n = 0; n < k; ++n)
    for (std::int64_t t = 0; t < r; ++t)
      for (std::int64_t b = 0; b < bs; ++b)
        for (std::int64_t c = 0; c < l; ++c)
          EXPECT_EQ(parts[static_cast<std::size_t>(n)].at_f64(t * bs * l + b * l + c), 1000 * t + 100 * b + 10 * c + n);
}

TEST(RetroChunking, ClearErrors) {
  const Tensor h = iota({8, 2, 4});
  EXPECT_THROW(chunk_encoder_context(h, 0), ShapeError);
  EXPECT_THROW(pad_attending_chunks(h, 0), ShapeError);
  EXPECT_THROW(chunk_encoder_context(iota({8, 4}), 4), ShapeError);
  try {
    split_neighbors(iota({8, 7, 4}), 8, 2);
    FAIL() << "expected ShapeError";
  } catch (const ShapeError& e) {
    EXPECT_NE(std::string(e.what()).find("[8, 7, 4]"), std::string::npos) << e.what();
  }
  EXPECT_THROW(split_neighbors(iota({6, 8, 4}), 8, 2), ShapeError);               // r mismatch
  EXPECT_THROW(unchunk_decoder_output(iota({4, 3, 2}), 8, 2, 2, 3), ShapeError);  // bs*l mismatch
}
