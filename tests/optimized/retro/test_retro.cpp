// The optimized Retro decoder's pieces on the simulator: the device index maps against the
// reference's RowMaps (reference/retro/chunking.h) entry for entry, the gather kernel against the
// reference's gather (bitwise: a copy), and the errors a caller gets before anything runs.
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <cstring>

#include "optimized/retro/retro_kernels.cuh"
#include "optimized/retro/retro_layer.h"
#include "reference/retro/chunking.h"
#include "tests/case_id.h"
#include "tests/optimized/retro/retro_case.h"
#include "tests/optimized/sim_util.h"

using namespace twin;
using namespace twin::test;
namespace k = twin::opt::sim;
namespace ref = twin::reference::retro;

namespace {

std::vector<std::int64_t> device_map(const opt::RetroMapArgs& a) {
  const std::int64_t rows = a.out_rows();
  rt::DeviceBuffer buf(sim(), std::max<std::size_t>(std::size_t(rows) * sizeof(std::int64_t), 1));
  k::retro_build_map(a, buf.as<std::int64_t>(), nullptr);
  std::vector<std::int64_t> out(static_cast<std::size_t>(rows));
  if (rows) buf.download(out.data(), out.size() * sizeof(std::int64_t));
  return out;
}

// One chunking-map case: sequence length ns, batch bs, chunk length m (index bookkeeping: no dtype).
struct ChunkMapCase : proptest::PropertyCase {
  static constexpr const char* kKind = "retro_chunk_map";
  std::int64_t ns = 1, bs = 1, m = 1;
  template <class V>
  void fields(V& v) {
    v("ns", ns);
    v("bs", bs);
    v("m", m);
  }
};

// One neighbour-map case: r retrieved tokens per neighbour, N chunk rows, k neighbours.
struct NeighbourMapCase : proptest::PropertyCase {
  static constexpr const char* kKind = "retro_neighbour_map";
  std::int64_t r = 1, N = 1, k = 1;
  template <class V>
  void fields(V& v) {
    v("r", r);
    v("N", N);
    v("k", k);
  }
};

}  // namespace

// The chunking maps for every (ns, bs, m), divisible and not.
RC_GTEST_PROP(RetroMaps, ChunkingMapsEqualTheReference, ()) {
  const ChunkMapCase mc = *proptest::rerunnable<ChunkMapCase>(rc::gen::exec([] {
    ChunkMapCase c;
    c.m = *rc::gen::inRange(1, 9);
    c.ns = *rc::gen::inRange(1, 40);
    c.bs = *rc::gen::inRange(1, 4);
    return c;
  }));
  const std::int64_t m = mc.m, ns = mc.ns, bs = mc.bs;
  const std::int64_t l = ref::num_chunks(ns, m), pad = ref::attending_pad(ns, m);
  opt::RetroMapArgs a;
  a.ns = ns;
  a.bs = bs;
  a.m = m;
  a.l = l;
  a.pad = pad;
  a.map = opt::RetroMap::ChunkEncoderContext;
  RC_ASSERT(device_map(a) == ref::chunk_encoder_context_map(ns, bs, m));
  a.map = opt::RetroMap::PadAttendingChunks;
  RC_ASSERT(device_map(a) == ref::pad_attending_chunks_map(ns, bs, m));
  a.map = opt::RetroMap::UnchunkDecoderOutput;
  RC_ASSERT(device_map(a) == ref::unchunk_decoder_output_map(m, ns, bs, l, pad));
}

