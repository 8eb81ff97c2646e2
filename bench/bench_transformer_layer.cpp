// Google Benchmark suite of the dense TransformerLayer forward:
//   BM_ReferenceDenseLayer/<config>  the Eigen reference on the CPU (mirroring Megatron's rounding)
//   BM_OptimizedDenseLayer/<config>  the optimized twin on the GPU when one is present (device time of
//                                    a CUDA-graph replay of the layer; skipped with the reason otherwise)
//   BM_OptimizedMlaLayer/deepseek-v3 the same for a DeepSeek-V3-shaped layer with multi-latent attention
// Counters: TFLOP/s (the layer's GEMM + attention FLOPs per second) and, on the GPU, the fraction of
// the device's dense peak for the dtype (H100/H200 SXM: 989 TFLOP/s bf16/fp16 tensor cores, 67 fp32;
// override with TWIN_PEAK_TFLOPS). Write JSON with --benchmark_out=<file> --benchmark_out_format=json.
#include <benchmark/benchmark.h>

#include <cstdlib>
#include <map>
#include <string>

#include "bench/bench_util.h"
#include "optimized/transformer_layer.h"
#include "parity/dense_run.h"

using namespace twin;

namespace {

// Forward FLOPs: 2 m n k per GEMM; attention 2 s^2 hn per head for q k^T and for p v (halved when
// causal: the kernel skips the masked half), counted once although the kernel computes q k^T twice.
double layer_flops(const parity::DenseCase& c) {
  const double tok = double(c.s) * c.b, h = c.hidden, d = c.kv_channels;
  const double qkv = (c.heads + 2.0 * c.groups) * d, fc1 = (c.glu ? 2.0 : 1.0) * c.ffn;
  const double gemm = 2.0 * tok * h * (qkv + c.heads * d + fc1) + 2.0 * tok * c.ffn * h;
  double attn = 4.0 * c.b * c.heads * double(c.s) * c.s * d;
  if (c.mask == parity::MaskKind::Causal) attn /= 2.0;
  return gemm + attn;
}

const char* kCpuConfigs[] = {
    "dense(h=256,a=8,g=8,d=32,ffn=1024,norm=ln,act=gelu,glu=0,bias=1,qkv_bias=0,rope=none,rot=1,qkln=0,mask=causal,s="
    "64,b=2,dtype=bf16,tp=1,sp=0,drop=0,seed=1)",
    "dense(h=256,a=8,g=2,d=32,ffn=512,norm=rms,act=silu,glu=1,bias=0,qkv_bias=0,rope=half,rot=1,qkln=0,mask=causal,s="
    "64,b=2,dtype=bf16,tp=1,sp=0,drop=0,seed=2)",
};
// The first is the Llama-70B layer (ci/gpu-check --quick times gpu0 alone).
const char* kGpuConfigs[] = {
    // Llama-70B-like layer: GQA 64/8, SwiGLU, s 4096
    "dense(h=8192,a=64,g=8,d=128,ffn=28672,norm=rms,act=silu,glu=1,bias=0,qkv_bias=0,rope=half,rot=1,qkln=0,mask="
    "causal,s=4096,b=1,dtype=bf16,tp=1,sp=0,drop=0,seed=5)",
    // Llama-3-8B-like layer, GQA 32/8, SwiGLU
    "dense(h=4096,a=32,g=8,d=128,ffn=14336,norm=rms,act=silu,glu=1,bias=0,qkv_bias=0,rope=half,rot=1,qkln=0,mask="
    "causal,s=2048,b=1,dtype=bf16,tp=1,sp=0,drop=0,seed=3)",
    // GPT-3-1.3B-like layer
    "dense(h=2048,a=16,g=16,d=128,ffn=8192,norm=ln,act=gelu,glu=0,bias=1,qkv_bias=0,rope=none,rot=1,qkln=0,mask=causal,"
    "s=2048,b=2,dtype=bf16,tp=1,sp=0,drop=0,seed=4)",
};

void BM_ReferenceDenseLayer(benchmark::State& state, const char* id) {
  const parity::DenseCase c = parity::parse_case_id(id);
  const parity::DenseInputs in = parity::make_inputs(c);
  for (auto _ : state) benchmark::DoNotOptimize(parity::reference_forward(c, in, false));
  state.counters["TFLOP/s"] = benchmark::Counter(layer_flops(c) / 1e12, benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel(id);
}

// The device time of a CUDA-graph replay of the layer of `config` on the GPU, with its forward's
// FLOPs per second and fraction of the dtype's peak.
void time_graph_forward(benchmark::State& state, const TransformerConfig& config,
                        const std::map<std::string, Tensor>& params, const Tensor& x, const Tensor* rope,
                        double flops) {
  opt::LayerOptions lo;
  lo.backend = rt::Backend::Cuda;
  opt::DenseTransformerLayer layer(config, params, lo);
  opt::ForwardOptions fo;
  fo.use_graph = true;
  layer.forward(x, nullptr, rope, fo);  // capture
  for (auto _ : state) state.SetIterationTime(layer.time_forward_ms(10) / 1e3);
  state.counters["TFLOP/s"] = benchmark::Counter(flops / 1e12, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["fraction_of_peak"] =
      benchmark::Counter(flops / bench::peak_flops(x.dtype()), benchmark::Counter::kIsIterationInvariantRate);
}

void BM_OptimizedDenseLayer(benchmark::State& state, const char* id) {
  if (bench::skip_without_gpu(state)) return;
  const parity::DenseCase c = parity::parse_case_id(id);
  const parity::DenseInputs in = parity::make_inputs(c);
  time_graph_forward(state, in.config, in.params, in.hidden_states,
                     in.rotary_pos_emb.defined() ? &in.rotary_pos_emb : nullptr, layer_flops(c));
  state.SetLabel(id);
}

// A DeepSeek-V3-shaped layer with multi-latent attention (bench::deepseek_v3_layer) at s 4096.
void BM_OptimizedMlaLayer(benchmark::State& state, int s) {
  if (bench::skip_without_gpu(state)) return;
  const bench::DeepSeekLayer d = bench::deepseek_v3_layer(s);
  time_graph_forward(state, d.config, d.params, d.hidden_states, nullptr,
                     bench::deepseek_v3_forward_flops(d.config, s));
  state.SetLabel("deepseek-v3 mla s=" + std::to_string(s));
}

int register_all() {
  int i = 0;
  for (const char* id : kCpuConfigs)
    benchmark::RegisterBenchmark(("BM_ReferenceDenseLayer/cpu" + std::to_string(i++)).c_str(), BM_ReferenceDenseLayer,
                                 id)
        ->Unit(benchmark::kMillisecond);
  i = 0;
  for (const char* id : kGpuConfigs)
    benchmark::RegisterBenchmark(("BM_OptimizedDenseLayer/gpu" + std::to_string(i++)).c_str(), BM_OptimizedDenseLayer,
                                 id)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("BM_OptimizedMlaLayer/deepseek-v3", BM_OptimizedMlaLayer, 4096)
      ->UseManualTime()
      ->Unit(benchmark::kMillisecond);
  return 0;
}
const int registered = register_all();

}  // namespace

BENCHMARK_MAIN();
