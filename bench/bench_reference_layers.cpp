// Google Benchmark suite of every reference layer kind and phase on the CPU, forward, with the same
// dense layer written in LibTorch eager ops (what a user would run instead) in the same binary:
//
//   reference/<op>/<dense id>   op = input_layernorm, linear_qkv, core_attention, linear_proj,
//                               self_attn_bda, pre_mlp_layernorm, mlp, mlp_bda, layer
//   reference_fast/<op>/<id>    the same op in the reference's fast mode (ComputeMode::Fast: fp32
//                               GEMMs through OpenBLAS, reference/fast/fast_gemm.h); with LibTorch, each
//                               iteration also runs libtorch/<op>/<id> (not in the benchmark's
//                               time) and the counters reference_cpu_s, libtorch_cpu_s (thread CPU
//                               seconds per iteration) and ratio_vs_libtorch (their quotient, over
//                               the same interleaved iterations) compare them under one load
//   libtorch/<op>/<dense id>    the same op in torch ops, Megatron's unfused local-spec math
//                               (only when built with LibTorch)
//   reference/<phase>/<moe id>  phase = router, dispatch, experts, combine, moe_layer
//   reference/<kind>/<golden>   kind = retro_first_layer, retro_later_layer, retro_block on the
//                               Retro goldens' weights and inputs (fixtures/megatron-core)
//
// Names and counters: bench/bench_util.h. The dense ids are parity's case ids (`twin case '<id>'`
// reruns one); the MoE id names the synthetic MoE layer below in the same key=value style.
// Both implementations run on one thread (torch::set_num_threads(1); the reference is
// single-threaded, its fast mode's BLAS set to one thread), so the reference / LibTorch ratio
// compares like with like. LibTorch's fp32
// GEMM goes through the system BLAS (libblas.so.3): ci/bench runs with OpenBLAS.
//
// Shapes: a GPT-3-1.3B-style layer (LayerNorm, GeLU, biases, MHA) and a Llama-style layer
// (RMSNorm, SwiGLU, GQA, RoPE) scaled to h = 256 so the whole suite runs in about a minute.
#include <benchmark/benchmark.h>

#include <dlfcn.h>

#include <chrono>
#include <ctime>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#ifdef TWIN_HAVE_TORCH
#include <torch/torch.h>
#endif

#include "bench/bench_util.h"
#include "fixtures/fixture.h"
#include "parity/dense_case.h"
#include "reference/fast/fast_gemm.h"
#include "reference/fused_bias_dropout.h"
#include "reference/moe/moe_layer.h"
#include "reference/retro/decoder_layer_spec.h"
#include "reference/retro/decoder_spec.h"
#include "reference/retro/encoder_spec.h"
#include "reference/transformer_block.h"
#include "reference/transformer_config.h"
#include "reference/transformer_layer.h"

using namespace twin;
using namespace twin::reference;
using twin::bench::bench_name;
using twin::bench::set_cost_counters;
using Index = std::int64_t;