// The neighbour maps for every (r, N, k) and neighbour n.
RC_GTEST_PROP(RetroMaps, NeighbourMapsEqualTheReference, ()) {
  const NeighbourMapCase nc = *proptest::rerunnable<NeighbourMapCase>(rc::gen::exec([] {
    NeighbourMapCase c;
    c.r = *rc::gen::inRange(1, 12);
    c.N = *rc::gen::inRange(1, 10);
    c.k = *rc::gen::inRange(1, 5);
    return c;
  }));
  const std::int64_t r = nc.r, N = nc.N, kk = nc.k;
  opt::RetroMapArgs a;
  a.r = r;
  a.N = N;
  a.k = kk;
  a.map = opt::RetroMap::SplitNeighbors;
  for (std::int64_t n = 0; n < kk; ++n) {
    a.n = n;
    RC_ASSERT(device_map(a) == ref::split_neighbors_map(r, N, kk, n));
  }
  a.map = opt::RetroMap::StackNeighbors;
  RC_ASSERT(device_map(a) == ref::stack_neighbors_map(r, N, kk));
}

// 64-bit indices: a map past 2^31 rows computes its entries without overflow (checked on the
// host side of the same function the kernels call, at rows far beyond int32).
TEST(RetroMaps, IndicesAre64Bit) {
  opt::RetroMapArgs a;
  a.map = opt::RetroMap::SplitNeighbors;
  a.r = 3;
  a.N = std::int64_t{1} << 30;
  a.k = 4;
  a.n = 3;
  const std::int64_t o = 2 * a.N + (a.N - 1);  // t = 2, j = N - 1
  EXPECT_EQ(k::retro_src_row(a, o), 2 * a.N * a.k + (a.N - 1) * a.k + 3);
  EXPECT_GT(k::retro_src_row(a, o), std::int64_t{1} << 33);
}

// The gather kernel copies rows exactly, zeros where the map says -1.
TEST(RetroMaps, GatherEqualsTheReferenceBitwise) {
  for (DType dt : {DType::F32, DType::BF16})
    for (std::int64_t ns : {5, 8, 11}) {
      const std::int64_t bs = 2, d = 6, m = 4, l = ref::num_chunks(ns, m);
      const Tensor x = random_tensor(dt, {ns, bs, d}, -2, 2, std::uint64_t(ns));
      const rt::DeviceBuffer xd = to_device(x);
      rt::DeviceBuffer out(sim(), std::size_t(m * bs * l * d) * dtype_size(dt));
      opt::RetroMapArgs a;
      a.map = opt::RetroMap::ChunkEncoderContext;
      a.ns = ns;
      a.bs = bs;
      a.m = m;
      a.l = l;
      k::retro_gather_rows(dt, xd.get(), out.get(), a, ns * bs, int(d), nullptr);
      const Tensor got = from_device(out, dt, {m, bs * l, d}), want = ref::chunk_encoder_context(x, m);
      EXPECT_EQ(std::memcmp(got.raw(), want.raw(), want.nbytes()), 0) << dt_name(dt) << " ns=" << ns;
    }
}

// The scatter (every map's transpose, the backward of the gather) equals the reference's
// scatter_rows bitwise on every map, including the rows no output takes (left as they were: the
// caller's zeros).
TEST(RetroMaps, ScatterEqualsTheReferenceTransposeBitwise) {
  for (DType dt : {DType::F32, DType::BF16})
    for (std::int64_t ns : {5, 8, 11}) {
      const std::int64_t bs = 2, d = 3, m = 4, l = ref::num_chunks(ns, m), pad = ref::attending_pad(ns, m);
      opt::RetroMapArgs a;
      a.ns = ns;
      a.bs = bs;
      a.m = m;
      a.l = l;
      a.pad = pad;
      for (auto [map, want_map, in_rows] :
           {std::tuple{opt::RetroMap::ChunkEncoderContext, ref::chunk_encoder_context_map(ns, bs, m), ns * bs},
            std::tuple{opt::RetroMap::PadAttendingChunks, ref::pad_attending_chunks_map(ns, bs, m), ns * bs},
            std::tuple{opt::RetroMap::UnchunkDecoderOutput, ref::unchunk_decoder_output_map(m, ns, bs, l, pad),
                       m * bs * l}}) {
        a.map = map;
        const std::int64_t out_rows = a.out_rows();
        const Tensor dy = random_tensor(dt, {out_rows, d}, -2, 2, std::uint64_t(ns) + std::uint64_t(map));
        const rt::DeviceBuffer dyd = to_device(dy);
        rt::DeviceBuffer out = to_device(Tensor::zeros(dt, {in_rows, d}));
        k::retro_scatter_rows(dt, dyd.get(), out.get(), a, in_rows, int(d), nullptr);
        const Tensor got = from_device(out, dt, {in_rows, d});
        using twin::reference::Mat;
        const std::vector<double> dy64 = dy.to_f64();
        const Mat want_mat = ref::scatter_rows(Eigen::Map<const Mat>(dy64.data(), out_rows, d), want_map, in_rows);
        const Tensor want = Tensor::from_doubles(
            dt, {in_rows, d}, std::vector<double>(want_mat.data(), want_mat.data() + want_mat.size()));
        EXPECT_EQ(std::memcmp(got.raw(), want.raw(), want.nbytes()), 0)
            << dt_name(dt) << " ns=" << ns << " map " << int(map);
      }
    }
}

