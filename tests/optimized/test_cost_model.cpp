// The cost model (optimized/runtime/cost_model.h): declarations are collected only inside a
// CostScope; a GEMM declares the FLOPs and bytes of its definition; a whole dense layer's GEMMs
// add up to 2 FLOPs per token per linear weight element (counted here from the parameters, not
// from the launchers), and the roofline time is the larger of the memory and the compute time.
#include <gtest/gtest.h>

#include <filesystem>

#include "fixtures/fixture.h"
#include "optimized/dot_product_attention.cuh"
#include "optimized/runtime/cost_model.h"
#include "optimized/runtime/gemm.h"
#include "optimized/transformer_layer.h"
#include "parity/dense_case.h"
#include "parity/fixture_kinds.h"
#include "tests/optimized/retro/retro_case.h"

using namespace twin;

TEST(CostModel, CollectsOnlyInsideAScope) {
  rt::declare_cost("outside", 1, 1);  // no scope: dropped
  rt::CostScope outer;
  rt::declare_cost("k", 10, 20);
  {
    rt::CostScope inner;  // the innermost scope collects
    rt::declare_cost("k", 1, 2);
    ASSERT_EQ(inner.kernels().size(), 1u);
    EXPECT_EQ(inner.kernels()[0].bytes, 1);
  }
  rt::declare_cost("k", 10, 20);
  ASSERT_EQ(outer.kernels().size(), 1u);
  EXPECT_EQ(outer.kernels()[0].launches, 2);
  EXPECT_EQ(outer.kernels()[0].bytes, 20);
  EXPECT_EQ(outer.kernels()[0].flops, 40);
}

TEST(CostModel, GemmDeclaresItsDefinition) {
  // D[m, n] = A[m, k] B[k, n] in bf16, no C, no bias: 2 m n k FLOPs, (m k + k n + m n) * 2 bytes.
  const std::int64_t m = 24, n = 8, k = 16;
  rt::Device& d = rt::device(rt::Backend::Sim);
  rt::DeviceBuffer a(d, m * k * 2), b(d, k * n * 2), out(d, m * n * 2);
  rt::GemmArgs g;
  g.m = m, g.n = n, g.k = k;
  g.ab_dtype = g.cd_dtype = DType::BF16;
  g.a = a.as<const void>(), g.lda = m;
  g.b = b.as<const void>(), g.ldb = k;
  g.d = out.as<void>(), g.ldd = m;
  rt::CostScope scope;
  rt::gemm(rt::Backend::Sim).run(g, nullptr);
  ASSERT_EQ(scope.kernels().size(), 1u);
  EXPECT_EQ(scope.kernels()[0].flops, 2.0 * m * n * k);
  EXPECT_EQ(scope.kernels()[0].bytes, 2.0 * (m * k + k * n + m * n));
}

TEST(CostModel, DenseLayerGemmsCountEveryWeightOnce) {
  const parity::DenseCase c = parity::parse_case_id(
      "dense(h=32,a=4,g=2,d=8,ffn=48,norm=rms,act=silu,glu=1,bias=0,qkv_bias=0,rope=half,rot=1,qkln=0,mask=causal,s=8,"
      "b=2,dtype=bf16,tp=1,sp=0,drop=0,seed=3)");
  const parity::DenseInputs in = parity::make_inputs(c);
  double weight_elements = 0;
  for (const auto& [key, t] : in.params)
    if (key.find("linear_") != std::string::npos && key.size() > 7 && key.substr(key.size() - 7) == ".weight")
      weight_elements += double(t.numel());
  opt::LayerOptions lo;
  opt::DenseTransformerLayer layer(in.config, in.params, lo);
  rt::CostScope scope;
  layer.forward(in.hidden_states, nullptr, &in.rotary_pos_emb, opt::ForwardOptions{});
  double gemm_flops = 0;
  bool attention = false, norm = false;
  for (const auto& k : scope.kernels()) {
    if (k.kernel.rfind("gemm", 0) == 0) gemm_flops += k.flops;
    attention |= k.kernel == "dot_product_attention_forward";
    norm |= k.kernel == "rmsnorm_forward";
    EXPECT_GT(k.bytes, 0) << k.kernel;
  }
  EXPECT_EQ(gemm_flops, 2.0 * c.s * c.b * weight_elements);
  EXPECT_TRUE(attention);
  EXPECT_TRUE(norm);
}

