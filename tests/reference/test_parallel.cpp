// reference/parallel.h: the products equal Eigen's within fp64 rounding, every chunk runs once, and
// the reference's whole run (every tap, output and gradient of dense, GQA, MoE, MLA and Retro
// goldens) is bitwise the same at 1, 2 and 3 threads.
#include "reference/parallel.h"

#include <gtest/gtest.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "fixtures/fixture.h"
#include "parity/dense_case.h"
#include "parity/fixture_kinds.h"
#include "reference/linear.h"
#include "reference/mlp.h"
#include "reference/state_dict.h"
#include "reference/transformer_layer.h"

namespace twin::reference {
namespace {

// Restores one thread (the library's default) after a test.
struct Threads {
  explicit Threads(int n) { set_threads(n); }
  ~Threads() { set_threads(1); }
};

Mat random_mat(Eigen::Index r, Eigen::Index c, unsigned seed) {
  std::srand(seed);
  return Mat::Random(r, c);
}

// memcmp's pointers must not be null even for 0 bytes (an empty matrix's data() is).
bool same_bytes(const void* a, const void* b, std::size_t n) { return n == 0 || std::memcmp(a, b, n) == 0; }

bool bitwise_equal(const Mat& a, const Mat& b) {
  return a.rows() == b.rows() && a.cols() == b.cols() &&
         same_bytes(a.data(), b.data(), sizeof(double) * std::size_t(a.size()));
}

// Shapes around the row chunk (64) and the fork threshold, odd on purpose; each product within
// k u |a||b| of Eigen's whole product (fp64 sums of k terms in any order), and bitwise the same at
// 1, 2 and 3 threads.
TEST(ReferenceParallel, ProductsEqualEigensAndAreBitwiseTheSameAtAnyThreadCount) {
  const double u = std::ldexp(1.0, -53);
  for (const auto [m, k, n] :
       {std::array<Eigen::Index, 3>{1, 1, 1}, {31, 7, 5}, {33, 65, 17}, {97, 130, 151}, {0, 4, 3}, {300, 64, 200}}) {
    const Mat a = random_mat(m, k, 1), b = random_mat(k, n, 2), bt = b.transpose(), at = a.transpose();
    const Mat want = a * b;
    const double tol = double(k) * u * double(k);  // |a_i b_i| <= 1, k terms
    std::vector<Mat> nn, nt, tn;
    for (int t : {1, 2, 3}) {
      const Threads threads(t);
      nn.push_back(gemm_nn(a, b));
      nt.push_back(gemm_nt(a, bt));
      tn.push_back(gemm_tn(at, b));
    }
    for (const auto* got : {&nn, &nt, &tn}) {
      ASSERT_EQ((*got)[0].rows(), m);
      ASSERT_EQ((*got)[0].cols(), n);
      if (m > 0 && n > 0) {
        EXPECT_LE(((*got)[0] - want).cwiseAbs().maxCoeff(), tol) << m << "x" << k << "x" << n;
      }
      EXPECT_TRUE(bitwise_equal((*got)[0], (*got)[1]) && bitwise_equal((*got)[0], (*got)[2]))
          << m << "x" << k << "x" << n;
    }
  }
  EXPECT_THROW(gemm_nn(Mat(2, 3), Mat(4, 2)), std::invalid_argument);
  EXPECT_THROW(set_threads(0), std::invalid_argument);
}

Tensor tensor_of(const Mat& m, DType dt) {
  Tensor t = Tensor::empty(dt, {m.rows(), m.cols()});
  t.write_f64(0, m.size(), m.data());
  return t;
}

// The products with a weight read in place: a bf16 weight (mapped from a golden) gives what Eigen
// gives on its values as doubles, within fp64 rounding, bitwise the same at 1, 2 and 3 threads; the
// weight gradient is the rounded dy^T x stored in its tensor's dtype, its magnitude max |dy|^T |x|.
TEST(ReferenceParallel, WeightProductsReadTheWeightInItsOwnDtype) {
  const double u = std::ldexp(1.0, -53);
  for (const auto [n, in, out] :
       {std::array<Eigen::Index, 3>{1, 1, 1}, {33, 65, 17}, {97, 130, 151}, {0, 4, 3}, {70, 64, 200}}) {
    const Tensor w = tensor_of(random_mat(out, in, 3), DType::BF16);  // rounds the values once, to bf16
    const Mat wd = to_mat(w, out, in, "w"), x = random_mat(n, in, 4), dy = random_mat(n, out, 5);
    const Mat y_want = x * wd.transpose(), dx_want = dy * wd, dw_want = dy.transpose() * x;
    std::vector<Mat> y, dx, dw;
    std::vector<double> mag;
    for (int t : {1, 2, 3}) {
      const Threads threads(t);
      y.push_back(gemm_x_wt(x, w));
      dx.push_back(gemm_dy_w(dy, w));
      Tensor g = Tensor::empty(DType::F32, {out, in});
      mag.push_back(gemm_wgrad(
          dy, x, [](Mat& m) { m = m.unaryExpr([](double v) { return double(float(v)); }); }, g));
      dw.push_back(to_mat(g, out, in, "dw"));
    }
    const std::string shape = std::to_string(n) + "x" + std::to_string(in) + "x" + std::to_string(out);
    for (const auto& [got, want, k] : {std::tuple{&y, &y_want, in}, {&dx, &dx_want, out}}) {
      ASSERT_EQ((*got)[0].rows(), want->rows()) << shape;
      ASSERT_EQ((*got)[0].cols(), want->cols()) << shape;
      if (want->size()) EXPECT_LE(((*got)[0] - *want).cwiseAbs().maxCoeff(), double(k) * u * double(k)) << shape;
      EXPECT_TRUE(bitwise_equal((*got)[0], (*got)[1]) && bitwise_equal((*got)[0], (*got)[2])) << shape;
    }
    // each element of dw rounded to fp32 once from an fp64 sum of n terms
    if (dw_want.size())
      EXPECT_LE((dw[0] - dw_want).cwiseAbs().maxCoeff(),
                std::ldexp(1.0, -24) * dw_want.cwiseAbs().maxCoeff() + double(n) * u * double(n))
          << shape;
    EXPECT_TRUE(bitwise_equal(dw[0], dw[1]) && bitwise_equal(dw[0], dw[2])) << shape;
    const double mag_want = dw_want.size() ? (dy.cwiseAbs().transpose() * x.cwiseAbs()).maxCoeff() : 0.0;
    EXPECT_NEAR(mag[0], mag_want, double(n) * u * double(n)) << shape;
    EXPECT_EQ(mag[0], mag[1]);
    EXPECT_EQ(mag[0], mag[2]);
  }
  const Tensor w = tensor_of(Mat::Ones(3, 4), DType::BF16);
  EXPECT_THROW(gemm_x_wt(Mat(2, 5), w), std::invalid_argument);
  EXPECT_THROW(gemm_dy_w(Mat(2, 4), w), std::invalid_argument);
}

// A Linear loaded from a state dict multiplies by the state dict's tensor itself (a golden's mapped
// bf16 bytes), not by a copy: a real-size layer's double copy would be four times its weights.
TEST(ReferenceParallel, LinearReadsItsLoadedWeightInPlace) {
  const Precision p = Precision::from_config(TransformerConfig{}, ComputeMode::FP32);
  Linear linear(4, 3, false, false, p);
  const Tensor w = tensor_of(random_mat(3, 4, 6), DType::BF16);
  linear.load_state_dict(StateDict({{"weight", w}}), "");
  EXPECT_EQ(linear.stored_weight().raw(), w.raw());
  const Mat x = random_mat(5, 4, 7);
  EXPECT_LE((linear.forward(x).output - p.act(x * to_mat(w, 3, 4, "w").transpose())).cwiseAbs().maxCoeff(), 1e-6);
}

// MLP's backward frees each saved activation once the step reading it has run: a real-size
// layer's [n, 2 ffn] activation input alone is a quarter of its golden.
TEST(ReferenceParallel, MlpBackwardReleasesWhatItConsumed) {
  TransformerConfig c;
  c.hidden_size = 8;
  c.ffn_hidden_size = 12;
  c.num_attention_heads = 2;
  c.gated_linear_unit = true;
  c.activation_func = "silu";
  const Precision p = Precision::from_config(c, ComputeMode::Exact);
  MLP mlp(c, p);
  mlp.linear_fc1.set_weight(random_mat(24, 8, 8));
  mlp.linear_fc2.set_weight(random_mat(8, 12, 9));
  MlpArgs args;
  args.lead = {5};
  MlpSaved saved;
  mlp.forward(random_mat(5, 8, 10), args, Taps(), &saved);
  ASSERT_EQ(saved.activation_input.rows(), 5);
  ASSERT_EQ(saved.linear_fc2.input.rows(), 5);
  const MlpGrads g = mlp.backward(random_mat(5, 8, 11), std::move(saved), args);
  EXPECT_EQ(g.hidden_states.rows(), 5);
  EXPECT_EQ(saved.activation_input.size(), 0);  // NOLINT(bugprone-use-after-move): what backward left
  EXPECT_EQ(saved.linear_fc2.input.size(), 0);
}

TEST(ReferenceParallel, EveryChunkRunsOnceOnSeveralThreadsAndTheFirstErrorIsRethrown) {
  const Threads threads(3);
  std::vector<std::atomic<int>> runs(100);
  std::mutex mu;
  std::set<std::thread::id> ids;
  for_chunks(100, 7, [&](Eigen::Index b, Eigen::Index e) {
    EXPECT_EQ(b % 7, 0);
    EXPECT_EQ(e, std::min<Eigen::Index>(100, b + 7));
    for (Eigen::Index i = b; i < e; ++i) ++runs[std::size_t(i)];
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    std::lock_guard<std::mutex> lock(mu);
    ids.insert(std::this_thread::get_id());
  });
  for (const auto& r : runs) EXPECT_EQ(r.load(), 1);
#ifdef _OPENMP
  EXPECT_GT(ids.size(), 1u) << "the chunks ran on one thread";
#endif
  EXPECT_THROW(for_chunks(10, 1,
                          [](Eigen::Index b, Eigen::Index) {
                            if (b == 3) throw std::runtime_error("chunk 3");
                          }),
               std::runtime_error);
}

// The reference twin's record (every entry's values and rounding count) of `golden` at t threads.
Record reference_run(const std::string& golden, int t) {
  const Threads threads(t);
  const Fixture f = load_fixture(golden);
  const FixtureHandler run = find_fixture_handler(f.kind, TwinKind::Reference);
  if (!run) throw std::logic_error("no reference handler for " + golden);
  return run(f, RunMode{}).record;
}

TEST(ReferenceParallel, TheReferencesRunIsBitwiseTheSameAtOneTwoAndThreeThreads) {
  const std::filesystem::path dir = golden_dir();
  const std::filesystem::path partial = dir.parent_path() / "megatron-core-partial";
  for (const std::filesystem::path& golden :
       {dir / "dense_rms_gqa_swiglu_rope.safetensors", dir / "dense_ln_mha_explicit_mask.safetensors",
        dir / "moe_top2_shared_expert_swiglu.safetensors", partial / "mla_moe_bf16_yarn_qlora.safetensors",
        dir / "retro_block_6layers_nondivisible.safetensors"}) {
    SCOPED_TRACE(golden.filename().string());
    const Record one = reference_run(golden.string(), 1);
    ASSERT_FALSE(one.entries.empty());
    std::size_t grads = 0;
    for (const RecordEntry& e : one.entries) grads += e.role == Role::Grad;
    EXPECT_GT(grads, 0u) << "the backward ran";
    for (int t : {2, 3}) {
      const Record other = reference_run(golden.string(), t);
      ASSERT_EQ(other.entries.size(), one.entries.size()) << t << " threads";
      for (std::size_t i = 0; i < one.entries.size(); ++i) {
        const RecordEntry &a = one.entries[i], &b = other.entries[i];
        ASSERT_EQ(a.key(), b.key());
        EXPECT_TRUE(a.value.shape() == b.value.shape() && a.value.nbytes() == b.value.nbytes() &&
                    same_bytes(a.value.raw(), b.value.raw(), a.value.nbytes()))
            << a.key() << " differs at " << t << " threads";
        EXPECT_TRUE(a.rounding == b.rounding) << a.key() << "'s rounding count differs at " << t << " threads";
      }
    }
  }
}

// The goldens' stores (fp32, bf16) would hide an order of fp64 sums that moved with the thread
// count; the exact mode stores nothing. A GQA layer large enough for every product to fork (h 128,
// 6 heads in 2 groups (three summed per key head), SwiGLU ffn 512, 128 tokens), forward and backward: its output, every
// tap and every gradient in fp64, at `t` threads.
std::vector<Tensor> exact_layer_run(const parity::DenseInputs& in, const Tensor& dout, int t) {
  const Threads threads(t);
  const Precision p = Precision::from_config(in.config, ComputeMode::Exact);
  const ModuleSpec spec =
      get_gpt_layer_local_spec(std::nullopt, in.config.qk_layernorm, in.config.normalization, in.config.qk_l2_norm,
                               attn_mask_type_from_name(in.config.attn_mask_type));
  TransformerLayer layer(in.config, spec.submodules, in.layer_number, std::nullopt, p);
  layer.load_state_dict(in.params);
  LayerInputs li;
  li.attention_mask = in.attention_mask.defined() ? &in.attention_mask : nullptr;
  li.rotary_pos_emb = in.rotary_pos_emb.defined() ? &in.rotary_pos_emb : nullptr;
  Record record;
  TransformerLayerSaved saved;
  std::vector<Tensor> out = {layer.forward(in.hidden_states, li, Taps(&record), &saved).first};
  for (const RecordEntry& e : record.entries) out.push_back(e.value);
  const TransformerLayerGrads g = layer.backward(dout, std::move(saved));
  out.push_back(g.hidden_states);
  for (const ParamGrad& pg : g.params) out.push_back(pg.stored(p.storage_dtype()));
  return out;
}

TEST(ReferenceParallel, TheExactModesFp64SumsAreBitwiseTheSameAtOneTwoAndThreeThreads) {
  parity::DenseCase c;
  c.hidden = 128;
  c.heads = 6;
  c.groups = 2;
  c.kv_channels = 32;
  c.ffn = 512;
  c.glu = true;
  c.act = "silu";
  c.s = 64;
  c.b = 2;
  const parity::DenseInputs in = parity::make_inputs(c);
  const Tensor dout = Tensor::from_doubles(DType::F64, in.hidden_states.shape(),
                                           std::vector<double>(std::size_t(in.hidden_states.numel()), 0.25));
  const std::vector<Tensor> one = exact_layer_run(in, dout, 1);
  ASSERT_GT(one.size(), 20u);
  for (int t : {2, 3}) {
    const std::vector<Tensor> other = exact_layer_run(in, dout, t);
    ASSERT_EQ(other.size(), one.size());
    for (std::size_t i = 0; i < one.size(); ++i) {
      ASSERT_EQ(one[i].dtype(), DType::F64) << i;
      EXPECT_TRUE(one[i].nbytes() == other[i].nbytes() && same_bytes(one[i].raw(), other[i].raw(), one[i].nbytes()))
          << "tensor " << i << " of " << one.size() << " at " << t << " threads";
    }
  }
}

}  // namespace
}  // namespace twin::reference