// ---- errors before anything runs ------------------------------------------------------------------

namespace {
RetroCase small_case(RetroKind kind) {
  RetroCase c;
  c.kind = kind;
  c.m = 2;
  c.k = 2;
  c.chunks = 1;
  c.ns = 5;
  c.bs = 1;
  c.heads = 2;
  c.head_dim = 4;
  return c;
}
std::map<std::string, Tensor> zero_params(const TransformerConfig& cfg, opt::retro::RetroLayerKind kind) {
  std::map<std::string, Tensor> p;
  for (const auto& [key, shape] : opt::retro::retro_layer_param_shapes(cfg, kind))
    p[key] = Tensor::zeros(DType::F32, shape);
  return p;
}
template <class E>
void expect_throw_with(const std::function<void()>& f, const std::string& text) {
  try {
    f();
    ADD_FAILURE() << "no exception; expected one mentioning '" << text << "'";
  } catch (const E& e) {
    EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
  }
}
}  // namespace

TEST(RetroErrors, UnsupportedConfigsAreRejectedByName) {
  using opt::retro::RetroLayerKind;
  TransformerConfig cfg = to_config(small_case(RetroKind::Later));
  const auto params = zero_params(cfg, RetroLayerKind::Retro);
  TransformerConfig rms = cfg;
  rms.normalization = "RMSNorm";
  expect_throw_with<ConfigError>([&] { opt::retro::RetroDecoderLayer(rms, params, RetroLayerKind::Retro, 6); },
                                 "FusedLayerNorm supports LayerNorm only");
  TransformerConfig tp = cfg;
  tp.tensor_model_parallel_size = 4;  // 2 heads
  expect_throw_with<ConfigError>([&] { opt::retro::RetroDecoderLayer(tp, params, RetroLayerKind::Retro, 6); },
                                 "must divide num_attention_heads 2");
  TransformerConfig sp = cfg;
  sp.tensor_model_parallel_size = 2;
  sp.sequence_parallel = true;
  expect_throw_with<ConfigError>([&] { opt::retro::RetroDecoderLayer(sp, params, RetroLayerKind::Retro, 6); },
                                 "unsupported: sequence_parallel: ");
  TransformerConfig gqa = cfg;
  gqa.num_query_groups = 1;
  expect_throw_with<ConfigError>(
      [&] { opt::retro::RetroDecoderLayer(gqa, zero_params(gqa, RetroLayerKind::Retro), RetroLayerKind::Retro, 6); },
      "Group query attention is not currently supported in cross attention");
  TransformerConfig no_chunk = cfg;
  no_chunk.retro_chunk_length.reset();
  expect_throw_with<ConfigError>([&] { opt::retro::RetroDecoderLayer(no_chunk, params, RetroLayerKind::Retro, 6); },
                                 "retro_chunk_length");
}