namespace {

// ---- dense layer ----------------------------------------------------------------------------------

const char* kDenseCases[] = {
    // GPT-3-1.3B-style (LayerNorm, GeLU, biases, MHA), scaled
    "dense(h=256,a=8,g=8,d=32,ffn=1024,norm=ln,act=gelu,glu=0,bias=1,qkv_bias=1,rope=none,rot=1,qkln=0,mask=causal,s="
    "64,b=2,dtype=bf16,tp=1,sp=0,drop=0,seed=1)",
    "dense(h=256,a=8,g=8,d=32,ffn=1024,norm=ln,act=gelu,glu=0,bias=1,qkv_bias=1,rope=none,rot=1,qkln=0,mask=causal,s="
    "64,b=2,dtype=fp32,tp=1,sp=0,drop=0,seed=1)",
    // Llama-style (RMSNorm, SwiGLU, GQA 8/2, RoPE, no biases), scaled
    "dense(h=256,a=8,g=2,d=32,ffn=704,norm=rms,act=silu,glu=1,bias=0,qkv_bias=0,rope=half,rot=1,qkln=0,mask=causal,s="
    "64,b=2,dtype=bf16,tp=1,sp=0,drop=0,seed=2)",
    "dense(h=256,a=8,g=2,d=32,ffn=704,norm=rms,act=silu,glu=1,bias=0,qkv_bias=0,rope=half,rot=1,qkln=0,mask=causal,s="
    "64,b=2,dtype=fp32,tp=1,sp=0,drop=0,seed=2)",
};

const char* kDenseOps[] = {"input_layernorm",   "linear_qkv", "core_attention", "linear_proj", "self_attn_bda",
                           "pre_mlp_layernorm", "mlp",        "mlp_bda",        "layer"};

// FLOPs and minimal bytes of one dense op (a model: what the op must compute and touch in the
// storage dtype; the reference computes the full s x s scores under a causal mask, so attention
// counts them all). Norms: LayerNorm ~8 flops per element (mean, centre, square, sum, scale by
// rstd, gamma, beta), RMSNorm ~4 (square, sum, scale, gamma). Activations ~8 per element.
struct Cost {
  double flops = 0, bytes = 0;
};
Cost dense_op_cost(const parity::DenseCase& c, const std::string& op) {
  const double e = dtype_size(c.dtype), n = double(c.s) * c.b, h = c.hidden, d = c.kv_channels;
  const double qkv = (c.heads + 2.0 * c.groups) * d, ctx = c.heads * d, fc1 = (c.glu ? 2.0 : 1.0) * c.ffn;
  const double norm_flops = (c.rms ? 4.0 : 8.0) * n * h, norm_bytes = e * (2 * n * h + 2 * h);
  auto linear = [&](double in, double out, bool bias) {
    return Cost{2 * n * in * out + (bias ? n * out : 0), e * (n * in + in * out + n * out + (bias ? out : 0))};
  };
  const Cost attn{4.0 * c.b * c.heads * double(c.s) * c.s * d + 5.0 * c.b * c.heads * double(c.s) * c.s,
                  e * (n * qkv + n * ctx)};
  const Cost bda{2 * n * h, e * (3 * n * h + h)};
  const Cost fc1c = linear(h, fc1, c.bias), fc2c = linear(c.ffn, h, c.bias);
  const Cost mlp{fc1c.flops + fc2c.flops + 8 * n * c.ffn, fc1c.bytes + fc2c.bytes};
  const Cost q = linear(h, qkv, c.bias || c.qkv_bias), proj = linear(ctx, h, c.bias);
  if (op == "input_layernorm" || op == "pre_mlp_layernorm") return {norm_flops, norm_bytes};
  if (op == "linear_qkv") return q;
  if (op == "core_attention") return attn;
  if (op == "linear_proj") return proj;
  if (op == "self_attn_bda" || op == "mlp_bda") return bda;
  if (op == "mlp") return mlp;
  // layer: the sum of its ops
  return {2 * norm_flops + q.flops + attn.flops + proj.flops + 2 * bda.flops + mlp.flops,
          2 * norm_bytes + q.bytes + attn.bytes + proj.bytes + 2 * bda.bytes + mlp.bytes};
}

// The reference layer of a case, built once, with every op's input computed once.
struct DenseFixture {
  parity::DenseCase c;
  parity::DenseInputs in;
  TransformerConfig cfg;
  Precision p;
  std::unique_ptr<TransformerLayer> layer;
  SelfAttention* sa = nullptr;
  LayerInputs li;
  AttentionArgs args;
  Mat x, ln, h1, ln2, ctx;
  SelfAttention::QKV qkv;
  OutputWithBias proj, mlp_out;

