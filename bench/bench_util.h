// Shared pieces of the CPU suites: the counters every benchmark reports, so the compare and
// dashboard tools (python/mcore_twin/bench.py) read one set of names.
//
// Counters (Google Benchmark JSON fields of each run):
//   flops, bytes   per iteration (a model of the op's arithmetic and of the minimal data it must
//                  touch in its storage dtype: inputs, weights, outputs once each)
//   FLOP/s, B/s    the same as rates over the measured time
// Benchmark names: <impl>/<op>/<case id>, impl = reference | libtorch, so the tools pair
// reference/<op>/<id> with libtorch/<op>/<id> into the reference / LibTorch time ratio.
#pragma once

#include <benchmark/benchmark.h>

#include <cstdlib>
#include <string>

#include "core/dtype.h"
#include "optimized/runtime/device.h"

namespace twin::bench {

inline void set_cost_counters(benchmark::State& state, double flops, double bytes) {
  state.counters["flops"] = benchmark::Counter(flops);
  state.counters["bytes"] = benchmark::Counter(bytes);
  state.counters["FLOP/s"] = benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["B/s"] = benchmark::Counter(bytes, benchmark::Counter::kIsIterationInvariantRate);
}

inline std::string bench_name(const std::string& impl, const std::string& op, const std::string& id) {
  return impl + "/" + op + "/" + id;
}

// The device's dense peak for the dtype (H100/H200 SXM: 989 TFLOP/s bf16/fp16 tensor cores, 67
// fp32), or TWIN_PEAK_TFLOPS.
inline double peak_flops(DType dt) {
  if (const char* p = std::getenv("TWIN_PEAK_TFLOPS")) return std::atof(p) * 1e12;
  return dt == DType::F32 ? 66.9e12 : 989.4e12;
}

// A GPU benchmark without a usable device: skipped with the reason (true), its loop run empty.
inline bool skip_without_gpu(benchmark::State& state) {
  std::string why;
  if (rt::available(rt::Backend::Cuda, &why)) return false;
  state.SkipWithError(("no GPU: " + why).c_str());
  for (auto _ : state) {
  }
  return true;
}

}  // namespace twin::bench
