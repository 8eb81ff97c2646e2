// Cross-check of the MoE layer's rounding points against LibTorch 1.13's CPU kernels (the version
// the fixtures were generated with), in bf16 and fp32: Megatron's MoE forward written out op by op
// in torch (router_gating_linear, topk_routing_with_score_function, permute, SequentialMLP with
// per_token_scale, unpermute's scatter_add, shared experts), on random parameters.
//
// The reference rounds where torch stores; the two can still differ where a GEMM's fp32
// accumulation order puts a value on the other side of a rounding boundary. So: routing maps equal
// exactly; in bf16 at least 97% of elements bitwise equal, the rest within 4 u max|e| (a missed or
// extra rounding point changes about half of all elements: this is how torch 1.13's per-op bf16
// silu was found); in fp32 within 16 u max|e| (fp32 accumulation order).
#include <gtest/gtest.h>

#include "tests/optional_dependency.h"

#ifdef TWIN_HAVE_TORCH
#include <torch/torch.h>
#endif

#include <random>

#include "reference/moe/moe_layer.h"
#include "tests/reference/moe/moe_test_util.h"

namespace twin::reference::moe {
namespace {

#ifdef TWIN_HAVE_TORCH

using testing::f64_tensor;
using testing::random_mat;
using testing::small_moe_config;

torch::ScalarType torch_dtype(DType dt) { return dt == DType::BF16 ? torch::kBFloat16 : torch::kFloat32; }

// Values rounded to dt, as a torch tensor of dt and as the reference's F64 tensor.
struct Both {
  torch::Tensor t;
  Mat m;
};
Both make(const Mat& values, DType dt) {
  Mat m = values;
  for (Index i = 0; i < m.size(); ++i) m.data()[i] = round_to(dt, m.data()[i]);
  torch::Tensor t = torch::from_blob(m.data(), {m.rows(), m.cols()}, torch::kFloat64).clone().to(torch_dtype(dt));
  return {t, m};
}

Mat to_eigen(const torch::Tensor& t) {
  const torch::Tensor d = t.to(torch::kFloat64).contiguous();
  Mat m(d.size(0), d.size(1));
  std::copy(d.data_ptr<double>(), d.data_ptr<double>() + m.size(), m.data());
  return m;
}

torch::Tensor activation(const TransformerConfig& c, const torch::Tensor& x) {
  if (c.gated_linear_unit) {
    auto parts = torch::chunk(x, 2, -1);
    return (c.activation_func == "silu" ? torch::silu(parts[0]) : torch::gelu(parts[0])) * parts[1];
  }
  return c.activation_func == "silu" ? torch::silu(x) : torch::gelu(x);
}

struct Compared {
  double bitwise_share;
  double max_err;
  double scale;
};
Compared compare_mats(const Mat& a, const Mat& e) {
  Compared c{0.0, 0.0, 0.0};
  Index same = 0;
  for (Index i = 0; i < e.size(); ++i) {
    same += a.data()[i] == e.data()[i];
    c.max_err = std::max(c.max_err, std::abs(a.data()[i] - e.data()[i]));
    c.scale = std::max(c.scale, std::abs(e.data()[i]));
  }
  c.bitwise_share = e.size() ? static_cast<double>(same) / e.size() : 1.0;
  return c;
}

struct Extra {
  bool sigmoid = false;      // moe_router_score_function = sigmoid
  bool bias = false;         // add_bias_linear: router and expert biases
  bool router_fp32 = false;  // moe_router_dtype = fp32
  double capacity = 0.0;     // moe_expert_capacity_factor (probs drop policy) when > 0
};

void cross_check(DType dt, bool pre_softmax, bool glu, bool shared, const std::string& dispatcher, std::uint64_t seed,
                 Extra x_opt = {}) {
  const int E = 4, k = 2;
  TransformerConfig c = small_moe_config(E, k);
  c.hidden_size = 32;
  c.num_attention_heads = 4;
  c.moe_ffn_hidden_size = 24;
  c.bf16 = dt == DType::BF16;
  c.params_dtype = dt == DType::BF16 ? "bfloat16" : "float32";
  c.moe_router_pre_softmax = pre_softmax;
  c.gated_linear_unit = glu;
  c.activation_func = glu ? "silu" : "gelu";
  c.moe_token_dispatcher_type = dispatcher;
  if (shared) c.moe_shared_expert_intermediate_size = 40;
  if (x_opt.sigmoid) c.moe_router_score_function = "sigmoid";
  c.add_bias_linear = x_opt.bias;
  if (x_opt.router_fp32) c.moe_router_dtype = "fp32";
  if (x_opt.capacity > 0) c.moe_expert_capacity_factor = x_opt.capacity;
  const Index h = c.hidden_size, f = *c.moe_ffn_hidden_size, g = glu ? 2 : 1, T = 24;

  std::mt19937_64 rng(seed);
  const Both x = make(random_mat(rng, T, h), dt);
  const Both router_w = make(random_mat(rng, E, h, 0.3), dt);
  StateDict sd;
  sd.set("mlp.router.weight", f64_tensor(router_w.m, {E, h}));
  const Both router_b = make(random_mat(rng, 1, E, 0.3), dt);
  if (x_opt.bias) sd.set("mlp.router.bias", f64_tensor(router_b.m, {E}));
  std::vector<Both> w1, w2, b1, b2;
  for (int e = 0; e < E; ++e) {
    w1.push_back(make(random_mat(rng, g * f, h, 0.2), dt));
    w2.push_back(make(random_mat(rng, h, f, 0.2), dt));
    b1.push_back(make(random_mat(rng, 1, g * f, 0.2), dt));
    b2.push_back(make(random_mat(rng, 1, h, 0.2), dt));
    const std::string key = "mlp.experts.local_experts." + std::to_string(e) + ".";
    sd.set(key + "linear_fc1.weight", f64_tensor(w1.back().m, {g * f, h}));
    sd.set(key + "linear_fc2.weight", f64_tensor(w2.back().m, {h, f}));
    if (x_opt.bias) {
      sd.set(key + "linear_fc1.bias", f64_tensor(b1.back().m, {g * f}));
      sd.set(key + "linear_fc2.bias", f64_tensor(b2.back().m, {h}));
    }
  }
  const Index sf = 40;
  const Both s1 = make(random_mat(rng, g * sf, h, 0.2), dt), s2 = make(random_mat(rng, h, sf, 0.2), dt);
  if (shared) {
    sd.set("mlp.shared_experts.linear_fc1.weight", f64_tensor(s1.m, {g * sf, h}));
    sd.set("mlp.shared_experts.linear_fc2.weight", f64_tensor(s2.m, {h, sf}));
  }

  // ---- the reference
  MoELayer layer(c, Precision::from_config(c));
  layer.load_state_dict(sd, "mlp.");
  MlpArgs args;
  args.lead = {T / 2, 2};
  args.training = true;
  TapRecord rec;
  const Mat out = layer.forward(x.m, args, Taps(&rec, "mlp.")).output;

  // ---- Megatron's ops in torch
  torch::NoGradGuard no_grad;
  const auto rdt = x_opt.router_fp32 ? torch::kFloat32 : torch_dtype(dt);
  const torch::Tensor logits = x_opt.bias  // router_gating_linear
                                   ? torch::addmm(router_b.t.reshape({E}).to(rdt), x.t.to(rdt), router_w.t.to(rdt).t())
                                   : torch::mm(x.t.to(rdt), router_w.t.to(rdt).t());
  torch::Tensor probs, top_indices;
  if (x_opt.sigmoid) {
    torch::Tensor scores = torch::sigmoid(logits.to(torch::kFloat32)).type_as(logits);
    std::tie(scores, top_indices) = torch::topk(scores, k, 1);
    probs = scores / (scores.sum(-1, true) + 1e-20);
  } else if (pre_softmax) {
    const torch::Tensor scores = torch::softmax(logits, -1, torch::kFloat32).type_as(logits);
    std::tie(probs, top_indices) = torch::topk(scores, k, 1);
  } else {
    torch::Tensor scores;
    std::tie(scores, top_indices) = torch::topk(logits, k, 1);
    probs = torch::softmax(scores, -1, torch::kFloat32).type_as(logits);
  }
  torch::Tensor routing_probs = torch::zeros_like(logits).scatter(1, top_indices, probs);
  torch::Tensor routing_map = torch::zeros_like(logits).to(torch::kInt).scatter(1, top_indices, 1).to(torch::kBool);
  if (x_opt.capacity > 0) {  // apply_router_token_dropping, drop_policy "probs"
    const Index capacity = get_capacity(T * k, E, x_opt.capacity);
    if (capacity <= T) {
      const torch::Tensor capacity_indices = std::get<1>(torch::topk(routing_probs, capacity, 0, true, false));
      const torch::Tensor capacity_mask =
          torch::zeros_like(routing_probs).scatter(0, capacity_indices, 1).to(torch::kBool);
      routing_map = torch::logical_and(routing_map, capacity_mask);
      routing_probs = routing_probs * routing_map;
    }
  }
  // permute
  const torch::Tensor map_t = routing_map.t().contiguous();
  const torch::Tensor token_indices = torch::arange(T).unsqueeze(0).expand({E, T});
  const torch::Tensor sorted_indices = token_indices.masked_select(map_t);
  const torch::Tensor permuted = x.t.index_select(0, sorted_indices);
  const torch::Tensor permuted_probs = routing_probs.t().contiguous().masked_select(map_t);
  const torch::Tensor tokens_per_expert = routing_map.sum(0);
  // SequentialMLP
  std::vector<torch::Tensor> outs;
  Index start = 0;
  for (int e = 0; e < E; ++e) {
    const Index n = tokens_per_expert[e].item<std::int64_t>();
    const torch::Tensor tokens = permuted.narrow(0, start, n), p = permuted_probs.narrow(0, start, n);
    torch::Tensor fc1 = torch::matmul(tokens, w1[e].t.t());
    if (x_opt.bias) fc1 = fc1 + b1[e].t.reshape({-1});
    torch::Tensor inter = activation(c, fc1);
    inter = (inter * p.unsqueeze(-1)).to(inter.scalar_type());
    torch::Tensor o = torch::matmul(inter, w2[e].t.t());
    if (x_opt.bias) o += b2[e].t.reshape({-1}).unsqueeze(0) * p.unsqueeze(-1);
    outs.push_back(o);
    start += n;
  }
  const torch::Tensor expert_output = torch::cat(outs, 0);
  torch::Tensor output = torch::zeros({T, h}, expert_output.options());
  output.scatter_add_(0, sorted_indices.unsqueeze(1).expand({-1, h}), expert_output);
  if (shared) output = output + torch::matmul(activation(c, torch::matmul(x.t, s1.t.t())), s2.t.t());

  // ---- compare
  const BoolMat map_ref = to_bool_mat(*rec.find("mlp.router.1"), T, E);
  const torch::Tensor map_i = routing_map.to(torch::kInt64).contiguous();
  for (Index t = 0; t < T; ++t)
    for (Index e = 0; e < E; ++e)
      ASSERT_EQ(map_ref(t, e), map_i[t][e].item<std::int64_t>() != 0) << "routing " << t << ", " << e;
  struct Item {
    const char* name;
    Mat actual, expected;
    DType stored;  // the dtype torch stores the tensor in
  };
  const DType router_dt = x_opt.router_fp32 ? DType::F32 : dt;
  const std::vector<Item> items = {
      {"logits", to_mat(*rec.find("mlp.router.logits"), T, E, "logits"), to_eigen(logits), router_dt},
      {"probs", to_mat(*rec.find("mlp.router.0"), T, E, "probs"), to_eigen(routing_probs), router_dt},
      {"experts", to_mat(*rec.find("mlp.experts.0"), expert_output.size(0), h, "experts"), to_eigen(expert_output), dt},
      {"output", out, to_eigen(output), dt},
  };
  for (const Item& it : items) {
    const Compared r = compare_mats(it.actual, it.expected);
    const double u = unit_roundoff(it.stored);
    if (it.stored == DType::BF16) {
      // fp32 accumulation inside a bf16 GEMM is far below a bf16 rounding step: (nearly) bitwise.
      EXPECT_GE(r.bitwise_share, 0.97) << it.name << ": bitwise share " << r.bitwise_share;
      EXPECT_LE(r.max_err, 4 * u * r.scale) << it.name << ": max error " << r.max_err << " scale " << r.scale;
    } else {
      // fp32: torch's GEMMs accumulate in fp32 (error up to K u sum |x w|, K <= 48 here), the
      // reference in double: most elements differ in the last bits. Bound: 16 u max|e|.
      EXPECT_LE(r.max_err, 16 * u * r.scale) << it.name << ": max error " << r.max_err << " scale " << r.scale;
    }
    std::printf("%s %-7s bitwise %.4f  max err %.3g (scale %.3g)\n", dtype_name(it.stored), it.name, r.bitwise_share,
                r.max_err, r.scale);
  }
}

// The share of a bf16 torch.matmul's elements bitwise equal to the fp32-accumulated product rounded
// once to bf16 (what the reference's rounding points say Megatron's GEMM stores). 1 where torch's
// CPU bf16 matmul accumulates in fp32 (oneDNN on AVX-512 CPUs); far less where it does not (an
// AVX2-only CPU: about 0.2), and there torch's CPU kernels are not the oracle of these points.
double torch_bf16_matmul_fp32_share() {
  torch::manual_seed(0);
  const torch::Tensor a = torch::randn({24, 64}).to(torch::kBFloat16), b = torch::randn({64, 48}).to(torch::kBFloat16);
  const torch::Tensor got = torch::matmul(a, b), want = torch::matmul(a.to(torch::kFloat32), b.to(torch::kFloat32));
  return got.eq(want.to(torch::kBFloat16)).to(torch::kFloat32).mean().item<double>();
}

TEST(MoETorchCrossCheck, Bf16RoundingPointsMatchTorchKernels) {
  if (const double share = torch_bf16_matmul_fp32_share(); share < 0.97)
    GTEST_SKIP() << "this CPU's torch bf16 matmul does not accumulate in fp32 (" << share
                 << " of a probe's elements are the fp32 product rounded once): its kernels are not Megatron's "
                    "GPU GEMMs here";
  cross_check(DType::BF16, false, false, false, "allgather", 1);
  cross_check(DType::BF16, true, true, true, "alltoall", 2);
  cross_check(DType::BF16, false, true, true, "allgather", 3);
  cross_check(DType::BF16, false, false, false, "allgather", 6, Extra{true, true, true, 1.0});
  cross_check(DType::BF16, false, true, false, "alltoall", 7, Extra{false, true, false, 0.75});
  cross_check(DType::BF16, true, false, false, "alltoall", 8, Extra{true, false, true, 0.0});
}

TEST(MoETorchCrossCheck, Fp32MatchesTorchKernels) {
  cross_check(DType::F32, false, false, true, "alltoall", 4);
  cross_check(DType::F32, true, true, false, "allgather", 5);
}

#else
TEST(MoETorchCrossCheck, NeedsLibTorch) {
  TWIN_SKIP_OPTIONAL("built without LibTorch (install libtorch-dev: ci/setup does)");
}
#endif

}  // namespace
}  // namespace twin::reference::moe