  explicit DenseFixture(const std::string& id, ComputeMode mode = ComputeMode::FP32)
      : c(parity::parse_case_id(id)), in(parity::make_inputs(c)) {
    cfg = in.config;
    p = Precision::from_config(cfg, mode);
    const ModuleSpec spec = get_gpt_layer_local_spec(std::nullopt, cfg.qk_layernorm, cfg.normalization, cfg.qk_l2_norm,
                                                     attn_mask_type_from_name(cfg.attn_mask_type));
    layer = std::make_unique<TransformerLayer>(cfg, spec.submodules, 1, std::nullopt, p);
    layer->load_state_dict(in.params);
    sa = dynamic_cast<SelfAttention*>(layer->self_attention.get());
    li.attention_mask = in.attention_mask.defined() ? &in.attention_mask : nullptr;
    li.rotary_pos_emb = in.rotary_pos_emb.defined() ? &in.rotary_pos_emb : nullptr;
    args.s = c.s;
    args.b = c.b;
    args.attention_mask = li.attention_mask;
    args.rotary_pos_emb = li.rotary_pos_emb;
    const Index n = Index(c.s) * c.b;
    x = to_mat(in.hidden_states, n, c.hidden, "hidden_states");
    ln = layer->input_layernorm->forward(x);
    qkv = sa->get_query_key_value_tensors(ln, args, Taps());
    ctx = sa->core_attention.forward(qkv.query, qkv.key, qkv.value, c.s, c.s, c.b, args.attention_mask, false, {});
    proj = sa->linear_proj.forward(ctx);
    h1 = bias_dropout_add(proj.output, proj.bias, x, 0.0, false, {}, p);
    ln2 = layer->pre_mlp_layernorm->forward(h1);
    mlp_out = layer->mlp->forward(ln2, MlpArgs{{c.s, c.b}}, Taps());
  }

  void run(const std::string& op) {
    if (op == "input_layernorm") {
      benchmark::DoNotOptimize(layer->input_layernorm->forward(x));
    } else if (op == "linear_qkv") {
      benchmark::DoNotOptimize(sa->linear_qkv.forward(ln));
    } else if (op == "core_attention") {
      benchmark::DoNotOptimize(
          sa->core_attention.forward(qkv.query, qkv.key, qkv.value, c.s, c.s, c.b, args.attention_mask, false, {}));
    } else if (op == "linear_proj") {
      benchmark::DoNotOptimize(sa->linear_proj.forward(ctx));
    } else if (op == "self_attn_bda") {
      benchmark::DoNotOptimize(bias_dropout_add(proj.output, proj.bias, x, 0.0, false, {}, p));
    } else if (op == "pre_mlp_layernorm") {
      benchmark::DoNotOptimize(layer->pre_mlp_layernorm->forward(h1));
    } else if (op == "mlp") {
      benchmark::DoNotOptimize(layer->mlp->forward(ln2, MlpArgs{{c.s, c.b}}, Taps()));
    } else if (op == "mlp_bda") {
      benchmark::DoNotOptimize(bias_dropout_add(mlp_out.output, mlp_out.bias, h1, 0.0, false, {}, p));
    } else {
      benchmark::DoNotOptimize(layer->forward(in.hidden_states, li));
    }
  }
};

void BM_ReferenceDense(benchmark::State& state, std::string id, std::string op) {
  DenseFixture f(id);
  for (auto _ : state) f.run(op);
  const Cost cost = dense_op_cost(f.c, op);
  set_cost_counters(state, cost.flops, cost.bytes);
}

#ifdef TWIN_HAVE_TORCH
// ---- the same dense layer in LibTorch eager ops ----------------------------------------------------
// Megatron's unfused local-spec forward (tests/reference/test_dense_torch_crosscheck.cpp checks the
// same ops against the reference's rounding): layer_norm / the RMSNorm composite, matmul + bias,
// the grouped QKV split, RoPE, baddbmm, the fp32 masked softmax and its cast back, bmm,
// bias-dropout-add, MLP.
torch::ScalarType tdt(DType dt) { return dt == DType::BF16 ? torch::kBFloat16 : torch::kFloat32; }

torch::Tensor to_torch(const Tensor& t, torch::ScalarType dt) {
  std::vector<std::int64_t> shape(t.shape().begin(), t.shape().end());
  return torch::tensor(t.to_f64(), torch::kFloat64).reshape(shape).to(dt);
}

struct TorchDense {
  parity::DenseCase c;
  TransformerConfig cfg;
  std::map<std::string, torch::Tensor> p;
  torch::Tensor x, freqs, causal, ln, q, k, v, ctx, proj, h1, ln2, mlp_out;
  std::int64_t s, b, h, np, ng, hn, r;

