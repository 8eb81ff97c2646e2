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

#include <string>

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

}  // namespace twin::bench