// What Megatron runs but the twin does not implement is named (the golden runner reports it
// unsupported), and the constructor rejects the same.
TEST(RetroErrors, UnimplementedFeaturesAreNamed) {
  using opt::retro::RetroLayerKind;
  const TransformerConfig cfg = to_config(small_case(RetroKind::Later));
  EXPECT_EQ(opt::retro::retro_decoder_unsupported(cfg), "");
  TransformerConfig fused = cfg;
  fused.bias_activation_fusion = true;
  EXPECT_NE(opt::retro::retro_decoder_unsupported(fused).find("bias_activation_fusion"), std::string::npos);
  expect_throw_with<ConfigError>(
      [&] { opt::retro::RetroDecoderLayer(fused, zero_params(cfg, RetroLayerKind::Retro), RetroLayerKind::Retro, 6); },
      "unsupported: bias_activation_fusion: ");
  TransformerConfig act = cfg;
  act.activation_func = "no_such_activation";
  EXPECT_EQ(opt::retro::retro_decoder_unsupported(act).rfind("activation_func: ", 0), 0u);
  TransformerConfig cp = cfg;
  cp.context_parallel_size = 2;
  EXPECT_NE(opt::retro::retro_decoder_unsupported(cp).find("context_parallel_size"), std::string::npos);
}

TEST(RetroErrors, GraphReplayRecordsNoTaps) {
  using opt::retro::RetroLayerKind;
  const TransformerConfig cfg = to_config(small_case(RetroKind::Later));
  opt::retro::RetroDecoderLayer layer(cfg, zero_params(cfg, RetroLayerKind::Retro), RetroLayerKind::Retro, 6);
  const Tensor h = Tensor::zeros(DType::F32, {5, 1, 8}), ctx = Tensor::zeros(DType::F32, {4, 3, 8});
  opt::retro::RetroForwardOptions o;
  o.use_graph = true;
  o.record_taps = true;
  expect_throw_with<std::invalid_argument>([&] { layer.forward(h, &ctx, nullptr, o); }, "use_graph records no taps");
}

// backward() names what it lacks: a forward that kept its activations, gradients of the forward's
// output and context shapes; keep_for_backward cannot ride a graph replay.
TEST(RetroErrors, BackwardNamesWhatItNeeds) {
  using opt::retro::RetroLayerKind;
  const TransformerConfig cfg = to_config(small_case(RetroKind::Later));
  opt::retro::RetroDecoderLayer layer(cfg, zero_params(cfg, RetroLayerKind::Retro), RetroLayerKind::Retro, 6);
  const Tensor h = Tensor::zeros(DType::F32, {5, 1, 8}), ctx = Tensor::zeros(DType::F32, {4, 3, 8});
  expect_throw_with<std::logic_error>([&] { layer.backward(h); }, "needs a forward run with keep_for_backward");
  opt::retro::RetroForwardOptions o;
  layer.forward(h, &ctx, nullptr, o);
  expect_throw_with<std::logic_error>([&] { layer.backward(h); }, "needs a forward run with keep_for_backward");
  o.keep_for_backward = true;
  layer.forward(h, &ctx, nullptr, o);
  expect_throw_with<ShapeError>(
      [&] {
        layer.backward(Tensor::zeros(DType::F32, {5, 1, 4}));
      },
      "grad_output expected F32 [5, 1, 8]");
  expect_throw_with<ShapeError>([&] { layer.backward(h, &h); }, "grad_context expected F32 [4, 3, 8]");
  EXPECT_EQ(layer.backward(h, &ctx).params.size(),
            opt::retro::retro_layer_param_keys(cfg, RetroLayerKind::Retro).size());
  o.use_graph = true;
  expect_throw_with<std::invalid_argument>([&] { layer.forward(h, &ctx, nullptr, o); },
                                           "keep_for_backward with use_graph");
}

