// Google Benchmark suite of the GEMM interface (optimized/runtime/gemm.h) on a GPU; every row is
// skipped with the reason where no GPU is usable (ci/gpu-check runs it on one):
//   BM_ExpertGemmGpu/mode:0  the routed experts' linear_fc1 as one grouped GEMM (Gemm::run_grouped,
//                            the call the MoE layer's grouped_linear_forward makes:
//                            cublasGemmGroupedBatchedEx)
//   BM_ExpertGemmGpu/mode:1  the same groups as one cuBLASLt GEMM each
//   BM_ExpertGemmGpu/mode:2  one dense GEMM of equal FLOPs (all rows against one weight)
// Shape: DeepSeek-V3's routed expert (h 7168 -> moe_ffn_hidden_size 2048, bf16), 32 local experts
// (256 at ep 8) over 16384 routed rows in ragged counts. Time: CUDA events over 10 calls per
// iteration; counters TFLOP/s and fraction_of_peak (bench_util.h).
#include <benchmark/benchmark.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "core/dtype.h"
#include "optimized/runtime/device.h"
#include "optimized/runtime/gemm.h"

using namespace twin;

namespace {

enum ExpertGemmMode { kGrouped, kPerExpert, kDense };
constexpr std::int64_t kRows = 16384, kH = 7168, kFfn = 2048;
constexpr int kExperts = 32;
constexpr std::size_t kEs = 2;  // bf16

// Rows per expert: uniform weights in [0.5, 1.5), fixed seed, summing to kRows.
std::vector<std::int64_t> ragged_counts() {
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> u(0.5, 1.5);
  std::vector<double> w(kExperts);
  double sum = 0;
  for (double& x : w) sum += (x = u(rng));
  std::vector<std::int64_t> counts(kExperts);
  std::int64_t left = kRows;
  for (int e = 0; e + 1 < kExperts; ++e) left -= (counts[e] = std::int64_t(kRows * w[e] / sum));
  counts.back() = left;
  return counts;
}

// Random bf16 values in [-1, 1] (a 1 Mi-element draw, tiled): GEMM power, and so clocks, depend on
// the data, so no zeros.
void fill_bf16_pattern(rt::DeviceBuffer& b) {
  std::mt19937 rng(8);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<std::uint16_t> tile(std::size_t(1) << 20);
  for (auto& v : tile) v = float_to_bf16_bits(u(rng));
  std::vector<std::uint16_t> host(b.bytes() / kEs);
  for (std::size_t i = 0; i < host.size(); ++i) host[i] = tile[i % tile.size()];
  b.upload(host.data(), b.bytes());
}

// y[rows, out] = x[rows, in] w[out, in]^T as the column-major GEMM the twin's linears run
// (optimized/linear.cuh linear_gemm_args).
rt::GemmArgs linear(const void* x, const void* w, void* y, std::int64_t rows, std::int64_t in, std::int64_t out) {
  rt::GemmArgs g;
  g.transa = rt::Op::T, g.transb = rt::Op::N;
  g.m = out, g.n = rows, g.k = in;
  g.ab_dtype = g.cd_dtype = DType::BF16;
  g.a = w, g.lda = in, g.b = x, g.ldb = in;
  g.c = g.d = y, g.ldc = g.ldd = out;
  return g;
}

void BM_ExpertGemmGpu(benchmark::State& state) {
  if (bench::skip_without_gpu(state)) return;
  const auto mode = ExpertGemmMode(state.range(0));
  rt::Device& gpu = rt::device(rt::Backend::Cuda);
  rt::Gemm& gemm = rt::gemm(rt::Backend::Cuda);
  const std::vector<std::int64_t> counts = ragged_counts();
  rt::DeviceBuffer x(gpu, kRows * kH * kEs), w(gpu, kExperts * kFfn * kH * kEs), y(gpu, kRows * kFfn * kEs);
  fill_bf16_pattern(x), fill_bf16_pattern(w);
  std::vector<rt::GemmArgs> groups;  // expert e: its rows of x against its weight [kFfn, kH]
  std::int64_t row = 0;
  for (int e = 0; e < kExperts; ++e) {
    groups.push_back(linear(x.as<char>() + row * kH * kEs, w.as<char>() + e * kFfn * kH * kEs,
                            y.as<char>() + row * kFfn * kEs, counts[e], kH, kFfn));
    row += counts[e];
  }
  auto run = [&] {
    if (mode == kGrouped) {
      gemm.run_grouped(groups, nullptr);
    } else if (mode == kPerExpert) {
      for (const rt::GemmArgs& g : groups) gemm.run(g, nullptr);
    } else {
      gemm.run(linear(x.get(), w.get(), y.get(), kRows, kH, kFfn), nullptr);
    }
  };
  run();  // warm-up: libraries, handles, heuristics
  cudaEvent_t start = gpu.create_event(), end = gpu.create_event();
  constexpr int kReps = 10;
  for (auto _ : state) {
    gpu.record(start, nullptr);
    for (int i = 0; i < kReps; ++i) run();
    gpu.record(end, nullptr);
    gpu.synchronize(end);
    state.SetIterationTime(gpu.elapsed_ms(start, end) / kReps / 1e3);
  }
  gpu.destroy_event(start), gpu.destroy_event(end);
  const double flops = 2.0 * kRows * kH * kFfn;
  state.counters["TFLOP/s"] = benchmark::Counter(flops / 1e12, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["fraction_of_peak"] =
      benchmark::Counter(flops / bench::peak_flops(DType::BF16), benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel(std::string(mode == kGrouped     ? "grouped"
                             : mode == kPerExpert ? "per_expert"
                                                  : "dense") +
                 ": 16384 rows, 32 experts, 7168 -> 2048 bf16");
}

}  // namespace

BENCHMARK(BM_ExpertGemmGpu)
    ->ArgName("mode")
    ->Arg(kGrouped)
    ->Arg(kPerExpert)
    ->Arg(kDense)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_MAIN();
