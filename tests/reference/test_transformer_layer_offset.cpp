// get_transformer_layer_offset / get_num_layers_to_build: Megatron's documented examples, the
// partition property (the stages' layer ranges tile [0, num_layers) in interleaved order), the
// places Megatron raises, and the golden layer_offset_table.json through its fixture handler.
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <cstdlib>
#include <string>

#include "tests/case_id.h"
#include "fixtures/fixture.h"
#include "parity/fixture_kinds.h"
#include "reference/transformer_config.h"
#include "reference/transformer_layer_offset.h"

using namespace twin;
using namespace twin::reference;

namespace {

TransformerConfig pipeline_config(int num_layers, int pp, std::optional<int> vp = std::nullopt) {
  TransformerConfig c;
  c.hidden_size = 64;
  c.num_attention_heads = 4;
  c.num_layers = num_layers;
  c.pipeline_model_parallel_size = pp;
  c.virtual_pipeline_model_parallel_size = vp;
  return c;
}

std::string python_error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const LayerOffsetError& e) {
    return e.python_type;
  }
  return "no error";
}

}  // namespace

TEST(PyIntegerDivision, FloorsLikePython) {
  EXPECT_EQ(py_floordiv(7, 2, "b"), 3);
  EXPECT_EQ(py_floordiv(-1, 2, "b"), -1);
  EXPECT_EQ(py_floordiv(-3, 2, "b"), -2);
  EXPECT_EQ(py_floordiv(3, -2, "b"), -2);
  EXPECT_EQ(py_mod(-1, 2, "b"), 1);
  EXPECT_EQ(py_mod(-4, 3, "b"), 2);
  EXPECT_EQ(py_mod(4, -3, "b"), -2);
  EXPECT_EQ(python_error_of([] { py_floordiv(1, 0, "middle_pipeline_stages"); }), "ZeroDivisionError");
}

// transformer_block.py's comment: 8 layers, 2 stages, 4 model chunks: stage 0 builds
// [0] [2] [4] [6], stage 1 [1] [3] [5] [7]; with 2 model chunks: [0, 1] [4, 5] and [2, 3] [6, 7].
TEST(LayerOffset, MegatronInterleavedExamples) {
  const TransformerConfig four = pipeline_config(8, 2, 4);
  for (int vp = 0; vp < 4; ++vp)
    for (int pp = 0; pp < 2; ++pp) {
      EXPECT_EQ(get_transformer_layer_offset(four, vp, pp), 2 * vp + pp);
      EXPECT_EQ(get_num_layers_to_build(four, vp, pp), 1);
    }
  const TransformerConfig two = pipeline_config(8, 2, 2);
  EXPECT_EQ(get_transformer_layer_offset(two, 0, 0), 0);
  EXPECT_EQ(get_transformer_layer_offset(two, 0, 1), 2);
  EXPECT_EQ(get_transformer_layer_offset(two, 1, 0), 4);
  EXPECT_EQ(get_transformer_layer_offset(two, 1, 1), 6);
  EXPECT_EQ(get_num_layers_to_build(two, 1, 1), 2);
}

TEST(LayerOffset, NoPipelineIsZero) {
  const TransformerConfig c = pipeline_config(12, 1);
  EXPECT_EQ(get_transformer_layer_offset(c), 0);
  EXPECT_EQ(get_num_layers_to_build(c), 12);
}

TEST(LayerOffset, UnevenFirstAndLastStages) {
  TransformerConfig c = pipeline_config(10, 4);
  c.num_layers_in_first_pipeline_stage = 1;
  c.num_layers_in_last_pipeline_stage = 3;
  validate_transformer_config(c);
  // Stages: [0] [1..3] [4..6] [7..9].
  const int expected_offset[] = {0, 1, 4, 7};
  const int expected_count[] = {1, 3, 3, 3};
  for (int pp = 0; pp < 4; ++pp) {
    EXPECT_EQ(get_transformer_layer_offset(c, std::nullopt, pp), expected_offset[pp]) << "pp_rank " << pp;
    EXPECT_EQ(get_num_layers_to_build(c, std::nullopt, pp), expected_count[pp]) << "pp_rank " << pp;
  }
}

TEST(LayerOffset, EmbeddingAndLossTakeASlot) {
  TransformerConfig c = pipeline_config(6, 4);
  c.account_for_embedding_in_pipeline_split = true;
  c.account_for_loss_in_pipeline_split = true;
  validate_transformer_config(c);
  // 8 slots over 4 stages: [emb, 0] [1, 2] [3, 4] [5, loss].
  const int expected_offset[] = {0, 1, 3, 5};
  const int expected_count[] = {1, 2, 2, 1};
  for (int pp = 0; pp < 4; ++pp) {
    EXPECT_EQ(get_transformer_layer_offset(c, std::nullopt, pp), expected_offset[pp]) << "pp_rank " << pp;
    EXPECT_EQ(get_num_layers_to_build(c, std::nullopt, pp), expected_count[pp]) << "pp_rank " << pp;
  }
}