  explicit TorchDense(const std::string& id) : c(parity::parse_case_id(id)) {
    const parity::DenseInputs in = parity::make_inputs(c);
    cfg = in.config;
    const auto dt = tdt(c.dtype);
    for (const auto& [k_, t] : in.params) p[k_] = to_torch(t, dt);
    x = to_torch(in.hidden_states, dt);
    if (in.rotary_pos_emb.defined()) freqs = to_torch(in.rotary_pos_emb, torch::kFloat32);
    s = c.s, b = c.b, h = c.hidden, np = c.heads, ng = c.groups, hn = c.kv_channels, r = np / ng;
    causal = torch::ones({s, s}, torch::kBool).triu(1);
    ln = norm(x, "input_layernorm.");
    qkv_split(linear(ln, "self_attention.linear_qkv."));
    ctx = core_attention();
    proj = linear(ctx, "self_attention.linear_proj.", false);
    h1 = bda(proj, "self_attention.linear_proj.", x);
    ln2 = norm(h1, "pre_mlp_layernorm.");
    mlp_out = mlp(ln2, false);
  }

  torch::Tensor norm(const torch::Tensor& t, const std::string& key) {
    if (cfg.normalization == "LayerNorm")
      return torch::layer_norm(t, {h}, p[key + "weight"], p[key + "bias"], cfg.layernorm_epsilon);
    const auto tf = t.to(torch::kFloat32);  // torch >= 2.4 rms_norm composite
    return (tf * torch::rsqrt(tf.pow(2).mean(-1, true) + cfg.layernorm_epsilon)).to(t.scalar_type()) *
           p[key + "weight"];
  }
  // add_bias = false: skip_bias_add (linear_proj, linear_fc2): the bias goes to the bda.
  torch::Tensor linear(const torch::Tensor& t, const std::string& key, bool add_bias = true) {
    auto y = torch::matmul(t, p[key + "weight"].t());
    if (add_bias && p.count(key + "bias")) y = y + p[key + "bias"];
    return y;
  }
  // bias-dropout-add without dropout: residual + (out + bias).
  torch::Tensor bda(const torch::Tensor& out, const std::string& linear_key, const torch::Tensor& residual) {
    return residual + (p.count(linear_key + "bias") ? out + p[linear_key + "bias"] : out);
  }
  torch::Tensor rope(const torch::Tensor& t) {
    const auto cos_ = torch::cos(freqs).to(t.scalar_type()), sin_ = torch::sin(freqs).to(t.scalar_type());
    auto halves = torch::chunk(t, 2, -1);
    return t * cos_ + torch::cat({-halves[1], halves[0]}, -1) * sin_;
  }
  void qkv_split(const torch::Tensor& mixed) {
    auto parts = torch::split_with_sizes(mixed.view({s, b, ng, (r + 2) * hn}), {r * hn, hn, hn}, 3);
    q = parts[0].reshape({s, b, np, hn});
    k = parts[1];
    v = parts[2];
    if (freqs.defined()) {
      q = rope(q);
      k = rope(k);
    }
  }
  torch::Tensor core_attention() {
    // [s, b, ng, hn] -> [s, b, np, hn] (repeat_interleave over the heads of a group), then [b*np, s, hn]
    const auto kk = r > 1 ? k.repeat_interleave(r, 2) : k, vv = r > 1 ? v.repeat_interleave(r, 2) : v;
    const auto q3 = q.reshape({s, b * np, hn}).transpose(0, 1);
    const auto k3 = kk.reshape({s, b * np, hn}).transpose(0, 1);
    const auto v3 = vv.reshape({s, b * np, hn}).transpose(0, 1);
    auto scores = torch::baddbmm(torch::empty({b * np, s, s}, q.options()), q3, k3.transpose(1, 2), 0.0,
                                 1.0 / std::sqrt(double(hn)));
    const auto probs = torch::softmax(scores.to(torch::kFloat32).masked_fill(causal, -10000.0), -1).to(q.scalar_type());
    return torch::bmm(probs, v3).transpose(0, 1).reshape({s, b, np * hn});
  }
  torch::Tensor mlp(const torch::Tensor& t, bool fc2_bias = true) {
    auto y = linear(t, "mlp.linear_fc1.");
    // act=gelu is F.gelu, the erf form (Megatron's default activation_func, the reference's Gelu)
    if (c.glu) {
      auto halves = torch::chunk(y, 2, -1);
      y = (c.act == "silu" ? torch::silu(halves[0]) : torch::gelu(halves[0])) * halves[1];
    } else {
      y = c.act == "silu" ? torch::silu(y) : torch::gelu(y);
    }
    return linear(y, "mlp.linear_fc2.", fc2_bias);
  }
  torch::Tensor layer() {
    auto l1 = norm(x, "input_layernorm.");
    qkv_split(linear(l1, "self_attention.linear_qkv."));
    auto hh = bda(linear(core_attention(), "self_attention.linear_proj.", false), "self_attention.linear_proj.", x);
    return bda(mlp(norm(hh, "pre_mlp_layernorm."), false), "mlp.linear_fc2.", hh);
  }

