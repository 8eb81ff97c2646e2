// The reference counts the rounding points it executes (reference/precision.h count_*), once per
// tensor, where each `rounds:` mark stores: each module's count is written out here from the
// torch ops Megatron runs, so a rounding point added to or dropped from a module without its count
// fails here.
#include <gtest/gtest.h>

#include <functional>
#include <random>

#include "reference/activations.h"
#include "reference/dot_product_attention.h"
#include "reference/fused_bias_dropout.h"
#include "reference/linear.h"
#include "reference/torch_norm.h"
#include "tests/reference/counted_bound.h"
#include "tests/reference/dense_test_util.h"

namespace twin::reference {
namespace {

using testing::random_mat;

Precision bf16() { return Precision{ComputeMode::FP32, DType::BF16}; }

RoundingCount count_of(const std::function<void()>& run) {
  CountRoundings counting;
  run();
  return rounding_now();
}

TEST(RoundingCounts, LinearWithBiasStoresTheGemmAndTheSum) {
  std::mt19937_64 g(1);
  Linear lin(8, 4, /*bias=*/true, /*skip_bias_add=*/false, bf16());
  const RoundingCount r = count_of([&] { lin.forward(random_mat(g, 3, 8)); });
  EXPECT_EQ(r.bf16, 2);       // x @ w^T, then + bias
  EXPECT_EQ(r.reduction, 8);  // one fp32-accumulated dot product of length in_features
  EXPECT_EQ(r.fp32, 0);
  Linear skip(8, 4, true, /*skip_bias_add=*/true, bf16());
  EXPECT_EQ(count_of([&] { skip.forward(random_mat(g, 3, 8)); }).bf16, 1);  // the bias is returned, not added
}

TEST(RoundingCounts, NormsCountTheStoresOfTorchsCpuKernels) {
  std::mt19937_64 g(2);
  LayerNorm ln(16, 1e-5, false, bf16());
  RoundingCount r = count_of([&] { ln.forward(random_mat(g, 3, 16)); });
  EXPECT_EQ(r.fp32, 0);        // torch 1.13 CPU keeps the statistics in bf16, not fp32:
  EXPECT_EQ(r.bf16, 5);        // mean, variance, rstd, the shift -rstd * mean, the output
  EXPECT_EQ(r.reduction, 32);  // mean and variance over 16
  RMSNorm rms(16, 1e-5, false, bf16());
  r = count_of([&] { rms.forward(random_mat(g, 3, 16)); });
  EXPECT_EQ(r.fp32, 1);  // rstd
  EXPECT_EQ(r.bf16, 2);  // x * rstd (torch's rms_norm casts back), then * weight
  EXPECT_EQ(r.reduction, 16);
}

// DotProductAttention's forward, unfused (dot_product_attention.py with
// FusedScaleMaskSoftmax.forward_torch_softmax), op by op for [sq = sk = 6, b = 2, np, hn = 8]:
//   scores = torch.baddbmm(buf, q, k^T, beta=0, alpha)  an fp32-accumulated dot of length hn,
//                                                       stored once in the activation dtype (alpha
//                                                       is applied in the GEMM's epilogue)
//   input.float()                                       (fp16/bf16 with attention_softmax_in_fp32)
//                                                       exact: a widening copy, no store counted
//   input * scale                                       (apply_query_key_layer_scaling: scale =
//                                                       coeff; softmax_in_fp32 is forced on) a
//                                                       store in fp32
//   masked_fill_(mask, -10000.0)                        a constant written: no rounding of a value
//   torch.softmax(x, -1)                                a reduction (the row's sum) of length sk,
//                                                       its output stored in x's dtype: fp32 under
//                                                       the upcast, else the activation dtype
//   probs.bfloat16() / .half()                          (upcast only) a store in the activation dtype
//   attention_dropout(probs)                            (training, p > 0) probs * mask / (1 - p),
//                                                       one store in the activation dtype
//   torch.bmm(probs, v)                                 an fp32-accumulated dot of length sk, stored
//                                                       in the activation dtype
// repeat_interleave (GQA) and the views / permutes copy: no store. So every case reduces over
// hn + sk + sk = 8 + 6 + 6 = 20, and stores 3 (+1 with dropout) times in the activation dtype (the
// softmax's own store, or the cast back, is one of them) plus, in fp32, the softmax output under
// the upcast and the layer-scaling product. With fp32 activations (input_in_float16 false: no
// upcast) every store is an fp32 store.
struct AttnCountCase {
  const char* name;
  DType dt;
  bool softmax_in_fp32, layer_scaling, dropout;
  int np, ng;
  RoundingCount want;
  bool learnable_sink = false;  // softmax_type "learnable": the sink logit joins the softmax's sum
};

RoundingCount stores(DType dt, int act, int fp32) {
  RoundingCount r;
  r.store(dt, act);
  r.store(DType::F32, fp32);
  r.reduction = 8 + 6 + 6;  // q . k over hn, the softmax's sum over sk, probs @ v over sk
  return r;
}

RoundingCount with_sink(RoundingCount r) {
  r.reduction += 1;
  return r;
}

TEST(RoundingCounts, DotProductAttentionCountsTheStoresOfMegatronsUnfusedSoftmax) {
  const AttnCountCase cases[] = {
      // fp32: baddbmm, softmax, bmm
      {"fp32", DType::F32, true, false, false, 2, 2, stores(DType::F32, 3, 0)},
      // fp32 + layer scaling: input * coeff in fp32 adds one
      {"fp32 coeff", DType::F32, true, true, false, 2, 2, stores(DType::F32, 3, 1)},
      // fp32 + dropout: the dropout product adds one
      {"fp32 dropout", DType::F32, false, false, true, 2, 2, stores(DType::F32, 4, 0)},
      // bf16, softmax in bf16: baddbmm, softmax output, bmm
      {"bf16", DType::BF16, false, false, false, 2, 2, stores(DType::BF16, 3, 0)},
      // bf16, softmax in fp32: baddbmm, .bfloat16(), bmm; the fp32 softmax output
      {"bf16 softmax fp32", DType::BF16, true, false, false, 2, 2, stores(DType::BF16, 3, 1)},
      // bf16 + layer scaling: the fp32 product input * coeff too
      {"bf16 coeff", DType::BF16, false, true, false, 2, 2, stores(DType::BF16, 3, 2)},
      // bf16, softmax in fp32, dropout, GQA (4 heads on 1 group): dropout's product
      {"bf16 softmax fp32 dropout gqa", DType::BF16, true, false, true, 4, 1, stores(DType::BF16, 4, 1)},
      // fp16, softmax in fp16
      {"fp16", DType::F16, false, false, false, 2, 2, stores(DType::F16, 3, 0)},
      // fp16, softmax in fp32
      {"fp16 softmax fp32", DType::F16, true, false, false, 2, 2, stores(DType::F16, 3, 1)},
      // fp16 + layer scaling + dropout, GQA (4 heads on 2 groups)
      {"fp16 coeff dropout gqa", DType::F16, true, true, true, 4, 2, stores(DType::F16, 4, 2)},
      // bf16, softmax in fp32, a learnable sink: SoftmaxOne sums sk + 1 exponentials
      {"bf16 learnable sink", DType::BF16, true, false, false, 2, 2, with_sink(stores(DType::BF16, 3, 1)), true},
  };
  const int sq = 6, sk = 6, b = 2, hn = 8;
  for (const AttnCountCase& k : cases)
    for (ComputeMode mode : {ComputeMode::FP32, ComputeMode::Fast}) {
      SCOPED_TRACE(std::string(k.name) + (mode == ComputeMode::Fast ? ", fast mode" : ", fp32 mode"));
      const TransformerConfig c =
          testing::attention_config(k.np, k.ng, hn, k.dt, k.softmax_in_fp32, k.layer_scaling, k.learnable_sink);
      const DotProductAttention dpa(c, /*layer_number=*/3, AttnMaskType::causal, Precision{mode, k.dt},
                                    k.dropout ? std::optional<double>(0.25) : std::nullopt);
      std::mt19937_64 g(4);
      const Mat q = testing::round_mat(random_mat(g, sq * b * k.np, hn), k.dt);
      const Mat kk = testing::round_mat(random_mat(g, sk * b * k.ng, hn), k.dt);
      const Mat v = testing::round_mat(random_mat(g, sk * b * k.ng, hn), k.dt);
      const RoundingCount r = count_of([&] {
        dpa.forward(q, kk, v, sq, sk, b, nullptr, /*training=*/true, DropoutRng{7, 0});
      });
      EXPECT_EQ(r, k.want) << "counted " << r.describe() << ", Megatron's ops store " << k.want.describe();
      if (k.dropout) {  // not training: attention_dropout is the identity, no store
        RoundingCount eval = k.want;
        eval.store(k.dt, -1);
        EXPECT_EQ(count_of([&] { dpa.forward(q, kk, v, sq, sk, b, nullptr, false, DropoutRng{7, 0}); }), eval);
      }
    }
}

// The activations (activations.py, torch.nn.functional), each torch op's output stored in the
// activation dtype; a value through parallel ops carries the longer path's count.
TEST(RoundingCounts, ActivationsCountOneStorePerTorchOp) {
  std::mt19937_64 g(5);
  const Mat x = testing::round_mat(random_mat(g, 4, 8), DType::BF16);
  auto count = [&](ActivationFunc f) { return count_of([&] { apply_activation(f, x, bf16()); }).bf16; };
  EXPECT_EQ(count(ActivationFunc::Gelu), 1);         // F.gelu: one kernel, one store
  EXPECT_EQ(count(ActivationFunc::OpenAIGelu), 1);   // jit-fused tanh form: one store
  EXPECT_EQ(count(ActivationFunc::FastGelu), 1);     // one fused expression, one store
  EXPECT_EQ(count(ActivationFunc::ErfGelu), 4);      // x / 1.41421, erf, + 1, times x * 0.5 (parallel: 1)
  EXPECT_EQ(count(ActivationFunc::QuickGelu), 3);    // 1.702 * x, sigmoid, x * ...
  EXPECT_EQ(count(ActivationFunc::Silu), 3);         // torch 1.13 CPU bf16 silu: exp(-x), 1 + ..., x / ...
  EXPECT_EQ(count(ActivationFunc::Relu), 0);         // selects x or 0: no rounding
  EXPECT_EQ(count(ActivationFunc::SquaredRelu), 1);  // pow(relu(x), 2)
  for (ActivationFunc f : {ActivationFunc::Gelu, ActivationFunc::Silu}) {
    const RoundingCount r = count_of([&] { apply_activation(f, x, bf16()); });
    EXPECT_EQ(r.fp32, 0);  // elementwise: no fp32 store, no reduction
    EXPECT_EQ(r.reduction, 0);
  }
}

// mlp.py glu: torch.chunk (a view), act(x_glu) * (x_linear [+ glu_linear_offset]): the
// activation's stores, then the product's; the offset's add runs beside the activation (1 store
// against silu's 3), so the longer path is unchanged.
TEST(RoundingCounts, GluCountsTheActivationThenTheProduct) {
  std::mt19937_64 g(6);
  const Mat x = testing::round_mat(random_mat(g, 4, 16), DType::BF16);
  for (ComputeMode mode : {ComputeMode::FP32, ComputeMode::Fast}) {
    const Precision p{mode, DType::BF16};
    EXPECT_EQ(count_of([&] { glu(ActivationFunc::Silu, x, 0.0, std::nullopt, p); }).bf16, 3 + 1);
    EXPECT_EQ(count_of([&] { glu(ActivationFunc::Gelu, x, 0.0, std::nullopt, p); }).bf16, 1 + 1);
    EXPECT_EQ(count_of([&] { glu(ActivationFunc::Silu, x, 1.0, std::nullopt, p); }).bf16, 3 + 1);
    // gelu's one store against the offset's add: the two parallel paths are one store each
    EXPECT_EQ(count_of([&] { glu(ActivationFunc::Gelu, x, 1.0, std::nullopt, p); }).bf16, 1 + 1);
  }
}

// fused_bias_dropout.py _bias_dropout_add_func: x + bias (one store), dropout (training: x * mask
// / (1 - p), one store), residual + ... (one store); residual.to(x.dtype) is a no-op for a
// residual already in the dtype, and its own count joins from before.
TEST(RoundingCounts, BiasDropoutAddCountsEachTorchOp) {
  std::mt19937_64 g(7);
  const Mat x = testing::round_mat(random_mat(g, 4, 8), DType::BF16);
  const Mat res = testing::round_mat(random_mat(g, 4, 8), DType::BF16);
  const RowVec bias = testing::round_vec(random_mat(g, 1, 8).row(0), DType::BF16);
  const DropoutRng rng{3, 0};
  EXPECT_EQ(count_of([&] { bias_dropout_add(x, bias, res, 0.1, true, rng, bf16()); }).bf16, 3);
  EXPECT_EQ(count_of([&] { bias_dropout_add(x, bias, res, 0.1, false, rng, bf16()); }).bf16, 2);
  EXPECT_EQ(count_of([&] { bias_dropout_add(x, std::nullopt, res, 0.1, true, rng, bf16()); }).bf16, 2);
  EXPECT_EQ(count_of([&] { bias_dropout_add(x, std::nullopt, res, 0.0, true, rng, bf16()); }).bf16, 1);
  EXPECT_EQ(count_of([&] { dropout(x, 0.1, true, rng, bf16()); }).bf16, 1);
  EXPECT_TRUE(count_of([&] { dropout(x, 0.1, false, rng, bf16()); }).none());  // identity
}

TEST(RoundingCounts, ExactModeCountsNothing) {
  std::mt19937_64 g(3);
  Linear lin(8, 4, true, false, testing::exact());
  EXPECT_TRUE(count_of([&] { lin.forward(random_mat(g, 3, 8)); }).none());
}

}  // namespace
}  // namespace twin::reference
