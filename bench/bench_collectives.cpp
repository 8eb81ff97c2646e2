// Google Benchmark suite of the collectives the optimized twin's ranks call (optimized/runtime/
// collectives.h), each with its bus bandwidth as nccl-tests defines it (the bytes each rank's link
// carries per second: the algorithm bandwidth, one rank's buffer per second, times 2(n-1)/n for
// an all-reduce and (n-1)/n for an all-gather, a reduce-scatter and an all-to-all):
//   BM_CollectiveGpu/op/ranks  NCCL over `ranks` of this machine's GPUs, one thread per rank
//                              (ncclCommInitAll); skipped with the reason without NCCL or that many
//                              GPUs. The processes' path (ncclCommInitRank from an id MPI sends)
//                              runs the same NCCL calls.
//   BM_CollectiveSim/op/ranks  the simulator's threaded group in host memory, what a simulated
//                              layer's collectives cost.
// ops: 0 all_reduce (a row-parallel linear's output), 1 all_gather (sequence parallelism's input),
// 2 reduce_scatter (its output), 3 all_to_all (the MoE dispatcher's tokens, equal parts). Each
// rank's buffer: 32 MiB of bf16 on GPUs (s 4096 x h 4096), 4 MiB on the simulator. Time: the wall
// time of one call on every rank, to the last rank's stream synchronized.
#include <benchmark/benchmark.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "optimized/runtime/collectives.h"
#include "optimized/runtime/device.h"

#if TWIN_HAVE_NCCL
#include <cuda_runtime_api.h>
#endif

using namespace twin;

namespace {

enum Op { kAllReduce, kAllGather, kReduceScatter, kAllToAll };
constexpr const char* kOpNames[] = {"all_reduce", "all_gather", "reduce_scatter", "all_to_all"};

// One rank's send and receive buffers of `bytes` (all_gather's receive: n times that).
struct RankBuffers {
  void* send = nullptr;
  void* recv = nullptr;
};

// The collective `op` on rank r's buffers of `count` bf16 elements per rank.
void call(rt::Communicator& c, Op op, const RankBuffers& b, std::size_t count, int n, cudaStream_t s) {
  switch (op) {
    case kAllReduce:
      return c.all_reduce(b.send, b.recv, count, DType::BF16, s);
    case kAllGather:
      return c.all_gather(b.send, b.recv, count / std::size_t(n), DType::BF16, s);
    case kReduceScatter:
      return c.reduce_scatter(b.send, b.recv, count / std::size_t(n), DType::BF16, s);
    case kAllToAll: {
      const std::vector<std::size_t> parts(std::size_t(n), count / std::size_t(n));
      return c.all_to_all(b.send, parts, b.recv, parts, DType::BF16, s);
    }
  }
}

// Bandwidth counters of a call moving `bytes` per rank among n ranks.
void set_bandwidth(benchmark::State& state, Op op, std::size_t bytes, int n, const std::string& where) {
  const double factor = op == kAllReduce ? 2.0 * (n - 1) / n : double(n - 1) / n;
  state.counters["algbw_GB/s"] = benchmark::Counter(double(bytes) / 1e9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["busbw_GB/s"] =
      benchmark::Counter(double(bytes) * factor / 1e9, benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel(std::string(kOpNames[op]) + " of " + std::to_string(bytes >> 20) + " MiB bf16 per rank over " +
                 std::to_string(n) + " " + where);
}

void BM_CollectiveSim(benchmark::State& state) {
  const Op op = static_cast<Op>(state.range(0));
  const int n = static_cast<int>(state.range(1));
  const std::size_t count = std::size_t(2) << 20, bytes = count * 2;
  auto comms = rt::make_threaded_group(n);
  const auto ranks = static_cast<std::size_t>(n);
  std::vector<std::vector<char>> send(ranks, std::vector<char>(bytes)), recv(ranks, std::vector<char>(bytes));
  for (auto _ : state)
    rt::run_ranks(n, [&](int r) {
      call(*comms[std::size_t(r)], op, {send[std::size_t(r)].data(), recv[std::size_t(r)].data()}, count, n, nullptr);
    });
  set_bandwidth(state, op, bytes, n, "threaded simulated ranks");
}

void BM_CollectiveGpu(benchmark::State& state) {
  if (bench::skip_without_gpu(state)) return;
  const Op op = static_cast<Op>(state.range(0));
  const int n = static_cast<int>(state.range(1));
#if TWIN_HAVE_NCCL
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus < n) {
    state.SkipWithError(("needs " + std::to_string(n) + " GPUs, this machine has " + std::to_string(gpus)).c_str());
    for (auto _ : state) {
    }
    return;
  }
  const std::size_t count = std::size_t(16) << 20, bytes = count * 2;
  std::vector<int> devices;
  for (int d = 0; d < n; ++d) devices.push_back(d);
  auto comms = rt::make_nccl_group(devices);
  rt::Device& gpu = rt::device(rt::Backend::Cuda);
  const auto ranks = static_cast<std::size_t>(n);
  std::vector<std::unique_ptr<rt::DeviceBuffer>> send(ranks), recv(ranks);
  std::vector<std::unique_ptr<rt::Stream>> streams(ranks);
  rt::run_ranks(n, [&](int r) {
    cudaSetDevice(r);
    send[std::size_t(r)] = std::make_unique<rt::DeviceBuffer>(gpu, bytes);
    recv[std::size_t(r)] = std::make_unique<rt::DeviceBuffer>(gpu, bytes);
    streams[std::size_t(r)] = std::make_unique<rt::Stream>(gpu);
  });
  auto once = [&] {
    rt::run_ranks(n, [&](int r) {
      cudaSetDevice(r);
      call(*comms[std::size_t(r)], op, {send[std::size_t(r)]->get(), recv[std::size_t(r)]->get()}, count, n,
           streams[std::size_t(r)]->handle());
      streams[std::size_t(r)]->synchronize();
    });
  };
  once();  // warm-up: NCCL's connections and buffers
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    once();
    state.SetIterationTime(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  set_bandwidth(state, op, bytes, n, "GPUs (NCCL)");
#else
  state.SkipWithError("built without NCCL");
  for (auto _ : state) {
  }
  (void)op, (void)n;
#endif
}

void ops_and_ranks(benchmark::internal::Benchmark* b) {
  b->ArgNames({"op", "ranks"});
  for (int op = kAllReduce; op <= kAllToAll; ++op)
    for (int n : {2, 4}) b->Args({op, n});
}

}  // namespace

BENCHMARK(BM_CollectiveSim)->Apply(ops_and_ranks)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_CollectiveGpu)->Apply(ops_and_ranks)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK_MAIN();