TEST(CostModel, RooflineIsTheSlowerOfMemoryAndCompute) {
  const rt::Roofline roof;
  const rt::KernelCost memory{"m", 4.8e12, 1.0, 1}, compute{"c", 1.0, 989e12, 1};
  EXPECT_DOUBLE_EQ(roof.seconds(memory), 1.0);
  EXPECT_TRUE(roof.memory_bound(memory));
  EXPECT_DOUBLE_EQ(roof.seconds(compute), 1.0);
  EXPECT_FALSE(roof.memory_bound(compute));
  const std::string table = rt::cost_table({memory, compute});
  EXPECT_NE(table.find("MODEL"), std::string::npos);
  EXPECT_NE(table.find("total"), std::string::npos);
}

// Every simulated kernel launch of a layer's forward is matched by one declaration of its launcher
// (GEMMs declare through the GEMM interface and are no kernel launch of the simulator): a launcher
// without a declaration would leave its kernel out of the roofline table.
void expect_every_launch_declared(const rt::CostScope& scope) {
  int launched = 0, declared = 0;
  std::string names;
  for (const auto& [name, n] : scope.kernel_launches()) {
    launched += n;
    names += " " + name;
  }
  for (const auto& k : scope.kernels())
    if (k.kernel.rfind("gemm", 0) != 0 && k.kernel.rfind("grouped_gemm", 0) != 0) declared += k.launches;
  EXPECT_GT(launched, 0);
  EXPECT_EQ(declared, launched) << "kernels launched:" << names << "\n" << rt::cost_table(scope.kernels());
}

TEST(CostModel, EveryDenseLayerKernelIsDeclared) {
  const parity::DenseCase c = parity::parse_case_id(
      "dense(h=32,a=4,g=2,d=8,ffn=48,norm=ln,act=gelu,glu=0,bias=1,qkv_bias=1,rope=half,rot=1,qkln=1,mask=causal,s=8,"
      "b=2,dtype=bf16,tp=1,sp=0,drop=0.1,seed=3)");
  const parity::DenseInputs in = parity::make_inputs(c);
  opt::DenseTransformerLayer layer(in.config, in.params, opt::LayerOptions{});
  rt::CostScope scope;
  layer.forward(in.hidden_states, nullptr, &in.rotary_pos_emb, opt::ForwardOptions{});
  expect_every_launch_declared(scope);
}

TEST(CostModel, EveryRetroKernelIsDeclared) {
  for (const auto kind : {test::RetroKind::First, test::RetroKind::Block}) {
    test::RetroCase c;
    c.kind = kind;
    c.ns = 5, c.m = 2, c.k = 2, c.chunks = 2, c.encoder_layers = 1, c.dropout = 0.1, c.dtype = DType::BF16;
    rt::CostScope scope;
    test::run_optimized(c);
    SCOPED_TRACE(test::to_id(c));
    expect_every_launch_declared(scope);
  }
}

// Every MoE golden (router score functions, router dtypes, capacity and drop policies, losses,
// shared experts and gate, both dispatchers) runs every MoE launcher at least once.
TEST(CostModel, EveryMoEKernelIsDeclared) {
  int goldens = 0;
  for (const std::string& dir : {golden_dir(), golden_dir() + "/random"})
    for (const auto& entry : std::filesystem::directory_iterator(dir)) {
      const std::string path = entry.path().string();
      if (entry.path().extension() != ".safetensors") continue;
      const Fixture f = load_fixture(path);
      if (f.kind != "moe_layer") continue;
      const FixtureHandler h = find_fixture_handler(f.kind, TwinKind::Optimized, RunMode{});
      ASSERT_TRUE(h);
      SCOPED_TRACE(path);
      rt::CostScope scope;
      h(f, RunMode{});
      expect_every_launch_declared(scope);
      ++goldens;
    }
  EXPECT_GE(goldens, 7);
}

