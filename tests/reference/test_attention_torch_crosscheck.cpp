// The attention probabilities the reference stores (DotProductAttention::stored_probabilities, the
// values forward() multiplies v by) against LibTorch 1.13's softmax on the same scores, for bf16
// and fp16 activations, in ComputeMode::FP32 and ComputeMode::Fast (whose softmax is its own code,
// forward_fast): Megatron's FusedScaleMaskSoftmax.forward_torch_softmax stores the probabilities in
// the activation dtype (the softmax's output, or the cast back after the fp32 softmax of
// attention_softmax_in_fp32), so every probability must be a value of that dtype, equal to
// torch.softmax(scores.float(), -1).to(dtype). A probability left in fp32 (a missing store) fails
// the first check on nearly every element; a dropped sink (softmax_type learnable, nonzero
// offsets: SoftmaxOne, the sink column appended then dropped) fails the second.
//
// The scores are exact: q and k hold multiples of 1/4 in [-2, 2], so every q . k over hn = 16 is a
// multiple of 1/16 below 2^7, exact in fp32 whatever the accumulation order, and alpha =
// 1 / sqrt(16) (/ 2 with layer scaling at layer 2) is a power of two: the baddbmm output is that
// exact value rounded once to the dtype, which the oracle reproduces in double. Both softmaxes then
// start from the same fp32 values, and the score differences x - max are exact in fp32 (values of
// 16-bit dtypes a few binades apart), so each computes every probability within (n + 3) u32
// relative of the true one (n = sk + 1 terms summed in fp32: gamma_n; exp: <= 2 ulp; the division:
// 1/2 ulp; FP32 mode's double softmax rounds once, u32). Where the whole band of 2 (n + 3) u32
// around torch's fp32 value rounds to one value of the dtype, the two stores must agree bitwise;
// elsewhere (a value at a rounding midpoint of the dtype, where either neighbour is a correct
// rounding) within one ulp of the dtype.
#include <gtest/gtest.h>

#include "tests/optional_dependency.h"

#ifdef TWIN_HAVE_TORCH
#include <torch/torch.h>
#endif

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "dense_test_util.h"
#include "reference/dot_product_attention.h"

using namespace twin;
using namespace twin::reference;
using namespace twin::reference::testing;

