// Google Benchmark suite of the optimized MoE steps on the CUDA simulator (no GPU here):
//   BM_MoERouter         the fused score / top-k kernel over [T, E] logits
//   BM_MoEPermute        row-id map + permute of [T, h] tokens and their probabilities
//   BM_MoEGroupedGemm    linear_fc1 of all experts as one grouped GEMM
//   BM_MoEUnpermute      the combine: [N, h] rows back to [T, h] tokens
//   BM_MoELayer          the whole MoETransformerLayer forward (attention included)
//   BM_MoERouterBackward the router's backward kernel (score function, aux loss, z-loss) over [T, E]
//   BM_MoELayerBackward  the whole layer's backward after one kept forward (its three phases)
// Counters: bytes moved (permute / unpermute: read + written), FLOP/s of the grouped GEMM. The
// simulator's times measure the host, not a device: they track regressions of the kernels' work,
// not GPU speed. Write JSON with --benchmark_out=<file> --benchmark_out_format=json.
#include <benchmark/benchmark.h>

#include <memory>
#include <random>

#include "optimized/moe/experts.cuh"
#include "optimized/moe/moe_transformer_layer.h"
#include "optimized/moe/router.cuh"
#include "optimized/moe/token_dispatcher.cuh"
#include "parity/dense_case.h"

using namespace twin;
namespace k = twin::opt::sim;

