// Simulator speed: one 256 x 1024 bf16 RMSNorm launch with 256 threads per block (65536 CUDA
// threads as fibers). Arg = worker threads: 1 (the acceptance figure: < 50 ms), 0 = the default
// (CUDASIM_WORKERS, else hardware threads). Run: build/bin/bench_rmsnorm_sim [--benchmark_format=json]
#include "bench/kernels/rmsnorm_bench.cuh"
#include "optimized/runtime/cudasim_options.h"
#include "optimized/runtime/device.h"

#include <benchmark/benchmark.h>

#include <cmath>
#include <string>
#include <vector>

static void BM_RmsNormSimLaunch(benchmark::State& state) {
  const int rows = 256, hidden = 1024, threads = 256;
  const cudasim::Options saved = cudasim::options();
  cudasim::Options o = saved;
  if (state.range(0) > 0) o.workers = static_cast<int>(state.range(0));
  cudasim::set_options(o);

  twin::rt::Device& d = twin::rt::device(twin::rt::Backend::Sim);
  std::vector<__nv_bfloat16> x(rows * hidden), w(hidden), y(rows * hidden);
  for (int i = 0; i < rows * hidden; ++i) x[i] = __float2bfloat16(std::sin(0.01f * i));
  for (int i = 0; i < hidden; ++i) w[i] = __float2bfloat16(1.0f + 0.001f * i);
  twin::rt::DeviceBuffer dx(d, x.size() * 2), dw(d, w.size() * 2), dy(d, y.size() * 2);
  dx.upload(x.data(), x.size() * 2);
  dw.upload(w.data(), w.size() * 2);

  for (auto _ : state) {
    launch_kernel(bench::rmsnorm_forward_kernel, rows, threads, 0, nullptr, dx.as<const __nv_bfloat16>(),
                  dw.as<const __nv_bfloat16>(), dy.as<__nv_bfloat16>(), hidden, 1e-5f);
  }

  // Sanity check of row 0 (a wrong kernel would make the timing meaningless).
  dy.download(y.data(), y.size() * 2);
  double ss = 0;
  for (int i = 0; i < hidden; ++i) ss += double(__bfloat162float(x[i])) * __bfloat162float(x[i]);
  const double rstd = 1.0 / std::sqrt(ss / hidden + 1e-5);
  for (int i = 0; i < hidden; ++i) {
    const double ref = __bfloat162float(x[i]) * rstd * __bfloat162float(w[i]);
    if (std::abs(__bfloat162float(y[i]) - ref) > 1e-2 * std::abs(ref) + 1e-6) {  // ~2 bf16 roundings
      state.SkipWithError("RMSNorm result is wrong");
      break;
    }
  }
  state.SetLabel(std::to_string(rows) + "x" + std::to_string(hidden) + " bf16, " + std::to_string(threads) +
                 " threads/block, " + std::to_string(cudasim::options().workers) + " worker(s)");
  cudasim::set_options(saved);
}
BENCHMARK(BM_RmsNormSimLaunch)->Arg(1)->Arg(0)->Unit(benchmark::kMillisecond)->UseRealTime();

BENCHMARK_MAIN();
