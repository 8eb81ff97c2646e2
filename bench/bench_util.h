// Shared pieces of the suites: the counters every benchmark reports, so the compare and
// dashboard tools (python/mcore_twin/bench.py) read one set of names, and the DeepSeek-V3-shaped
// layer the cost model and the GPU suite run.
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
#include <map>
#include <string>

#include "core/config.h"
#include "core/dtype.h"
#include "core/tensor.h"
#include "optimized/layer/attention_half.h"
#include "optimized/runtime/device.h"
#include "optimized/transformer_layer.h"

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

// DeepSeek-V3's layer (config.json of deepseek-ai/DeepSeek-V3: hidden 7168, 128 heads,
// q_lora_rank 1536, kv_lora_rank 512, qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128,
// RMSNorm with the latent norms, SwiGLU, YaRN factor 40 over 4096 positions; its first three
// layers dense with intermediate size 18432), bf16, no biases, s tokens of one sequence. The
// parameters are zeros: the costs depend on shapes only.
struct DeepSeekLayer {
  TransformerConfig config;
  std::map<std::string, Tensor> params;
  Tensor hidden_states;
};
inline DeepSeekLayer deepseek_v3_layer(int s) {
  DeepSeekLayer d;
  TransformerConfig& c = d.config;
  c.num_layers = 61;
  c.hidden_size = 7168;
  c.num_attention_heads = 128;
  c.ffn_hidden_size = 18432;
  c.bf16 = true;
  c.normalization = "RMSNorm";
  c.layernorm_epsilon = 1e-6;
  c.activation_func = "silu";
  c.gated_linear_unit = true;
  c.add_bias_linear = false;
  c.qk_layernorm = true;
  c.multi_latent_attention = true;
  c.position_embedding_type = "rope";
  c.q_lora_rank = 1536;
  c.kv_lora_rank = 512;
  c.qk_head_dim = 128;
  c.qk_pos_emb_head_dim = 64;
  c.v_head_dim = 128;
  c.rope_type = "yarn";
  c.rotary_scaling_factor = 40.0;
  c.original_max_position_embeddings = 4096;
  c.mscale = c.mscale_all_dim = 1.0;
  c.attention_softmax_in_fp32 = true;
  std::map<std::string, Shape> shapes = opt::attention_half_param_shapes(c);
  shapes["mlp.linear_fc1.weight"] = {2 * 18432, 7168};
  shapes["mlp.linear_fc2.weight"] = {7168, 18432};
  for (const std::string& key : opt::dense_layer_param_keys(c))
    d.params[key] = Tensor::zeros(DType::BF16, shapes.at(key));
  d.hidden_states = Tensor::zeros(DType::BF16, {s, 1, 7168});
  return d;
}

// Its forward's FLOPs at s tokens: 2 m n k per projection GEMM, the core attention's q k^T over
// the query's head dim and p v over v's, halved by the causal mask.
inline double deepseek_v3_forward_flops(const TransformerConfig& c, int s) {
  const double tok = s, h = c.hidden_size, np = c.num_attention_heads, ql = *c.q_lora_rank, kvl = c.kv_lora_rank;
  const double qh = c.qk_head_dim + c.qk_pos_emb_head_dim, v = c.v_head_dim, ffn = c.ffn();
  const double gemm = 2.0 * tok *
                      (h * ql + ql * np * qh + h * (kvl + c.qk_pos_emb_head_dim) + kvl * np * (c.qk_head_dim + v) +
                       np * v * h + h * 2.0 * ffn + ffn * h);
  return gemm + 2.0 * np * tok * tok * (qh + v) / 2.0;
}

}  // namespace twin::bench