  void run(const std::string& op) {
    torch::NoGradGuard no_grad;
    if (op == "input_layernorm") {
      benchmark::DoNotOptimize(norm(x, "input_layernorm."));
    } else if (op == "linear_qkv") {
      benchmark::DoNotOptimize(linear(ln, "self_attention.linear_qkv."));
    } else if (op == "core_attention") {
      benchmark::DoNotOptimize(core_attention());
    } else if (op == "linear_proj") {
      benchmark::DoNotOptimize(linear(ctx, "self_attention.linear_proj.", false));
    } else if (op == "self_attn_bda") {
      benchmark::DoNotOptimize(bda(proj, "self_attention.linear_proj.", x));
    } else if (op == "pre_mlp_layernorm") {
      benchmark::DoNotOptimize(norm(h1, "pre_mlp_layernorm."));
    } else if (op == "mlp") {
      benchmark::DoNotOptimize(mlp(ln2, false));
    } else if (op == "mlp_bda") {
      benchmark::DoNotOptimize(bda(mlp_out, "mlp.linear_fc2.", h1));
    } else {
      benchmark::DoNotOptimize(layer());
    }
  }
};

void BM_LibTorchDense(benchmark::State& state, std::string id, std::string op) {
  torch::set_num_threads(1);
  TorchDense f(id);
  for (auto _ : state) f.run(op);
  const Cost cost = dense_op_cost(f.c, op);
  set_cost_counters(state, cost.flops, cost.bytes);
}
#endif

// The reference in fast mode; with LibTorch, the same op in LibTorch eager runs after it in every
// iteration (manual time: the benchmark's time is the reference's alone), so the ratio compares
// two timings taken under the same machine load, on one thread each. The ratio is of the calling
// thread's CPU time (both run on it alone: one BLAS thread, torch::set_num_threads(1)), which a
// shared machine's other load does not inflate as it does wall time.
double thread_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

void BM_ReferenceFastDense(benchmark::State& state, std::string id, std::string op) {
  using Clock = std::chrono::steady_clock;
  DenseFixture f(id, ComputeMode::Fast);
#ifdef TWIN_HAVE_TORCH
  torch::set_num_threads(1);
  TorchDense t(id);
#endif
  double reference_cpu = 0, libtorch_cpu = 0;
  for (auto _ : state) {
    const auto t0 = Clock::now();
    const double c0 = thread_cpu_seconds();
    f.run(op);
    const double c1 = thread_cpu_seconds();
    const auto t1 = Clock::now();
#ifdef TWIN_HAVE_TORCH
    t.run(op);
#endif
    const double c2 = thread_cpu_seconds();
    reference_cpu += c1 - c0;
    libtorch_cpu += c2 - c1;
    state.SetIterationTime(std::chrono::duration<double>(t1 - t0).count());
  }
  const Cost cost = dense_op_cost(f.c, op);
  set_cost_counters(state, cost.flops, cost.bytes);
  if (state.iterations() > 0) {
    const double n = double(state.iterations());
    state.counters["reference_cpu_s"] = benchmark::Counter(reference_cpu / n);
#ifdef TWIN_HAVE_TORCH
    state.counters["libtorch_cpu_s"] = benchmark::Counter(libtorch_cpu / n);
    if (libtorch_cpu > 0) state.counters["ratio_vs_libtorch"] = benchmark::Counter(reference_cpu / libtorch_cpu);
#endif
  }
}

// ---- MoE layer ------------------------------------------------------------------------------------
// A Mixtral-style MoE layer, scaled: 8 experts, top-2, SwiGLU experts, alltoall dispatcher, bf16.
struct MoECase {
  int h = 256, heads = 8, experts = 8, topk = 2, moe_ffn = 512, s = 64, b = 2;
  std::string dispatcher = "alltoall", dtype = "bf16";
  std::uint64_t seed = 1;
  std::string id() const {
    return "moe(h=" + std::to_string(h) + ",a=" + std::to_string(heads) + ",E=" + std::to_string(experts) +
           ",topk=" + std::to_string(topk) + ",moe_ffn=" + std::to_string(moe_ffn) +
           ",act=silu,glu=1,dispatcher=" + dispatcher + ",s=" + std::to_string(s) + ",b=" + std::to_string(b) +
           ",dtype=" + dtype + ",seed=" + std::to_string(seed) + ")";
  }
};

TransformerConfig moe_config(const MoECase& m) {
  TransformerConfig c;
  c.num_layers = 1;
  c.hidden_size = m.h;
  c.num_attention_heads = m.heads;
  c.ffn_hidden_size = m.moe_ffn;
  c.hidden_dropout = 0.0;
  c.attention_dropout = 0.0;
  c.add_bias_linear = false;
  c.gated_linear_unit = true;
  c.activation_func = "silu";
  c.bias_activation_fusion = false;
  c.num_moe_experts = m.experts;
  c.moe_ffn_hidden_size = m.moe_ffn;
  c.moe_router_topk = m.topk;
  c.moe_token_dispatcher_type = m.dispatcher;
  c.moe_router_load_balancing_type = "none";
  c.bf16 = m.dtype == "bf16";
  c.params_dtype = c.bf16 ? "bfloat16" : "float32";
  return c;
}

Tensor random_tensor(std::mt19937_64& rng, Shape shape, double scale, DType dt) {
  std::normal_distribution<double> n(0.0, scale);
  std::vector<double> v(static_cast<std::size_t>(shape_numel(shape)));
  for (auto& x : v) x = n(rng);
  return Tensor::from_doubles(dt, std::move(shape), v);
}

struct MoEFixture {
  MoECase m;
  TransformerConfig cfg;
  Precision p;
  std::unique_ptr<moe::MoELayer> layer;
  Mat x;                     // [T, h]
  moe::RouterOutput routed;  // [T, E]
  moe::ExpertInputs ein;     // [N, h]
  Mat expert_out;            // [N, h]
  Index T = 0;