TEST(LayerOffset, RaisesWhereMegatronRaises) {
  // vp set, vp_stage missing: Megatron's assert.
  EXPECT_EQ(python_error_of([] { get_transformer_layer_offset(pipeline_config(8, 2, 2), std::nullopt, 1); }),
            "AssertionError");
  // pp = 2 with both uneven stages and vp: Megatron divides by zero middle stages.
  TransformerConfig c = pipeline_config(4, 2, 2);
  c.num_layers_in_first_pipeline_stage = 2;
  c.num_layers_in_last_pipeline_stage = 2;
  validate_transformer_config(c);
  EXPECT_EQ(get_transformer_layer_offset(c, 1, 0), 2);
  EXPECT_EQ(python_error_of([&] { get_transformer_layer_offset(c, 0, 1); }), "ZeroDivisionError");
  // Layers not divisible by stages (accepted by the config, refused when building).
  EXPECT_EQ(python_error_of([] { get_num_layers_to_build(pipeline_config(5, 2), std::nullopt, 0); }), "AssertionError");
  // vp_stage given without a virtual pipeline: is_vp_first_stage's assert.
  TransformerConfig e = pipeline_config(7, 2);
  e.account_for_embedding_in_pipeline_split = true;
  EXPECT_EQ(python_error_of([&] { get_transformer_layer_offset(e, 1, 1); }), "AssertionError");
  try {
    get_transformer_layer_offset(pipeline_config(8, 2, 2), std::nullopt, 0);
    FAIL() << "no error";
  } catch (const LayerOffsetError& err) {
    EXPECT_NE(std::string(err.what()).find("vp_stage must be provided"), std::string::npos) << err.what();
  }
}

// Valid pipeline configs built from per-chunk layer counts, so that every layer exists.
namespace {
// One pipeline split: num_layers over pp stages, vp virtual stages when interleaved, the layers
// of the first / last stage when uneven (0: not set), embedding / loss accounted as a layer. No
// dtype: this is integer bookkeeping.
struct SplitCase : proptest::PropertyCase {
  static constexpr const char* kKind = "pipeline_split";
  int layers = 1, pp = 2, vp = 1;
  bool interleaved = false;
  int first = 0, last = 0;
  bool embedding = false, loss = false;
  template <class V>
  void fields(V& v) {
    v("layers", layers);
    v("pp", pp);
    v("vp", vp);
    v("interleaved", interleaved);
    v("first", first);
    v("last", last);
    v("embedding", embedding);
    v("loss", loss);
  }
};

struct Split {
  TransformerConfig config;
  int vp_stages = 1;
};

Split to_split(const SplitCase& sc) {
  Split s;
  TransformerConfig c = pipeline_config(sc.layers, sc.pp, sc.interleaved ? std::optional<int>(sc.vp) : std::nullopt);
  if (sc.first > 0) c.num_layers_in_first_pipeline_stage = sc.first;
  if (sc.last > 0) c.num_layers_in_last_pipeline_stage = sc.last;
  c.account_for_embedding_in_pipeline_split = sc.embedding;
  c.account_for_loss_in_pipeline_split = sc.loss;
  s.config = c;
  s.vp_stages = sc.vp;
  return s;
}

rc::Gen<SplitCase> gen_split() {
  return proptest::rerunnable<SplitCase>(rc::gen::exec([] {
    SplitCase s;
    const int pp = *rc::gen::inRange(2, 9);
    const bool interleaved = *rc::gen::arbitrary<bool>();
    const int vp = interleaved ? *rc::gen::inRange(1, 5) : 1;
    const int mode = *rc::gen::element(0, 1, 2);  // 0 even, 1 uneven first / last, 2 embedding / loss
    const int chunk = *rc::gen::inRange(1, 5);
    s.pp = pp;
    s.vp = vp;
    s.interleaved = interleaved;
    s.layers = pp * vp * chunk;
    if (mode == 1) {
      const bool has_first = *rc::gen::arbitrary<bool>();
      bool has_last = !has_first || *rc::gen::arbitrary<bool>();
      // Megatron's offset divides by the (zero) middle stages there (RaisesWhereMegatronRaises).
      if (pp == 2 && has_first && interleaved) has_last = false;
      int layers = (pp - (has_first ? 1 : 0) - (has_last ? 1 : 0)) * vp * chunk;
      if (has_first) {
        s.first = vp * *rc::gen::inRange(1, 5);
        layers += s.first;
      }
      if (has_last) {
        s.last = vp * *rc::gen::inRange(1, 5);
        layers += s.last;
      }
      s.layers = layers;
    } else if (mode == 2) {
      s.embedding = *rc::gen::arbitrary<bool>();
      s.loss = !s.embedding || *rc::gen::arbitrary<bool>();
      s.layers -= (s.embedding ? 1 : 0) + (s.loss ? 1 : 0);
      if (s.layers < 1) s.layers += pp * vp;  // one more layer in every chunk
    }
    return s;
  }));
}
}  // namespace