TEST(RetroErrors, ParametersAreCheckedByKey) {
  using opt::retro::RetroLayerKind;
  const TransformerConfig cfg = to_config(small_case(RetroKind::First));
  auto params = zero_params(cfg, RetroLayerKind::RetroWithEncoder);
  auto missing = params;
  missing.erase("cross_attention.encoder.layers.0.cross_attention.attn.linear_q.weight");
  expect_throw_with<ShapeError>(
      [&] { opt::retro::RetroDecoderLayer(cfg, missing, RetroLayerKind::RetroWithEncoder, 6); },
      "missing parameter 'cross_attention.encoder.layers.0.cross_attention.attn.linear_q.weight'");
  // The later layer owns no encoder: the encoder's keys are not its own.
  expect_throw_with<ShapeError>([&] { opt::retro::RetroDecoderLayer(cfg, params, RetroLayerKind::Retro, 6); },
                                "is not one it owns");
  auto wrong = params;
  wrong["mlp.linear_fc1.weight"] = Tensor::zeros(DType::F32, {3, 3});
  expect_throw_with<ShapeError>([&] { opt::retro::RetroDecoderLayer(cfg, wrong, RetroLayerKind::RetroWithEncoder, 6); },
                                "mlp.linear_fc1.weight");
}

TEST(RetroErrors, ContextShapesAreNamed) {
  using opt::retro::RetroLayerKind;
  const RetroCase c = small_case(RetroKind::Later);
  const TransformerConfig cfg = to_config(c);
  opt::retro::RetroDecoderLayer later(cfg, zero_params(cfg, RetroLayerKind::Retro), RetroLayerKind::Retro, 6);
  const Tensor h = Tensor::zeros(DType::F32, {5, 1, 8});
  // l = ceil(5 / 2) = 3, r = 2, k = 2: the encoder output is [r*k, bs*l, d] = [4, 3, 8]
  const Tensor bad = Tensor::zeros(DType::F32, {4, 2, 8});
  expect_throw_with<ShapeError>([&] { later.forward(h, &bad, nullptr); }, "[r * k, bs * l, d] = [4, 3, 8]");
  expect_throw_with<std::invalid_argument>([&] { later.forward(h, nullptr, nullptr); }, "cannot be None");
  opt::retro::RetroDecoderLayer first(cfg, zero_params(cfg, RetroLayerKind::RetroWithEncoder),
                                      RetroLayerKind::RetroWithEncoder, 6);
  const Tensor neighbours = Tensor::zeros(DType::F32, {2, 6, 8});  // [r, k*bs*l, d]
  const Tensor bad_mask = Tensor::zeros(DType::BOOL, {6, 1, 3, 3});
  expect_throw_with<ShapeError>([&] { first.forward(h, &neighbours, &bad_mask); }, "context_mask expected BOOL");
  expect_throw_with<ShapeError>([&] { first.forward(h, &bad, nullptr); }, "[r, k * bs * l, d] = [2, 6, 8]");
  const Tensor wrong_h = Tensor::zeros(DType::F32, {5, 1, 7});
  expect_throw_with<ShapeError>([&] { first.forward(wrong_h, &neighbours, nullptr); }, "hidden_states expected");
}

// ---- one fixed case of each kind, end to end ------------------------------------------------------