  explicit MoEFixture(const MoECase& mc) : m(mc), cfg(moe_config(mc)) {
    validate_transformer_config(cfg);
    moe::validate_moe_layer_config(cfg);
    p = Precision::from_config(cfg);
    const DType dt = params_dtype(cfg);
    std::mt19937_64 rng(m.seed);
    StateDict sd;
    const Index h = m.h, E = m.experts, ffn = m.moe_ffn;
    sd.set("mlp.router.weight", random_tensor(rng, {E, h}, 1.0 / std::sqrt(double(h)), dt));
    for (Index e = 0; e < E; ++e) {
      const std::string k = "mlp.experts.local_experts." + std::to_string(e) + ".";
      sd.set(k + "linear_fc1.weight", random_tensor(rng, {2 * ffn, h}, 1.0 / std::sqrt(double(h)), dt));
      sd.set(k + "linear_fc2.weight", random_tensor(rng, {h, ffn}, 1.0 / std::sqrt(double(ffn)), dt));
    }
    layer = std::make_unique<moe::MoELayer>(cfg, p);
    layer->load_state_dict(sd, "mlp.");
    layer->router.training = false;
    T = Index(m.s) * m.b;
    x = to_mat(random_tensor(rng, {T, h}, 1.0, dt), T, h, "hidden_states");
    routed = route();
    ein = dispatch();
    expert_out = layer->experts.forward(ein.dispatched_input, ein.tokens_per_expert, ein.permuted_probs, Taps());
  }

