// get_retro_decoder_block_layout: every num_layers from 1 to 96 against the layouts Megatron-Core
// builds (a table its own get_retro_decoder_block_spec wrote), the errors, the printer, and the
// golden layout table.
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <cstdlib>
#include <nlohmann/json.hpp>
#include <string>

#include "tests/case_id.h"
#include "fixtures/fixture.h"
#include "parity/fixture_kinds.h"
#include "reference/retro/decoder_spec.h"

using namespace twin;
using namespace twin::reference;
using namespace twin::reference::retro;

namespace {

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

// Megatron-Core's own layouts for 1..96 layers (retro_decoder_layout_table_1_96.json, written by
// megatron_retro_layout_oracle.py from the real get_retro_decoder_block_spec): every layer of every
// count equal, and Megatron's error (no Retro layer) exactly where the twin gives its own.
TEST(RetroDecoderLayout, EqualToMegatronFor1To96Layers) {
  const Fixture f = load_fixture(TWIN_RETRO_LAYOUT_1_96);
  ASSERT_EQ(f.kind, "retro_layout_table");
  const nlohmann::json& entries = f.table["entries"];
  ASSERT_EQ(entries.size(), 96u);
  for (int n = 1; n <= 96; ++n) {
    const nlohmann::json& e = entries[n - 1];
    ASSERT_EQ(e["num_layers"], n);
    if (e.contains("error")) {
      EXPECT_NE(error_of([n] { get_retro_decoder_block_layout(n); }), "") << "num_layers " << n;
      continue;
    }
    const std::vector<RetroLayerKind> layout = get_retro_decoder_block_layout(n);
    ASSERT_EQ(layout.size(), e["layers"].size()) << "num_layers " << n;
    for (int layer = 1; layer <= n; ++layer)
      EXPECT_EQ(retro_layer_kind_name(layout[layer - 1]), e["layers"][layer - 1].get<std::string>())
          << "num_layers " << n << ", layer " << layer;
  }
  // The same table through the golden handler: every cell equal.
  for (const auto& c : compare_fixture(f, TwinKind::Reference)) EXPECT_TRUE(c.pass) << c.name << ": " << c.message;
}

// The oracle reproduces the golden table where both have a row (1..24): both are Megatron's.
TEST(RetroDecoderLayout, OracleTableAgreesWithTheGolden) {
  const Fixture oracle = load_fixture(TWIN_RETRO_LAYOUT_1_96);
  const Fixture golden = load_fixture(golden_dir() + "/retro_decoder_layout_table.json");
  ASSERT_FALSE(golden.table["entries"].empty());
  for (const auto& g : golden.table["entries"]) {
    const int n = g["num_layers"].get<int>();
    ASSERT_GE(n, 1);
    ASSERT_LE(n, 96);
    EXPECT_EQ(oracle.table["entries"][n - 1], g) << "num_layers " << n;
  }
}

// Appending layers beyond 15 never moves an existing Retro layer; crossing 15 -> 16 does.
// The layout case: two depths a <= b (no dtype: the layout is integer bookkeeping).
struct LayoutCase : proptest::PropertyCase {
  static constexpr const char* kKind = "retro_layout";
  int a = 6, b = 6;
  template <class V>
  void fields(V& v) {
    v("a", a);
    v("b", b);
  }
};

RC_GTEST_PROP(RetroDecoderLayout, PrefixStableWithinARegime, ()) {
  const LayoutCase lc = *proptest::rerunnable<LayoutCase>(rc::gen::exec([] {
    LayoutCase c;
    c.a = *rc::gen::inRange(6, 97);
    c.b = *rc::gen::inRange(c.a, 97);
    return c;
  }));
  const int a = lc.a, b = lc.b;
  RC_PRE((a <= 15) == (b <= 15));
  const auto la = get_retro_decoder_block_layout(a), lb = get_retro_decoder_block_layout(b);
  for (int i = 0; i < a; ++i) RC_ASSERT(la[i] == lb[i]);
}

TEST(RetroDecoderLayout, FewerThanSixLayersIsAClearError) {
  for (int n = -1; n < 6; ++n) {
    const std::string m = error_of([n] { get_retro_decoder_block_layout(n); });
    EXPECT_NE(m.find("needs num_layers >= 6"), std::string::npos) << n << ": " << m;
    EXPECT_NE(m.find("num_layers=" + std::to_string(n)), std::string::npos) << m;
  }
}

TEST(RetroDecoderLayout, PipelineParallelismIsRejected) {
  TransformerConfig c;
  c.num_layers = 12;
  c.pipeline_model_parallel_size = 2;
  EXPECT_NE(
      error_of([&] { get_retro_decoder_block_layout(c); }).find("does not currently support pipeline parallelism"),
      std::string::npos);
  c.pipeline_model_parallel_size = 1;
  c.virtual_pipeline_model_parallel_size = 2;
  EXPECT_NE(error_of([&] { get_retro_decoder_block_layout(c); }).find("virtual pipeline parallelism"),
            std::string::npos);
  c.virtual_pipeline_model_parallel_size.reset();
  EXPECT_EQ(get_retro_decoder_block_layout(c).size(), 12u);
}

TEST(RetroDecoderLayout, Format) {
  const auto layout = get_retro_decoder_block_layout(9);
  const std::string text = format_retro_layout(layout);
  EXPECT_EQ(text,
            "layer 1: gpt\nlayer 2: gpt\nlayer 3: gpt\nlayer 4: gpt\nlayer 5: gpt\n"
            "layer 6: retro_with_encoder\nlayer 7: gpt\nlayer 8: gpt\nlayer 9: retro\n");
  const auto j = nlohmann::json::parse(format_retro_layout(layout, true));
  EXPECT_EQ(j["num_layers"], 9);
  EXPECT_EQ(j["layers"][5], "retro_with_encoder");
  EXPECT_EQ(j["layers"][8], "retro");
  EXPECT_EQ(j["layers"].size(), 9u);
}

TEST(RetroLayoutTable, EqualToMegatron) {
  const Fixture f = load_fixture(golden_dir() + "/retro_decoder_layout_table.json");
  ASSERT_EQ(f.kind, "retro_layout_table");
  const auto rows = compare_fixture(f, TwinKind::Reference);
  ASSERT_EQ(rows.size(), 3u);
  for (const auto& c : rows) EXPECT_TRUE(c.pass) << c.name << ": " << c.message;
  EXPECT_EQ(rows[0].shape, Shape{static_cast<std::int64_t>(f.table["entries"].size())});
}

TEST(RetroLayoutTable, HandlerDetectsAWrongLayer) {
  Fixture f = load_fixture(golden_dir() + "/retro_decoder_layout_table.json");
  for (auto& e : f.table["entries"])
    if (e["num_layers"] == 16) e["layers"][8] = "retro";  // Megatron's layer 9 owns the encoder
  const auto rows = compare_fixture(f, TwinKind::Reference);
  EXPECT_TRUE(rows[0].pass);
  EXPECT_FALSE(rows[2].pass);
  EXPECT_EQ(rows[2].mismatches, 1);
  EXPECT_NE(rows[2].message.find("num_layers=16 layer 9: twin retro_with_encoder, Megatron retro"), std::string::npos)
      << rows[2].message;
}