// A first layer with a non-divisible sequence, context_mask and dropout in every call, in bf16:
// every tensor both twins record is compared, the encoder's taps among them, and all within the
// bound (a dropout stream off by one would fail the outputs by far).
TEST(RetroLayer, FixedCasesMatchTheReferenceTapByTap) {
  for (RetroKind kind : {RetroKind::Later, RetroKind::First, RetroKind::Block}) {
    RetroCase c = small_case(kind);
    c.ns = 7;
    c.m = 3;
    c.k = 3;
    c.chunks = 2;
    c.encoder_layers = 2;
    c.bs = 2;
    c.dtype = DType::BF16;
    c.dropout = 0.2;
    c.context_mask = kind != RetroKind::Later;
    c.seed = 7;
    SCOPED_TRACE(to_id(c));
    const RetroRun ref = run_reference(c), opt = run_optimized(c);
    const auto rows = compare_runs(opt, ref);
    std::size_t encoder_taps = 0;
    for (const auto& row : rows) {
      EXPECT_TRUE(row.pass) << row.name << ": max abs " << row.max_abs << " share " << row.share_used << " "
                            << row.message;
      encoder_taps += row.name.find("encoder.layers.") != std::string::npos;
    }
    EXPECT_GE(rows.size(), kind == RetroKind::Later ? 20u : 40u);
    if (kind != RetroKind::Later) {
      EXPECT_GT(encoder_taps, 10u);
    }
  }
}

// One first layer replaying its graph across calls: a new sequence length (new buffer shapes) or
// a new dropout seed captures anew, the same ones replay; every call equals an eager twin built
// from the same params bit for bit (dropout on: a stale seed or offset would change the masks).
TEST(RetroGraph, RecapturesWhenShapesOrDropoutChange) {
  using opt::retro::RetroLayerKind;
  RetroCase c = small_case(RetroKind::First);
  c.dropout = 0.2;
  const TransformerConfig cfg = to_config(c);
  std::map<std::string, Tensor> params;
  std::uint64_t i = 0;
  for (const auto& [key, shape] : opt::retro::retro_layer_param_shapes(cfg, RetroLayerKind::RetroWithEncoder))
    params[key] = random_tensor(DType::F32, shape, -0.5, 0.5, ++i);
  opt::retro::RetroDecoderLayer graph(cfg, params, RetroLayerKind::RetroWithEncoder, 6);
  opt::retro::RetroDecoderLayer eager(cfg, params, RetroLayerKind::RetroWithEncoder, 6);
  auto bits = [](const Tensor& a, const Tensor& b) {
    return a.shape() == b.shape() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
  };
  // m = 2, r = 2, k = 2, bs = 1: ns 5 -> l = 3, ns 7 -> l = 4; neighbours [r, k*bs*l, d]. Each
  // call changes one thing a captured graph bakes in (shape, seed, offset, training) or none.
  struct Call {
    std::int64_t ns;
    std::uint64_t seed, offset;
    bool training;
  };
  const std::vector<Call> calls = {{5, 1, 0, true}, {5, 1, 0, true}, {7, 1, 0, true},  {7, 2, 0, true},
                                   {7, 2, 0, true}, {7, 2, 9, true}, {7, 2, 9, false}, {5, 1, 0, true}};
  for (std::size_t n = 0; n < calls.size(); ++n) {
    const auto [ns, seed, offset, training] = calls[n];
    SCOPED_TRACE("call " + std::to_string(n) + ": ns " + std::to_string(ns) + " seed " + std::to_string(seed) +
                 " offset " + std::to_string(offset) + (training ? " training" : " eval"));
    const std::int64_t l = (ns + 1) / 2;
    const Tensor h = random_tensor(DType::F32, {ns, 1, 8}, -1, 1, 100 + n);
    const Tensor neighbours = random_tensor(DType::F32, {2, 2 * l, 8}, -1, 1, 200 + n);
    opt::retro::RetroForwardOptions o;
    o.training = training;
    o.seed = seed;
    o.offset = offset;
    const auto want = eager.forward(h, &neighbours, nullptr, o);
    o.use_graph = true;
    const auto got = graph.forward(h, &neighbours, nullptr, o);
    EXPECT_TRUE(bits(got.hidden_states, want.hidden_states));
    ASSERT_TRUE(got.context && want.context);
    EXPECT_TRUE(bits(*got.context, *want.context));
  }
}