// The attention's two passes: per query tile (64 rows on tensor cores, 16 on CUDA cores) K is read
// twice (once per pass) and V once, over the keys the tile needs (all; up to its last row when
// causal); q is read and the context written once; an explicit mask is read once; nothing else of
// size sq x sk (scores and probabilities stay on chip). Expected bytes counted here from that
// description; FLOPs: q k^T twice and p v once (2 hn each per computed (row, key)) + 5 per score.
TEST(CostModel, AttentionReadsKTwiceAndVOncePerQueryTileAndNoScores) {
  namespace k = opt::sim;
  rt::Device& d = rt::device(rt::Backend::Sim);
  const int s = 150, b = 2, np = 4, hpg = 2, ng = np / hpg;
  for (auto [dt, hn, bq] :
       {std::tuple{DType::BF16, 64, 64}, std::tuple{DType::F16, 32, 64}, std::tuple{DType::F32, 64, 16},
        std::tuple{DType::BF16, 40, 64}, std::tuple{DType::F32, 40, 16}})
    for (twin::opt::MaskMode mask :
         {twin::opt::MaskMode::None, twin::opt::MaskMode::Causal, twin::opt::MaskMode::Explicit}) {
      const int ld = ng * (hpg + 2) * hn;
      const double e = dtype_size(dt);
      rt::DeviceBuffer qkv(d, std::size_t(s) * b * ld * dtype_size(dt)), ctx(d, std::size_t(s) * b * np * hn * 4),
          m(d, std::size_t(s) * s);
      qkv.zero();
      m.zero();
      opt::AttnParams p;
      p.sq = p.sk = s;
      p.b = b;
      p.np_local = p.np_total = np;
      p.hn = hn;
      p.mask = mask;
      p.mask_ptr = static_cast<const std::uint8_t*>(m.get());
      rt::CostScope scope;
      k::dot_product_attention_forward(dt, qkv.get(), opt::QkvLayout{ld, (hpg + 2) * hn, hpg}, ctx.get(), p, nullptr);
      ASSERT_EQ(scope.kernels().size(), 1u);
      double keys_read = 0, pairs = 0;  // per (batch, head): key rows per query tile, (row, key) products
      for (int q0 = 0; q0 < s; q0 += bq) {
        const int rows = std::min(bq, s - q0), keys = mask == twin::opt::MaskMode::Causal ? q0 + rows : s;
        keys_read += keys;
        pairs += double(rows) * keys;
      }
      const double q_and_context = 2.0 * e * b * np * s * hn;
      const double k_twice_v_once = 3.0 * e * b * np * keys_read * hn;
      const double mask_once = mask == twin::opt::MaskMode::Explicit ? double(s) * s : 0.0;
      SCOPED_TRACE(std::string(dtype_name(dt)) + " hn " + std::to_string(hn) + " mask " + std::to_string(int(mask)));
      EXPECT_EQ(scope.kernels()[0].bytes, q_and_context + k_twice_v_once + mask_once);
      EXPECT_EQ(scope.kernels()[0].flops, b * np * pairs * (3 * 2.0 * hn + 5.0));
    }
}

// Every dense golden passes with the attention the supports function chooses, and the 16-bit ones
// (the bf16 goldens of random/) run it on tensor cores: the launched attention kernels are the WMMA
// ones, the forward's and, for the goldens with gradients, the backward's dq and dk / dv kernels.
TEST(CostModel, DenseGoldensRunAttentionOnTensorCoresWhereSupported) {
  int goldens = 0, on_tensor_cores = 0, backward_on_tensor_cores = 0;
  for (const std::string& dir : {golden_dir(), golden_dir() + "/random"})
    for (const auto& entry : std::filesystem::directory_iterator(dir)) {
      if (entry.path().extension() != ".safetensors") continue;
      const Fixture f = load_fixture(entry.path().string());
      if (f.kind != "dense_layer") continue;
      SCOPED_TRACE(entry.path().string());
      rt::CostScope scope;
      for (const Comparison& c : compare_fixture(f, TwinKind::Optimized)) EXPECT_EQ(c.mismatches, 0) << c.name;
      bool forward = false, backward = false, dkv = false;
      for (const auto& [name, n] : scope.kernel_launches()) {
        forward |= name.find("dot_product_attention_forward_wmma_kernel") != std::string::npos;
        backward |= name.find("dot_product_attention_backward_dq_wmma_kernel") != std::string::npos;
        dkv |= name.find("dot_product_attention_backward_dkv_wmma_kernel") != std::string::npos;
      }
      EXPECT_EQ(dkv, backward) << "the goldens' head dims (up to 32) take the dk / dv kernel on tensor cores too";
      on_tensor_cores += forward;
      backward_on_tensor_cores += backward;
      EXPECT_EQ(backward, forward && f.has("grad_in.output")) << "the backward's dq kernel follows the forward's";
      ++goldens;
    }
  EXPECT_GE(goldens, 20);
  EXPECT_GE(on_tensor_cores, 5);  // the bf16 dense goldens of random/ (head dims 8, 16, 24, 32)
  EXPECT_GE(backward_on_tensor_cores, 5);
}