  moe::RouterOutput route() { return layer->router.forward(x, m.s, m.b, nullptr, Taps(), nullptr); }
  moe::ExpertInputs dispatch() {
    moe::MoETokenDispatcher& d = *layer->token_dispatcher;
    return d.dispatch_postprocess(
        d.token_dispatch(d.dispatch_preprocess(x, m.s, m.b, routed.routing_map, routed.probs)));
  }
  Mat combine() {
    moe::MoETokenDispatcher& d = *layer->token_dispatcher;
    return d.combine_postprocess(d.token_combine(d.combine_preprocess(expert_out)));
  }
};

// FLOPs / bytes of the MoE phases with N = T * topk routed rows (no drops), storage dtype e bytes.
Cost moe_phase_cost(const MoECase& m, const std::string& phase) {
  const double e = m.dtype == "bf16" ? 2 : 4, T = double(m.s) * m.b, N = T * m.topk, h = m.h, E = m.experts;
  const double f = m.moe_ffn;
  const Cost router{2 * T * h * E + 5 * T * E, e * (T * h + E * h) + 4 * 2 * T * E};
  const Cost dispatch{0, e * (T * h + N * h) + 4 * N};  // a gather: read tokens, write rows
  const Cost experts{2 * N * h * 2 * f + 2 * N * f * h + 10 * N * f, e * (N * h + E * 3 * f * h + N * h)};
  const Cost combine{N * h, e * (N * h + T * h)};  // a scatter-add of the rows
  if (phase == "router") return router;
  if (phase == "dispatch") return dispatch;
  if (phase == "experts") return experts;
  if (phase == "combine") return combine;
  return {router.flops + dispatch.flops + experts.flops + combine.flops,
          router.bytes + dispatch.bytes + experts.bytes + combine.bytes};
}

void BM_ReferenceMoE(benchmark::State& state, MoECase m, std::string phase) {
  MoEFixture f(m);
  for (auto _ : state) {
    if (phase == "router") {
      benchmark::DoNotOptimize(f.route());
    } else if (phase == "dispatch") {
      benchmark::DoNotOptimize(f.dispatch());
    } else if (phase == "experts") {
      benchmark::DoNotOptimize(
          f.layer->experts.forward(f.ein.dispatched_input, f.ein.tokens_per_expert, f.ein.permuted_probs, Taps()));
    } else if (phase == "combine") {
      benchmark::DoNotOptimize(f.combine());
    } else {
      benchmark::DoNotOptimize(f.layer->forward(f.x, MlpArgs{{m.s, m.b}}, Taps()));
    }
  }
  const Cost cost = moe_phase_cost(m, phase);
  set_cost_counters(state, cost.flops, cost.bytes);
}

// ---- Retro --------------------------------------------------------------------------------------------
// The goldens' own weights and inputs (the only Retro weights the project has); FLOPs and bytes
// are not modelled for these (counters 0 would mislead, so none are set).
struct RetroGolden {
  const char* kind;  // benchmark op name
  const char* file;  // golden file stem
};
const RetroGolden kRetro[] = {{"retro_first_layer", "retro_first_layer_divisible"},
                              {"retro_later_layer", "retro_later_layer_divisible"},
                              {"retro_block", "retro_block_6layers_nondivisible"}};

std::map<std::string, Tensor> golden_params(const Fixture& f) {
  std::map<std::string, Tensor> sd;
  for (const auto& name : f.names_with_prefix("param.")) sd.emplace(name.substr(6), f.tensor(name));
  return sd;
}

void BM_ReferenceRetro(benchmark::State& state, RetroGolden g) {
  Fixture f;
  try {
    f = load_fixture(golden_dir() + "/" + g.file + ".safetensors");
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
    for (auto _ : state) {
    }
    return;
  }
  const TransformerConfig& config = f.config;
  const Precision p = Precision::from_config(config);
  LayerInputs in;
  in.context = &f.tensor("input.context");
  in.context_mask = f.has("input.context_mask") ? &f.tensor("input.context_mask") : nullptr;
  const Tensor& hidden = f.tensor("input.hidden_states");
  if (std::string(g.kind) == "retro_block") {
    TransformerBlock block(config, retro::get_retro_decoder_block_spec(config, false), p);
    block.load_state_dict(StateDict(golden_params(f)));
    for (auto _ : state) benchmark::DoNotOptimize(block.forward(hidden, in, false, DropoutRng{}, Taps()));
  } else {
    const bool first = std::string(g.kind) == "retro_first_layer";
    const ModuleSpec spec =
        retro::get_retro_decoder_layer_local_spec(
            first ? std::optional<TransformerBlockSubmodules>(retro::get_retro_encoder_block_spec(config, false))
                  : std::nullopt)
            .spec;
    std::unique_ptr<BaseTransformerLayer> built = spec.build(config, f.layer_number, p);
    auto& layer = dynamic_cast<TransformerLayer&>(*built);
    layer.load_state_dict(golden_params(f));
    for (auto _ : state) benchmark::DoNotOptimize(layer.forward(hidden, in));
  }
}

int register_all() {
  for (const char* id : kDenseCases) {
    for (const char* op : kDenseOps) {
      benchmark::RegisterBenchmark(bench_name("reference", op, id).c_str(), BM_ReferenceDense, std::string(id),
                                   std::string(op))
          ->Unit(benchmark::kMicrosecond);
      benchmark::RegisterBenchmark(bench_name("reference_fast", op, id).c_str(), BM_ReferenceFastDense, std::string(id),
                                   std::string(op))
          ->UseManualTime()
          ->Unit(benchmark::kMicrosecond);
#ifdef TWIN_HAVE_TORCH
      benchmark::RegisterBenchmark(bench_name("libtorch", op, id).c_str(), BM_LibTorchDense, std::string(id),
                                   std::string(op))
          ->Unit(benchmark::kMicrosecond);
#endif
    }
  }
  const MoECase m;
  for (const char* phase : {"router", "dispatch", "experts", "combine", "moe_layer"})
    benchmark::RegisterBenchmark(bench_name("reference", phase, m.id()).c_str(), BM_ReferenceMoE, m, std::string(phase))
        ->Unit(benchmark::kMicrosecond);
  for (const RetroGolden& g : kRetro)
    benchmark::RegisterBenchmark(bench_name("reference", g.kind, g.file).c_str(), BM_ReferenceRetro, g)
        ->Unit(benchmark::kMicrosecond);
  return 0;
}
const int registered = register_all();

// The library that provides the BLAS sgemm_ LibTorch's fp32 GEMM calls (resolved as the dynamic
// linker does for the process), recorded in the JSON context as "blas": OpenBLAS and Debian's
// netlib BLAS differ by 10x, so a ratio means nothing without it.
std::string blas_library() {
  void* sym = dlsym(RTLD_DEFAULT, "sgemm_");
  Dl_info info{};
  if (!sym || !dladdr(sym, &info) || !info.dli_fname) return "none (sgemm_ not loaded)";
  char resolved[4096];
  return realpath(info.dli_fname, resolved) ? std::string(resolved) : std::string(info.dli_fname);
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::AddCustomContext("blas", blas_library());
  set_gemm_threads(1);
  benchmark::AddCustomContext("threads",
                              "1 (torch::set_num_threads(1); the reference is single-threaded, its fast mode's "
                              "BLAS set to 1 thread)");
  benchmark::AddCustomContext("reference_fast_gemm", gemm_backend());
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