namespace {

constexpr std::int64_t kT = 256, kH = 256, kFfn = 512;
constexpr int kE = 8, kTopk = 2;
constexpr DType kDt = DType::BF16;

rt::Device& dev() { return rt::device(rt::Backend::Sim); }

rt::DeviceBuffer random_buffer(DType dt, std::int64_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> g(0.0, 1.0);
  std::vector<double> v(static_cast<std::size_t>(n));
  for (auto& x : v) x = g(rng);
  const Tensor t = Tensor::from_doubles(dt, {n}, v);
  rt::DeviceBuffer b(dev(), t.nbytes());
  b.upload(t.raw(), t.nbytes());
  return b;
}

// A routing of kT tokens to kTopk of kE experts: the router kernel's own output.
struct Routed {
  rt::DeviceBuffer logits, probs, map, tpe, offsets, rows;
  std::vector<std::int64_t> tokens_per_expert;
  std::int64_t N = 0;
};
Routed route() {
  Routed r;
  r.logits = random_buffer(kDt, kT * kE, 1);
  r.probs = rt::DeviceBuffer(dev(), kT * kE * dtype_size(kDt));
  r.map = rt::DeviceBuffer(dev(), kT * kE);
  r.tpe = rt::DeviceBuffer(dev(), kE * 8);
  r.offsets = rt::DeviceBuffer(dev(), (kE + 1) * 8);
  r.rows = rt::DeviceBuffer(dev(), kT * kE * 8);
  k::RouterArgs a;
  a.tokens = kT;
  a.experts = kE;
  a.topk = kTopk;
  k::router_topk_forward(kDt, r.logits.get(), nullptr, nullptr, r.probs.get(), r.map.as<std::uint8_t>(), nullptr,
                         nullptr, nullptr, a, nullptr);
  k::build_row_id_map(r.map.as<std::uint8_t>(), kT, kE, r.tpe.as<std::int64_t>(), r.offsets.as<std::int64_t>(),
                      r.rows.as<std::int64_t>(), nullptr);
  r.tokens_per_expert.resize(kE);
  r.tpe.download(r.tokens_per_expert.data(), kE * 8);
  for (auto n : r.tokens_per_expert) r.N += n;
  return r;
}

void BM_MoERouter(benchmark::State& state) {
  Routed r = route();
  k::RouterArgs a;
  a.tokens = kT;
  a.experts = kE;
  a.topk = kTopk;
  for (auto _ : state) {
    k::router_topk_forward(kDt, r.logits.get(), nullptr, nullptr, r.probs.get(), r.map.as<std::uint8_t>(), nullptr,
                           nullptr, nullptr, a, nullptr);
    dev().synchronize();
  }
  state.SetLabel("T=256 E=8 k=2 softmax bf16");
}

void BM_MoEPermute(benchmark::State& state) {
  Routed r = route();
  rt::DeviceBuffer x = random_buffer(kDt, kT * kH, 2), out(dev(), r.N * kH * dtype_size(kDt)),
                   pp(dev(), r.N * dtype_size(kDt));
  for (auto _ : state) {
    k::build_row_id_map(r.map.as<std::uint8_t>(), kT, kE, r.tpe.as<std::int64_t>(), r.offsets.as<std::int64_t>(),
                        r.rows.as<std::int64_t>(), nullptr);
    k::permute_forward(kDt, kDt, x.get(), r.rows.as<std::int64_t>(), r.probs.get(), out.get(), pp.get(), kT, kE, kH,
                       r.N, nullptr);
    dev().synchronize();
  }
  // read: the routed tokens' rows and the map; written: the permuted rows and probabilities
  const double bytes = 2.0 * r.N * kH * dtype_size(kDt) + kT * kE * (1 + 8) + 2.0 * r.N * dtype_size(kDt);
  state.counters["bytes"] = bytes;
  state.counters["bytes/s"] = benchmark::Counter(bytes, benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel("T=256 E=8 k=2 h=256 bf16");
}

void BM_MoEGroupedGemm(benchmark::State& state) {
  Routed r = route();
  rt::DeviceBuffer x = random_buffer(kDt, r.N * kH, 3), w = random_buffer(kDt, kE * kFfn * kH, 4),
                   y(dev(), r.N * kFfn * dtype_size(kDt));
  for (auto _ : state) {
    k::grouped_linear_forward(rt::Backend::Sim, kDt, x.get(), w.get(), y.get(), r.tokens_per_expert, kH, kFfn, nullptr);
    dev().synchronize();
  }
  state.counters["FLOP/s"] = benchmark::Counter(2.0 * r.N * kH * kFfn, benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel("N=512 rows, 8 groups, h=256 -> 512 bf16");
}

void BM_MoEUnpermute(benchmark::State& state) {
  Routed r = route();
  rt::DeviceBuffer rows = random_buffer(kDt, r.N * kH, 5), out(dev(), kT * kH * dtype_size(kDt));
  for (auto _ : state) {
    k::unpermute_forward(kDt, rows.get(), r.rows.as<std::int64_t>(), out.get(), kT, kE, kH, r.N, nullptr);
    dev().synchronize();
  }
  const double bytes = (double(r.N) + kT) * kH * dtype_size(kDt) + kT * kE * 8.0;
  state.counters["bytes"] = bytes;
  state.counters["bytes/s"] = benchmark::Counter(bytes, benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel("T=256 E=8 k=2 h=256 bf16");
}

void BM_MoERouterBackward(benchmark::State& state) {
  Routed r = route();
  const rt::DeviceBuffer dprobs = random_buffer(kDt, kT * kE, 2);
  rt::DeviceBuffer aux = random_buffer(DType::F32, kT * kE, 3), dlogits(dev(), kT * kE * dtype_size(kDt));
  k::RouterBackwardArgs a;
  a.tokens = kT;
  a.experts = kE;
  a.topk = kTopk;
  a.z_loss = true;
  a.z_coeff = 1e-3;
  for (auto _ : state)
    k::router_topk_backward(kDt, r.logits.get(), dprobs.get(), r.map.as<std::uint8_t>(), r.map.as<std::uint8_t>(),
                            aux.as<float>(), nullptr, dlogits.get(), a, nullptr);
  state.SetLabel("T=256 E=8 k=2 softmax aux z-loss bf16");
}

// The layer both MoELayer benchmarks run: s 64, b 2, h 256, 8 experts, top-2, SwiGLU ffn 512, bf16.
struct MoELayerCase {
  parity::DenseInputs in;
  std::unique_ptr<opt::MoETransformerLayer> layer;
};
MoELayerCase moe_layer_case() {
  parity::DenseCase d = parity::parse_case_id(
      "dense(h=256,a=8,g=8,d=32,ffn=512,norm=rms,act=silu,glu=1,bias=0,qkv_bias=0,rope=none,rot=1,qkln=0,"
      "mask=causal,s=64,b=2,dtype=bf16,tp=1,sp=0,drop=0,seed=1)");
  const parity::DenseInputs in = parity::make_inputs(d);
  TransformerConfig c = in.config;
  c.num_moe_experts = kE;
  c.moe_router_topk = kTopk;
  c.moe_ffn_hidden_size = kFfn;
  std::map<std::string, Tensor> params;
  for (const auto& [key, t] : in.params)
    if (key.rfind("mlp.", 0) != 0) params[key] = t;
  std::mt19937_64 rng(9);
  std::normal_distribution<double> g(0.0, 0.05);
  auto random = [&](Shape s) {
    std::vector<double> v(static_cast<std::size_t>(shape_numel(s)));
    for (auto& x : v) x = g(rng);
    return Tensor::from_doubles(kDt, s, v);
  };
  params["mlp.router.weight"] = random({kE, kH});
  for (int e = 0; e < kE; ++e) {
    const std::string p = "mlp.experts.local_experts." + std::to_string(e) + ".";
    params[p + "linear_fc1.weight"] = random({2 * kFfn, kH});
    params[p + "linear_fc2.weight"] = random({kH, kFfn});
  }
  return {in, std::make_unique<opt::MoETransformerLayer>(c, params, opt::LayerOptions{})};
}

void BM_MoELayer(benchmark::State& state) {
  MoELayerCase m = moe_layer_case();
  for (auto _ : state)
    benchmark::DoNotOptimize(m.layer->forward(m.in.hidden_states, opt::MoEForwardInputs{}).hidden_states);
  state.SetLabel("s=64 b=2 h=256 E=8 k=2 swiglu ffn=512 bf16");
}

void BM_MoELayerBackward(benchmark::State& state) {
  MoELayerCase m = moe_layer_case();
  opt::ForwardOptions fo;
  fo.training = true;
  fo.keep_for_backward = true;
  m.layer->forward(m.in.hidden_states, opt::MoEForwardInputs{}, fo);
  const Tensor dout = m.in.hidden_states;  // any gradient of the output's shape and dtype
  for (auto _ : state) benchmark::DoNotOptimize(m.layer->backward(dout).hidden_states);
  state.SetLabel("s=64 b=2 h=256 E=8 k=2 swiglu ffn=512 bf16");
}

}  // namespace

BENCHMARK(BM_MoERouter)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_MoEPermute)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_MoEGroupedGemm)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_MoEUnpermute)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_MoELayer)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_MoERouterBackward)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_MoELayerBackward)->Unit(benchmark::kMillisecond);
BENCHMARK_MAIN();
