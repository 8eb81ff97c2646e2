// Google Benchmark of the reference dense TransformerLayer backward on the CPU:
//   BM_ReferenceDenseLayerBackward/<config>  backward(grad_output, saved) alone, after one forward
//                                             that saved the activations (the saved forward is not timed)
//   BM_ReferenceDenseLayerForwardBackward/<config>  forward(..., &saved) and backward together
//   BM_OptimizedDenseLayerBackward/<config>  the optimized twin's backward on the GPU when one is present
//                                             (device time of a CUDA-graph replay; skipped with the
//                                             reason otherwise), with the fraction of the device's
//                                             dense peak (bench_util.h peak_flops)
// Counter TFLOP/s: the backward's GEMM + attention FLOPs (twice the forward's: dgrad and wgrad of
// each GEMM, d probs / d v and d q / d k of attention) per second. Configs as in
// bench_transformer_layer.cpp's CPU set (parity/dense_case.h ids).
#include <benchmark/benchmark.h>

#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "optimized/transformer_layer.h"
#include "parity/dense_case.h"
#include "reference/transformer_layer.h"

using namespace twin;
using namespace twin::reference;

namespace {

// Backward FLOPs: 2 x the forward's 2 m n k per GEMM; attention 2 x 4 s^2 hn per head (halved
// when causal, as the forward's count).
double backward_flops(const parity::DenseCase& c) {
  const double tok = double(c.s) * c.b, h = c.hidden, d = c.kv_channels;
  const double qkv = (c.heads + 2.0 * c.groups) * d, fc1 = (c.glu ? 2.0 : 1.0) * c.ffn;
  const double gemm = 2.0 * tok * h * (qkv + c.heads * d + fc1) + 2.0 * tok * c.ffn * h;
  double attn = 4.0 * c.b * c.heads * double(c.s) * c.s * d;
  if (c.mask == parity::MaskKind::Causal) attn /= 2.0;
  return 2.0 * (gemm + attn);
}

const char* kConfigs[] = {
    "dense(h=256,a=8,g=8,d=32,ffn=1024,norm=ln,act=gelu,glu=0,bias=1,qkv_bias=0,rope=none,rot=1,qkln=0,mask=causal,s="
    "64,b=2,dtype=bf16,tp=1,sp=0,drop=0,seed=1)",
    "dense(h=256,a=8,g=2,d=32,ffn=512,norm=rms,act=silu,glu=1,bias=0,qkv_bias=0,rope=half,rot=1,qkln=0,mask=causal,s="
    "64,b=2,dtype=bf16,tp=1,sp=0,drop=0,seed=2)",
};

// The GPU configs: bench_transformer_layer.cpp's Llama-70B layer (its gpu0) and GPT-3-1.3B layer.
const char* kGpuConfigs[] = {
    "dense(h=8192,a=64,g=8,d=128,ffn=28672,norm=rms,act=silu,glu=1,bias=0,qkv_bias=0,rope=half,rot=1,qkln=0,mask="
    "causal,s=4096,b=1,dtype=bf16,tp=1,sp=0,drop=0,seed=5)",
    "dense(h=2048,a=16,g=16,d=128,ffn=8192,norm=ln,act=gelu,glu=0,bias=1,qkv_bias=0,rope=none,rot=1,qkln=0,mask=causal,"
    "s=2048,b=2,dtype=bf16,tp=1,sp=0,drop=0,seed=4)",
};

struct Setup {
  parity::DenseCase c;
  parity::DenseInputs in;
  LayerInputs li;
  Tensor grad_output;
  std::unique_ptr<TransformerLayer> layer;

