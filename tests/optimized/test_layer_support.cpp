// The feature table (optimized/layer/features.h) asked for every layer kind and every feature: each
// row's example config asks for the feature; a kind that implements it does not refuse it, a kind
// that does not refuses it with the table's words, and the twin itself (the dense and MoE
// constructors, the MoE and Retro golden handlers) reports that same refusal before running. A
// feature a kind forgets to refuse (computed as if it were off) fails here.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <set>
#include <string>
#include <vector>

#include "optimized/layer/features.h"
#include "optimized/moe/moe_transformer_layer.h"
#include "optimized/retro/retro_layer.h"
#include "optimized/transformer_layer.h"
#include "parity/dense_case.h"
#include "parity/fixture_kinds.h"

using namespace twin;
using opt::LayerFeature;
using opt::LayerKind;

namespace {

// A supported config of the kind: the dense layer of a case with GLU (so glu_linear_offset would
// change its result), a MoE golden, a Retro golden. Retro takes its layout from the config alone.
struct KindBase {
  TransformerConfig config;
  std::map<std::string, Tensor> params;
  Fixture fixture;  // MoE and Retro: the golden the handler runs
};

KindBase base_of(LayerKind kind) {
  KindBase b;
  if (kind == LayerKind::Dense) {
    const parity::DenseInputs in = parity::make_inputs(parity::parse_case_id(
        "dense(h=16,a=4,g=2,d=8,ffn=32,norm=rms,act=silu,glu=1,bias=1,qkv_bias=0,rope=none,rot=1,qkln=0,mask=causal,"
        "s=4,b=1,dtype=bf16,tp=1,sp=0,drop=0,seed=3)"));
    b.config = in.config;
    b.params = in.params;
    return b;
  }
  b.fixture = load_fixture(golden_dir() + (kind == LayerKind::MoE ? "/moe_top2_aux_allgather.safetensors"
                                                                  : "/retro_later_layer_divisible.safetensors"));
  b.config = b.fixture.config;
  b.params = parity::params_of(b.fixture);
  return b;
}

// The message of the exception of type E that f throws ("" when none).
template <class E, class F>
std::string refusal_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  return "";
}

// What the twin of `kind` says when built from (or run on) the config: each channel's refusal (the
// constructor's ConfigError, the golden handler's FixtureUnsupported), "" for a channel that runs.
std::vector<std::string> twin_refusals(LayerKind kind, const KindBase& b, const TransformerConfig& c,
                                       const opt::LayerOptions& o) {
  Fixture f = b.fixture;
  f.config = c;
  RunMode mode;  // the golden's own layout, as `twin fixture` runs it by default
  mode.tp = o.tp;
  mode.sp = o.sp;
  mode.ep = c.expert_model_parallel_size;
  switch (kind) {
    case LayerKind::Dense:
      return {refusal_of<ConfigError>([&] { opt::DenseTransformerLayer(c, b.params, o); })};
    case LayerKind::MoE: {
      // The handler takes its backend from TWIN_BACKEND, as `twin fixture` runs it.
      if (o.backend == rt::Backend::Cuda) setenv("TWIN_BACKEND", "cuda", 1);
      const std::string handled = refusal_of<FixtureUnsupported>([&] { parity::run_optimized_moe_layer(f, mode); });
      unsetenv("TWIN_BACKEND");
      return {refusal_of<ConfigError>([&] { opt::MoETransformerLayer(c, b.params, o); }), handled};
    }
    case LayerKind::Retro:
      return {refusal_of<FixtureUnsupported>([&] { parity::run_optimized_retro_decoder_layer(f, RunMode{}); })};
  }
  return {};
}

}  // namespace

TEST(OptimizedLayerSupport, EveryKindAnswersEveryFeatureWithTheTablesWords) {
  std::set<std::string> asked;  // rows some kind's example asks for
  int refused = 0, implemented = 0;
  for (LayerKind kind : opt::all_layer_kinds()) {
    const KindBase b = base_of(kind);
    ASSERT_EQ(opt::layer_unsupported(kind, b.config), "") << opt::layer_kind_name(kind);
    for (const LayerFeature& row : opt::layer_features()) {
      SCOPED_TRACE(std::string(opt::layer_kind_name(kind)) + ": " + row.name);
      TransformerConfig c = b.config;
      opt::LayerOptions o;
      row.example(c, o);
      if (kind == LayerKind::Retro) o = {};  // the Retro twin reads its layout from the config
      if (!row.requested(c, o)) continue;    // a feature of another kind (the router's, in a dense config)
      asked.insert(row.name + " / " + row.reason);
      // The refusals the example may meet: this row's, or another row the same edit asks for
      // (sequence parallelism asks for tensor parallelism too).
      std::set<std::string> refusals;
      for (const LayerFeature& other : opt::layer_features())
        if (!other.supported(kind) && other.requested(c, o) && !other.requested(b.config, {}))
          refusals.insert(other.refusal());
      const std::string why = opt::layer_unsupported(kind, c, o);
      if (row.supported(kind)) {
        EXPECT_NE(why, row.refusal());
        ++implemented;
        continue;
      }
      ++refused;
      EXPECT_TRUE(refusals.count(why)) << "the table answers '" << why << "'";
      if (why.empty()) continue;
      for (const std::string& said : twin_refusals(kind, b, c, o))
        EXPECT_NE(said.find(why), std::string::npos) << "the twin says '" << said << "', the table '" << why << "'";
    }
  }
  // Every row is asked for by some kind's example (no predicate that never fires).
  EXPECT_EQ(asked.size(), opt::layer_features().size());
  std::printf("%d (kind, feature) pairs refused, %d implemented, of %zu features\n", refused, implemented,
              opt::layer_features().size());
}

// The refusals of the features no kind implements name them: glu_linear_offset, the activation
// clamp, the attention output gate reach every kind's twin as the same words.
TEST(OptimizedLayerSupport, FeaturesNoKindImplementsAreRefusedByEveryKind) {
  int none = 0;
  for (const LayerFeature& row : opt::layer_features())
    if (row.supported_by.empty()) ++none;
  EXPECT_GE(none, 8);
  for (const char* name : {"glu_linear_offset", "activation_func_clamp_value", "attention_output_gate", "qk_l2_norm",
                           "bias_activation_fusion", "window_size", "softmax_type", "context_parallel_size > 1"}) {
    bool found = false;
    for (const LayerFeature& row : opt::layer_features())
      if (row.name == name) {
        found = true;
        EXPECT_TRUE(row.supported_by.empty()) << name;
      }
    EXPECT_TRUE(found) << name;
  }
}