#ifdef TWIN_HAVE_TORCH
namespace {

torch::ScalarType torch_dtype(DType dt) { return dt == DType::BF16 ? torch::kBFloat16 : torch::kHalf; }

// The spacing of dt's values just above |x| (x a value of dt): one ulp.
double ulp_above(DType dt, double x) {
  const float f = static_cast<float>(std::fabs(x));
  if (dt == DType::BF16) return bf16_bits_to_float(float_to_bf16_bits(f) + 1) - f;
  return fp16_bits_to_float(float_to_fp16_bits(f) + 1) - f;
}

// Values k / 4, k in [-8, 8]: exact in bf16 and fp16.
Mat quarters(std::mt19937_64& g, int rows, int cols) {
  std::uniform_int_distribution<int> d(-8, 8);
  Mat m(rows, cols);
  for (Eigen::Index i = 0; i < m.size(); ++i) m.data()[i] = d(g) / 4.0;
  return m;
}

torch::Tensor as_torch(const Mat& m) {
  return torch::from_blob(const_cast<double*>(m.data()), {m.rows(), m.cols()}, torch::kFloat64).clone();
}

struct Case {
  DType dt;
  bool softmax_in_fp32, layer_scaling, learnable;
};

std::string case_name(const Case& k, ComputeMode mode) {
  return std::string(dtype_name(k.dt)) + (k.softmax_in_fp32 ? " softmax_in_fp32" : " softmax_in_dtype") +
         (k.layer_scaling ? " layer_scaling" : "") + (k.learnable ? " learnable_offset" : "") +
         (mode == ComputeMode::Fast ? " fast" : " fp32");
}

void check_probabilities(const Case& k, ComputeMode mode) {
  SCOPED_TRACE(case_name(k, mode));
  const int np = 4, ng = 2, hn = 16, s = 12, b = 2, layer = 2;
  const TransformerConfig c = attention_config(np, ng, hn, k.dt, k.softmax_in_fp32, k.layer_scaling, k.learnable);
  DotProductAttention dpa(c, layer, AttnMaskType::causal, Precision{mode, k.dt});
  const std::vector<double> sink = {1.5, -0.75, 2.25, 0.5};  // nonzero, exact in bf16 and fp16
  if (k.learnable) {
    StateDict sd;
    sd.set("softmax_offset", mat_tensor(Eigen::Map<const Mat>(sink.data(), 1, np), {np}, k.dt));
    dpa.load_state_dict(sd, "");
  }
  std::mt19937_64 g(2026);
  const Mat q = quarters(g, s * b * np, hn), key = quarters(g, s * b * ng, hn);
  const Mat got = dpa.stored_probabilities(q, key, s, s, b, nullptr, false, DropoutRng{});
  ASSERT_EQ(got.rows(), b * np * s);
  ASSERT_EQ(got.cols(), s);

  // ---- Megatron's ops in torch, [b, np, sq, sk]
  torch::NoGradGuard no_grad;
  const double coeff = k.layer_scaling ? layer : 1.0, alpha = 1.0 / (std::sqrt(double(hn)) * coeff);
  const torch::Tensor qt = as_torch(q).view({s, b, np, hn}).permute({1, 2, 0, 3});  // [b, np, sq, hn]
  const torch::Tensor kt =
      as_torch(key).view({s, b, ng, hn}).repeat_interleave(np / ng, 2).permute({1, 2, 3, 0});  // [b, np, hn, sk]
  // baddbmm(q, k^T, alpha): the exact value (see above), stored once in the dtype
  const torch::Tensor scores = (torch::matmul(qt, kt) * alpha).to(torch::kFloat32).to(torch_dtype(k.dt));
  torch::Tensor x = scores.to(torch::kFloat32);  // input.float()
  if (k.layer_scaling) x = x * coeff;            // input * scale, fp32 (exact: a power of two)
  x = x.masked_fill(torch::triu(torch::ones({s, s}), 1).to(torch::kBool), -10000.0);
  if (k.learnable)  // SoftmaxOne: the sink logit [np] as a last column, dropped after the softmax
    x = torch::cat({x, torch::tensor(sink, torch::kFloat32)
                           .to(torch_dtype(k.dt))
                           .to(torch::kFloat32)
                           .view({1, np, 1, 1})
                           .expand({b, np, s, 1})},
                   -1);
  torch::Tensor p32 = torch::softmax(x, -1);
  if (k.learnable) p32 = p32.narrow(-1, 0, s);
  const torch::Tensor p32d = p32.contiguous().view({b * np * s, s}).to(torch::kFloat64).contiguous();
  const torch::Tensor want =
      p32.to(torch_dtype(k.dt)).contiguous().view({b * np * s, s}).to(torch::kFloat64).contiguous();
  const double *w = want.data_ptr<double>(), *w32 = p32d.data_ptr<double>();

  const double u32 = std::ldexp(1.0, -24), band = 2.0 * (s + 1 + 3) * u32;  // the header's argument
  Eigen::Index nonzero = 0, decided = 0, bitwise = 0;
  for (Eigen::Index i = 0; i < got.size(); ++i) {
    const double r = got.data()[i], e = w[i];
    ASSERT_EQ(r, round_to(k.dt, r)) << "probability " << i << " = " << r << " is not a " << dtype_name(k.dt)
                                    << " value (torch stores " << e << ")";
    if (e != 0.0) ++nonzero;
    bitwise += r == e;
    // every value within the band rounds to one dtype value: the store is decided
    if (round_to(k.dt, w32[i] * (1 - band)) == round_to(k.dt, w32[i] * (1 + band))) {
      ++decided;
      ASSERT_EQ(r, e) << "probability " << i << " (row " << i / s << ", column " << i % s << "): " << r << " vs torch "
                      << e << " (torch's fp32 softmax " << w32[i] << ")";
    } else {
      ASSERT_LE(std::fabs(r - e), ulp_above(k.dt, e))
          << "probability " << i << ": " << r << " vs torch " << e << ", more than one ulp";
    }
  }
  // Most stores are decided (a midpoint band of 2 (n + 3) u32 holds a few in 10^4): the check has
  // bite; the causal mask's zeros are decided too.
  EXPECT_GE(decided, got.size() - got.size() / 20) << "decided " << decided << " of " << got.size();
  std::printf("%-48s bitwise %ld / %ld (decided %ld, nonzero %ld)\n", case_name(k, mode).c_str(),
              static_cast<long>(bitwise), static_cast<long>(got.size()), static_cast<long>(decided),
              static_cast<long>(nonzero));
}

}  // namespace

TEST(AttentionTorchCrosscheck, ProbabilitiesAreStoredInTheActivationDtypeAsTorchStoresThem) {
  for (DType dt : {DType::BF16, DType::F16})
    for (bool in_fp32 : {true, false})
      for (ComputeMode mode : {ComputeMode::FP32, ComputeMode::Fast})
        check_probabilities({dt, in_fp32, false, false}, mode);
}

TEST(AttentionTorchCrosscheck, LayerScalingProbabilitiesMatchTorch) {
  for (DType dt : {DType::BF16, DType::F16})
    for (ComputeMode mode : {ComputeMode::FP32, ComputeMode::Fast}) check_probabilities({dt, true, true, false}, mode);
}

// softmax_type learnable with nonzero offsets: torch's SoftmaxOne on the same scores.
TEST(AttentionTorchCrosscheck, LearnableSoftmaxOffsetMatchesTorchsSoftmaxOne) {
  for (DType dt : {DType::BF16, DType::F16})
    for (bool in_fp32 : {true, false})
      for (ComputeMode mode : {ComputeMode::FP32, ComputeMode::Fast})
        check_probabilities({dt, in_fp32, false, true}, mode);
}
#else
TEST(AttentionTorchCrosscheck, NeedsLibTorch) {
  TWIN_SKIP_OPTIONAL("built without LibTorch (install libtorch-dev: ci/setup does)");
}
#endif