// Model chunks in interleaved order (vp_stage major, then pp_rank) build consecutive layer
// ranges that together are exactly [0, num_layers).
RC_GTEST_PROP(LayerOffset, StagesTileTheLayersInOrder, ()) {
  const Split s = to_split(*gen_split());
  const TransformerConfig& c = s.config;
  validate_transformer_config(c);  // a valid split is accepted
  const bool interleaved = c.virtual_pipeline_model_parallel_size.has_value();
  RC_TAG(interleaved ? "interleaved" : "contiguous",
         c.num_layers_in_first_pipeline_stage || c.num_layers_in_last_pipeline_stage         ? "uneven"
         : c.account_for_embedding_in_pipeline_split || c.account_for_loss_in_pipeline_split ? "embedding/loss"
                                                                                             : "even");
  std::int64_t next = 0;
  for (int vp = 0; vp < s.vp_stages; ++vp)
    for (int pp = 0; pp < c.pipeline_model_parallel_size; ++pp) {
      const std::optional<int> vp_stage = interleaved ? std::optional<int>(vp) : std::nullopt;
      const std::int64_t offset = get_transformer_layer_offset(c, vp_stage, pp);
      const std::int64_t count = get_num_layers_to_build(c, vp_stage, pp);
      RC_ASSERT(offset == next);
      RC_ASSERT(count >= 0);
      next += count;
    }
  RC_ASSERT(next == c.num_layers);
}

// The golden table: every config_error case rejected, every other accepted, every number equal.
TEST(LayerOffsetTable, EqualToMegatron) {
  const Fixture f = load_fixture(golden_dir() + "/layer_offset_table.json");
  ASSERT_EQ(f.kind, "layer_offset_table");
  const std::vector<Comparison> rows = compare_fixture(f, TwinKind::Reference);
  ASSERT_EQ(rows.size(), 4u);
  EXPECT_EQ(rows[0].name, "config_error (rejected)");
  EXPECT_EQ(rows[0].shape, Shape{static_cast<std::int64_t>(f.table["entries"].size())});
  for (const Comparison& c : rows) EXPECT_TRUE(c.pass) << c.name << ": " << c.message;
}

// Each rejection carries Megatron's sentence (compared without whitespace: Megatron's f-strings
// drop spaces between their parts) and more context.
TEST(LayerOffsetTable, RejectionMessagesContainMegatrons) {
  const Fixture f = load_fixture(golden_dir() + "/layer_offset_table.json");
  auto squeeze = [](std::string s) {
    s.erase(std::remove_if(s.begin(), s.end(), [](unsigned char ch) { return std::isspace(ch); }), s.end());
    return s;
  };
  int rejected = 0;
  for (const auto& entry : f.table["entries"]) {
    if (entry["config_error"].is_null()) continue;
    nlohmann::json j = {{"hidden_size", 64}, {"num_attention_heads", 4}};
    j.update(entry["config"]);
    std::string megatron = entry["config_error"].get<std::string>();
    megatron = megatron.substr(megatron.find(": ") + 2);  // drop "ValueError: "
    try {
      validate_transformer_config(parse_transformer_config(j));
      ADD_FAILURE() << "accepted " << entry["config"].dump() << "; Megatron: " << megatron;
    } catch (const ConfigError& e) {
      ++rejected;
      EXPECT_NE(squeeze(e.what()).find(squeeze(megatron)), std::string::npos)
          << "twin: " << e.what() << "\nMegatron: " << megatron;
    }
  }
  EXPECT_GT(rejected, 0);
}

// The handler fails a table that disagrees, naming the row.
TEST(LayerOffsetTable, HandlerDetectsAWrongCell) {
  Fixture f = load_fixture(golden_dir() + "/layer_offset_table.json");
  auto& entries = f.table["entries"];
  std::size_t changed = entries.size();
  for (std::size_t i = 0; i < entries.size() && changed == entries.size(); ++i)
    for (auto& r : entries[i]["results"])
      if (r.contains("offset") && r["offset"].is_number_integer() && r["offset"].get<int>() > 0) {
        r["offset"] = r["offset"].get<int>() + 1;
        changed = i;
        break;
      }
  ASSERT_LT(changed, entries.size());
  entries[0]["config_error"] = "ValueError: invented";
  const std::vector<Comparison> rows = compare_fixture(f, TwinKind::Reference);
  EXPECT_FALSE(rows[0].pass);
  EXPECT_EQ(rows[0].mismatches, 1);
  EXPECT_EQ(rows[0].worst_index, 0);
  EXPECT_FALSE(rows[1].pass);
  EXPECT_EQ(rows[1].mismatches, 1);
  EXPECT_NE(rows[1].message.find("entries[" + std::to_string(changed) + "]"), std::string::npos) << rows[1].message;
  EXPECT_TRUE(rows[2].pass);
  EXPECT_TRUE(rows[3].pass);
}

TEST(LayerOffsetTable, MalformedTableIsAFixtureError) {
  Fixture f = load_fixture(golden_dir() + "/layer_offset_table.json");
  f.table["entries"][0]["results"][0]["offset"] = "three";
  EXPECT_THROW(compare_fixture(f, TwinKind::Reference), FixtureError);
  f.table.erase("entries");
  EXPECT_THROW(compare_fixture(f, TwinKind::Reference), FixtureError);
}
