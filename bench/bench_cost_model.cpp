// The optimized dense layer's cost model (optimized/runtime/cost_model.h), no GPU needed: one
// forward on the CUDA simulator under a CostScope collects every launch's declared minimal bytes
// and FLOPs; each kernel's roofline time on an H200 (4.8 TB/s, 989 TFLOP/s bf16 dense) follows.
// A MODEL: nothing here is measured.
//
//   bench_cost_model --table        the table per configuration on stdout
//   bench_cost_model [gbench args]  one benchmark per kernel, model/<kernel>/<case id>, whose
//                                   manual time is the roofline time (counters flops, bytes,
//                                   FLOP/B, roofline_us), so ci/bench stores it beside the
//                                   measured suites and the dashboard shows it as a table.
// The configurations: bench_reference_layers' dense shapes (small enough for the simulator), their
// backward at tp 1 (backward:<id>: the backward's launches alone, after a forward that kept what it
// reads), the MoE and Retro layers of goldens in fixtures/megatron-core (golden:<file>), run
// through the optimized twin's fixture handlers, and a DeepSeek-V3-shaped layer with multi-latent
// attention, forward and backward (deepseek-v3:<s>: its dense layers' shape, at a sequence of s
// tokens the simulator runs in seconds; the GEMMs' and elementwise kernels' bytes and FLOPs grow
// with s, the core attention's FLOPs with s^2).
#include <benchmark/benchmark.h>

#include <cstring>
#include <iostream>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "optimized/runtime/cost_model.h"
#include "optimized/transformer_layer.h"
#include "fixtures/fixture.h"
#include "parity/dense_case.h"
#include "parity/fixture_kinds.h"

using namespace twin;

namespace {

const char* kCases[] = {
    "dense(h=256,a=8,g=8,d=32,ffn=1024,norm=ln,act=gelu,glu=0,bias=1,qkv_bias=1,rope=none,rot=1,qkln=0,mask=causal,s="
    "64,b=2,dtype=bf16,tp=1,sp=0,drop=0,seed=1)",
    "dense(h=256,a=8,g=2,d=32,ffn=704,norm=rms,act=silu,glu=1,bias=0,qkv_bias=0,rope=half,rot=1,qkln=0,mask=causal,s="
    "64,b=2,dtype=bf16,tp=1,sp=0,drop=0,seed=2)",
    "backward:dense(h=256,a=8,g=8,d=32,ffn=1024,norm=ln,act=gelu,glu=0,bias=1,qkv_bias=1,rope=none,rot=1,qkln=0,mask="
    "causal,s=64,b=2,dtype=bf16,tp=1,sp=0,drop=0,seed=1)",
    "backward:dense(h=256,a=8,g=2,d=32,ffn=704,norm=rms,act=silu,glu=1,bias=0,qkv_bias=0,rope=half,rot=1,qkln=1,mask="
    "causal,s=64,b=2,dtype=bf16,tp=1,sp=0,drop=0,seed=2)",
    "golden:moe_top2_shared_expert_swiglu.safetensors",
    "golden:moe_top2_capacity_probs_drop.safetensors",
    "golden:retro_first_layer_cmask.safetensors",
    "golden:retro_block_6layers_nondivisible.safetensors",
    "deepseek-v3:32",
    "backward:deepseek-v3:32",
};

// A golden's layer through the optimized twin's fixture handler under a CostScope.
std::vector<rt::KernelCost> golden_costs(const std::string& file) {
  const Fixture f = load_fixture(golden_dir() + "/" + file);
  const FixtureHandler h = find_fixture_handler(f.kind, TwinKind::Optimized, RunMode{});
  if (!h) throw std::runtime_error(file + ": the optimized twin does not support kind " + f.kind);
  rt::CostScope scope;
  h(f, RunMode{});
  std::vector<rt::KernelCost> out = scope.kernels();
  out.push_back(scope.total());
  return out;
}

// One forward (or backward) of the optimized layer on the simulator under a CostScope.
std::vector<rt::KernelCost> layer_costs(const std::string& id) {
  if (id.rfind("golden:", 0) == 0) return golden_costs(id.substr(7));
  const bool backward = id.rfind("backward:", 0) == 0;
  const std::string layer_id = backward ? id.substr(9) : id;
  opt::LayerOptions lo;
  lo.backend = rt::Backend::Sim;
  opt::ForwardOptions fo;
  fo.keep_for_backward = backward;
  std::optional<rt::CostScope> scope;
  // One forward of `layer` (and with `backward` the backward's launches alone, for any [s, b, h]
  // output gradient) under the scope.
  auto run = [&](opt::DenseTransformerLayer& layer, const Tensor& x, const Tensor* mask, const Tensor* rope) {
    scope.emplace();
    layer.forward(x, mask, rope, fo);
    if (backward) {
      scope.emplace();
      layer.backward(x);
    }
  };
  if (layer_id.rfind("deepseek-v3:", 0) == 0) {
    const bench::DeepSeekLayer d = bench::deepseek_v3_layer(std::stoi(layer_id.substr(12)));
    opt::DenseTransformerLayer layer(d.config, d.params, lo);
    run(layer, d.hidden_states, nullptr, nullptr);
  } else {
    const parity::DenseCase c = parity::parse_case_id(layer_id);
    const parity::DenseInputs in = parity::make_inputs(c);
    lo.attn_mask_type = in.config.attn_mask_type;
    opt::DenseTransformerLayer layer(in.config, in.params, lo);
    run(layer, in.hidden_states, in.attention_mask.defined() ? &in.attention_mask : nullptr,
        in.rotary_pos_emb.defined() ? &in.rotary_pos_emb : nullptr);
  }
  std::vector<rt::KernelCost> out = scope->kernels();
  out.push_back(scope->total());
  return out;
}

void BM_CostModel(benchmark::State& state, rt::KernelCost k) {
  const rt::Roofline roof;
  for (auto _ : state) state.SetIterationTime(roof.seconds(k));
  state.counters["flops"] = k.flops;
  state.counters["bytes"] = k.bytes;
  state.counters["FLOP/B"] = k.intensity();
  state.counters["launches"] = k.launches;
  state.counters["roofline_us"] = roof.seconds(k) * 1e6;
  state.SetLabel(std::string("MODEL ") + roof.device + (roof.memory_bound(k) ? " memory-bound" : " compute-bound"));
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--table") == 0) {
      for (const char* id : kCases) {
        std::vector<rt::KernelCost> ks = layer_costs(id);
        ks.pop_back();  // cost_table adds its own total
        std::cout << id << "\n" << rt::cost_table(ks) << "\n";
      }
      return 0;
    }
  }
  for (const char* id : kCases)
    for (const rt::KernelCost& k : layer_costs(id))
      benchmark::RegisterBenchmark(("model/" + k.kernel + "/" + id).c_str(), BM_CostModel, k)
          ->UseManualTime()
          ->Iterations(1)
          ->Unit(benchmark::kMicrosecond);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
