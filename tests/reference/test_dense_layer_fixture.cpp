// The dense_layer fixture handler on every golden dense_* file: every output and tap compared,
// all within the numerics-derived tolerance; a tap the reference does not produce fails.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "core/safetensors.h"
#include "fixtures/fixture.h"
#include "parity/fixture_kinds.h"
#include "tests/parity/wrong_gradient.h"

using namespace twin;
namespace fs = std::filesystem;

namespace {

fs::path fixture_dir() { return golden_dir(); }

std::vector<fs::path> dense_files() {
  std::vector<fs::path> out;
  for (const auto& e : fs::directory_iterator(fixture_dir())) {
    const std::string name = e.path().filename().string();
    if (name.rfind("dense_", 0) == 0 && e.path().extension() == ".safetensors") out.push_back(e.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

TEST(DenseLayerFixture, EveryDenseFixturePassesWithEveryTapCompared) {
  const auto files = dense_files();
  ASSERT_GE(files.size(), 7u) << "dense fixtures missing under " << fixture_dir();
  for (const auto& path : files) {
    SCOPED_TRACE(path.string());
    const Fixture f = load_fixture(path.string());
    ASSERT_EQ(f.kind, "dense_layer");
    const auto comparisons = compare_fixture(f, TwinKind::Reference);
    // one comparison per tap.* plus output.hidden_states, then one per grad.* (the backward's)
    EXPECT_EQ(comparisons.size(), f.names_with_prefix("tap.").size() + 1 + f.names_with_prefix("grad.").size());
    EXPECT_FALSE(f.names_with_prefix("grad.").empty());
    for (const auto& c : comparisons) {
      EXPECT_TRUE(c.pass) << c.name << ": " << c.message << " max_abs " << c.max_abs << " share " << c.share_used;
      // Counted, not typed: the reason names the fp32 stores, and an fp32 golden's bound stays far
      // below bf16's unit roundoff (2^-8), so a bf16-precision answer cannot pass (next test).
      if (c.tol.rtol > 0) {
        EXPECT_NE(c.tol.reason.find("fp32 stores"), std::string::npos) << c.tol.reason;
      }
      EXPECT_LT(c.tol.rtol, unit_roundoff(DType::BF16) / 8) << c.name << ": " << c.tol.reason;
    }
  }
}

// The counted bound is tight enough to catch a reduced-precision answer: the reference's output
// stored in bf16 instead of fp32 fails every fp32 dense golden.
TEST(DenseLayerFixture, AnOutputRoundedToBf16FailsTheCountedBound) {
  for (const auto& path : dense_files()) {
    SCOPED_TRACE(path.string());
    const Fixture f = load_fixture(path.string());
    TwinRun run = find_fixture_handler(f.kind, TwinKind::Reference)(f, RunMode{});
    RecordEntry* out = nullptr;
    for (RecordEntry& e : run.record.entries)
      if (e.key() == "output.hidden_states") out = &e;
    ASSERT_NE(out, nullptr);
    out->value = out->value.to(DType::BF16).to(DType::F32);
    parity::Expected expected = parity::expected_of(f);
    if (run.backward)
      for (auto& g : parity::grads_of(f)) expected.push_back(g);
    bool output_failed = false;
    for (const auto& c : parity::compare_record(run.record, expected, "reference"))
      if (c.name == "output.hidden_states") output_failed = !c.pass;
    EXPECT_TRUE(output_failed);
  }
}

TEST(DenseLayerFixture, ATapTheReferenceDoesNotProduceFails) {
  const auto files = dense_files();
  ASSERT_FALSE(files.empty());
  const SafetensorsFile src = read_safetensors(files.front().string());
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (const auto& n : src.names()) tensors.emplace_back(n, src.at(n));
  tensors.emplace_back("tap.self_attention.no_such_module", src.at("output.hidden_states"));
  const fs::path tmp = fs::temp_directory_path() / "dense_extra_tap.safetensors";
  write_safetensors(tmp.string(), tensors, src.metadata());
  const Fixture f = load_fixture(tmp.string());
  const auto comparisons = compare_fixture(f, TwinKind::Reference);
  bool found = false;
  for (const auto& c : comparisons)
    if (c.name == "tap.self_attention.no_such_module") {
      found = true;
      EXPECT_FALSE(c.pass);
      EXPECT_NE(c.message.find("produces no tensor"), std::string::npos) << c.message;
    }
  EXPECT_TRUE(found);
  fs::remove(tmp);
}

TEST(DenseLayerFixture, AWrongParameterFails) {
  const auto files = dense_files();
  ASSERT_FALSE(files.empty());
  const SafetensorsFile src = read_safetensors(files.front().string());
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (const auto& n : src.names()) {
    Tensor t = src.at(n);
    if (n == "param.mlp.linear_fc2.weight") {  // perturb one weight: the output must fail
      t = t.clone();
      t.data_mut<float>()[0] += 0.5f;
    }
    tensors.emplace_back(n, t);
  }
  const fs::path tmp = fs::temp_directory_path() / "dense_wrong_param.safetensors";
  write_safetensors(tmp.string(), tensors, src.metadata());
  const auto comparisons = compare_fixture(load_fixture(tmp.string()), TwinKind::Reference);
  bool output_failed = false;
  for (const auto& c : comparisons)
    if (c.name == "output.hidden_states") output_failed = !c.pass;
  EXPECT_TRUE(output_failed);
  fs::remove(tmp);
}

// Each gradient's counted bound is tight enough to catch a 1% error in it alone: one grad.* tensor
// of the golden scaled by 1.01 fails that row and no other (fp32 goldens: a few 2^-24 per rounding
// point, far below 1e-2).
// Both twins: the optimized twin's gradients carry its own counts and magnitudes.
TEST(DenseLayerFixture, AWrongGradientFailsAlone) {
  const Fixture f = load_fixture((fixture_dir() / "dense_ln_mha_gelu_bias.safetensors").string());
  for (const TwinKind twin : {TwinKind::Reference, TwinKind::Optimized}) {
    SCOPED_TRACE(twin_kind_name(twin));
    const TwinRun run = find_fixture_handler(f.kind, twin)(f, RunMode{});
    twin::test::expect_each_wrong_gradient_fails_alone(f, run, twin_kind_name(twin));
  }
}

// The report says what happened to the gradients: compared for dense goldens, and plainly not
// compared for kinds without a backward and for isolated runs (never a silent pass).
TEST(DenseLayerFixture, TheGradientStatusIsReported) {
  std::string grads;
  const Fixture dense = load_fixture((fixture_dir() / "dense_ln_mha_gelu_bias.safetensors").string());
  compare_fixture(find_fixture_handler(dense.kind, TwinKind::Reference), dense, TwinKind::Reference, RunMode{}, &grads);
  EXPECT_EQ(grads, "compared");
  compare_fixture(find_fixture_handler(dense.kind, TwinKind::Reference, RunMode{true}), dense, TwinKind::Reference,
                  RunMode{true}, &grads);
  EXPECT_EQ(grads.rfind("not compared: an isolated run", 0), 0u) << grads;
  const Fixture moe = load_fixture((fixture_dir() / "moe_top2_aux_allgather.safetensors").string());
  compare_fixture(find_fixture_handler(moe.kind, TwinKind::Reference), moe, TwinKind::Reference, RunMode{}, &grads);
  EXPECT_EQ(grads, "compared");
  const Fixture retro = load_fixture((fixture_dir() / "retro_later_layer_divisible.safetensors").string());
  compare_fixture(find_fixture_handler(retro.kind, TwinKind::Reference), retro, TwinKind::Reference, RunMode{}, &grads);
  EXPECT_EQ(grads, "compared");
  // The optimized twin's dense backward: compared.
  compare_fixture(find_fixture_handler(dense.kind, TwinKind::Optimized), dense, TwinKind::Optimized, RunMode{}, &grads);
  EXPECT_EQ(grads, "compared");
  const Fixture qkln = load_fixture((fixture_dir() / "dense_rms_mha_swiglu_qkln.safetensors").string());
  compare_fixture(find_fixture_handler(qkln.kind, TwinKind::Optimized), qkln, TwinKind::Optimized, RunMode{}, &grads);
  EXPECT_EQ(grads, "compared");          // qk-layernorm's backward reads the forward's pre-norm copy
  for (const bool sp : {false, true}) {  // sharded over 2 ranks, with and without SP: compared, and within bounds
    RunMode tp2;
    tp2.tp = 2;
    tp2.sp = sp;
    for (const Comparison& c : compare_fixture(find_fixture_handler(dense.kind, TwinKind::Optimized, tp2), dense,
                                               TwinKind::Optimized, tp2, &grads))
      EXPECT_TRUE(c.pass) << (sp ? "tp 2 + sp " : "tp 2 ") << c.name << ": " << c.tol.reason;
    EXPECT_EQ(grads, "compared");
  }
  // The optimized twin's MoE and Retro backward: compared.
  compare_fixture(find_fixture_handler(moe.kind, TwinKind::Optimized), moe, TwinKind::Optimized, RunMode{}, &grads);
  EXPECT_EQ(grads, "compared");
  compare_fixture(find_fixture_handler(retro.kind, TwinKind::Optimized), retro, TwinKind::Optimized, RunMode{}, &grads);
  EXPECT_EQ(grads, "compared");
}