  explicit Setup(const char* id) : c(parity::parse_case_id(id)), in(parity::make_inputs(c)) {
    const TransformerConfig& cfg = in.config;
    const ModuleSpec spec = get_gpt_layer_local_spec(std::nullopt, cfg.qk_layernorm, cfg.normalization, cfg.qk_l2_norm,
                                                     attn_mask_type_from_name(cfg.attn_mask_type));
    layer = std::make_unique<TransformerLayer>(cfg, spec.submodules, 1, std::nullopt, Precision::from_config(cfg));
    layer->load_state_dict(in.params);
    layer->training = in.training;
    li.attention_mask = in.attention_mask.defined() ? &in.attention_mask : nullptr;
    li.rotary_pos_emb = in.rotary_pos_emb.defined() ? &in.rotary_pos_emb : nullptr;
    std::mt19937_64 g(7);
    std::normal_distribution<double> n(0.0, 1.0);
    std::vector<double> v(static_cast<std::size_t>(in.hidden_states.numel()));
    for (double& x : v) x = static_cast<float>(n(g));
    grad_output = Tensor::from_doubles(in.hidden_states.dtype(), in.hidden_states.shape(), v);
  }
};

void BM_ReferenceDenseLayerBackward(benchmark::State& state, const char* id) {
  Setup st(id);
  TransformerLayerSaved saved;
  st.layer->forward(st.in.hidden_states, st.li, {}, &saved);
  for (auto _ : state) {
    state.PauseTiming();  // backward consumes what it is given: each iteration a copy of the forward's
    TransformerLayerSaved copy = saved;
    state.ResumeTiming();
    benchmark::DoNotOptimize(st.layer->backward(st.grad_output, std::move(copy)));
  }
  state.counters["TFLOP/s"] =
      benchmark::Counter(backward_flops(st.c) / 1e12, benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel(id);
}

void BM_ReferenceDenseLayerForwardBackward(benchmark::State& state, const char* id) {
  Setup st(id);
  for (auto _ : state) {
    TransformerLayerSaved saved;
    st.layer->forward(st.in.hidden_states, st.li, {}, &saved);
    benchmark::DoNotOptimize(st.layer->backward(st.grad_output, std::move(saved)));
  }
  state.SetLabel(id);
}

void BM_OptimizedDenseLayerBackward(benchmark::State& state, const char* id) {
  if (bench::skip_without_gpu(state)) return;
  const parity::DenseCase c = parity::parse_case_id(id);
  const parity::DenseInputs in = parity::make_inputs(c);
  opt::LayerOptions lo;
  lo.backend = rt::Backend::Cuda;
  opt::DenseTransformerLayer layer(in.config, in.params, lo);
  opt::ForwardOptions fo;
  fo.keep_for_backward = true;
  layer.forward(in.hidden_states, nullptr, in.rotary_pos_emb.defined() ? &in.rotary_pos_emb : nullptr, fo);
  layer.backward(in.hidden_states, false, /*use_graph=*/true);  // any [s, b, h] gradient; captures
  for (auto _ : state) state.SetIterationTime(layer.time_backward_ms(10) / 1e3);
  const double flops = backward_flops(c);
  state.counters["TFLOP/s"] = benchmark::Counter(flops / 1e12, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["fraction_of_peak"] =
      benchmark::Counter(flops / bench::peak_flops(c.dtype), benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel(id);
}

int register_all() {
  int i = 0;
  for (const char* id : kConfigs) {
    const std::string n = "/cpu" + std::to_string(i++);
    benchmark::RegisterBenchmark(("BM_ReferenceDenseLayerBackward" + n).c_str(), BM_ReferenceDenseLayerBackward, id)
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("BM_ReferenceDenseLayerForwardBackward" + n).c_str(),
                                 BM_ReferenceDenseLayerForwardBackward, id)
        ->Unit(benchmark::kMillisecond);
  }
  i = 0;
  for (const char* id : kGpuConfigs)
    benchmark::RegisterBenchmark(("BM_OptimizedDenseLayerBackward/gpu" + std::to_string(i++)).c_str(),
                                 BM_OptimizedDenseLayerBackward, id)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
  return 0;
}
const int registered = register_all();

}  // namespace

BENCHMARK_MAIN();
