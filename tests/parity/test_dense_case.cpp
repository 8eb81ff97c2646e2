// Dense-layer parity cases: canonical id round trip, strict parsing, validity of every generated
// and shrunk case, deterministic inputs.
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include "parity/dense_case.h"
#include "tests/parity/dense_case_gen.h"

using namespace twin;
using namespace twin::parity;

namespace {
const char* kId =
    "dense(h=16,a=4,g=2,d=8,ffn=32,norm=rms,act=silu,glu=1,bias=1,qkv_bias=0,rope=half,rot=0.5,qkln=0,"
    "mask=causal,s=8,b=2,dtype=bf16,tp=2,sp=1,drop=0.1,seed=7)";

std::string expect_error(const std::string& id) {
  try {
    parse_case_id(id);
  } catch (const CaseIdError& e) {
    return e.what();
  }
  ADD_FAILURE() << "no CaseIdError for " << id;
  return "";
}
std::string replace(std::string s, const std::string& from, const std::string& to) {
  const auto p = s.find(from);
  EXPECT_NE(p, std::string::npos) << from;
  return s.replace(p, from.size(), to);
}
}  // namespace

TEST(DenseCase, ParsesAndPrintsBackTheSameId) {
  const DenseCase c = parse_case_id(kId);
  EXPECT_EQ(c.hidden, 16);
  EXPECT_EQ(c.heads, 4);
  EXPECT_EQ(c.groups, 2);
  EXPECT_TRUE(c.rms);
  EXPECT_EQ(c.act, "silu");
  EXPECT_EQ(c.rope, RopeKind::Half);
  EXPECT_EQ(c.rotary_percent, 0.5);
  EXPECT_EQ(c.dtype, DType::BF16);
  EXPECT_EQ(c.tp, 2);
  EXPECT_TRUE(c.sp);
  EXPECT_EQ(c.dropout, 0.1);
  EXPECT_EQ(c.seed, 7u);
  EXPECT_EQ(to_id(c), kId);
}

TEST(DenseCase, RejectsMalformedIdsNamingTheKey) {
  EXPECT_NE(expect_error("dense(h=16)").find("missing key"), std::string::npos);
  EXPECT_NE(expect_error(replace(kId, "h=16", "h=x")).find("h=x"), std::string::npos);
  EXPECT_NE(expect_error(replace(kId, "norm=rms", "norm=bn")).find("norm=bn"), std::string::npos);
  EXPECT_NE(expect_error(replace(kId, "seed=7", "seed=7,zzz=1")).find("unknown key 'zzz'"), std::string::npos);
  EXPECT_NE(expect_error(replace(kId, "b=2", "b=2,b=3")).find("given twice"), std::string::npos);
  EXPECT_NE(expect_error("case(h=1)").find("dense("), std::string::npos);
  // Combinations Megatron rejects.
  EXPECT_NE(expect_error(replace(kId, "a=4", "a=3")).find("not divisible"), std::string::npos);
  EXPECT_NE(expect_error(replace(kId, "tp=2,sp=1", "tp=1,sp=1")).find("sequence parallelism"), std::string::npos);
  EXPECT_NE(expect_error(replace(kId, "s=8", "s=7")).find("s=7"), std::string::npos);
  EXPECT_NE(expect_error(replace(kId, "d=8", "d=6")).find("rotary dim"), std::string::npos);
}

RC_GTEST_PROP(DenseCase, IdRoundTripsForEveryGeneratedCase, ()) {
  CaseLimits lim;
  lim.allow_dropout = true;
  const DenseCase c = *gen_dense_case(lim);
  const std::string id = to_id(c);
  const DenseCase back = parse_case_id(id);
  RC_ASSERT(back == c);
  RC_ASSERT(to_id(back) == id);
}

TEST(DenseCase, EveryShrinkIsValidAndShrinkingReachesTheMinimalCase) {
  // Walk down the shrink tree as RapidCheck does for a property failing whenever heads >= 4: the
  // walk must end at a valid case that still fails and has nothing left to shrink (heads == 4,
  // the smallest s and b, the smallest hidden).
  const auto failing = [](const DenseCase& c) { return c.heads >= 4; };
  int found = 0;
  for (int seed = 0; seed < 200 && found < 5; ++seed) {
    auto shrinkable = gen_dense_case()(rc::Random(seed), 50);
    DenseCase cur = shrinkable.value();
    if (!failing(cur)) continue;
    ++found;
    bool progressed = true;
    while (progressed) {
      progressed = false;
      auto seq = shrinkable.shrinks();
      while (auto next = seq.next()) {
        const DenseCase cand = next->value();
        ASSERT_NO_THROW(validate(cand)) << to_id(cand);
        if (failing(cand)) {
          shrinkable = *next;
          cur = cand;
          progressed = true;
          break;
        }
      }
    }
    EXPECT_EQ(cur.heads, 4) << to_id(cur);
    EXPECT_EQ(cur.b, 1) << to_id(cur);
    EXPECT_EQ(cur.hidden, 8) << to_id(cur);
    EXPECT_EQ(cur.seed, 1u) << to_id(cur);
  }
  EXPECT_GT(found, 0);
}

TEST(DenseCase, InputsHaveMegatronShapesAndAreDeterministic) {
  const DenseCase c = parse_case_id(replace(replace(kId, "mask=causal", "mask=arbitrary"), "norm=rms", "norm=ln"));
  const DenseInputs a = make_inputs(c), b = make_inputs(c);
  const std::int64_t h = 16, d = 8;
  a.params.at("self_attention.linear_qkv.weight").expect({(4 + 2 * 2) * d, h}, DType::BF16, "qkv");
  a.params.at("self_attention.linear_qkv.bias").expect({(4 + 2 * 2) * d}, DType::BF16, "qkv bias");
  a.params.at("self_attention.linear_proj.weight").expect({h, 4 * d}, DType::BF16, "proj");
  a.params.at("mlp.linear_fc1.weight").expect({2 * 32, h}, DType::BF16, "fc1 (GLU: both halves)");
  a.params.at("mlp.linear_fc2.weight").expect({h, 32}, DType::BF16, "fc2");
  a.params.at("input_layernorm.bias").expect({h}, DType::BF16, "ln bias");
  EXPECT_EQ(a.params.count("self_attention.q_layernorm.weight"), 0u);
  a.hidden_states.expect({8, 2, h}, DType::BF16, "hidden");
  a.attention_mask.expect({2, 1, 8, 8}, DType::BOOL, "mask");
  a.rotary_pos_emb.expect({8, 1, 1, 4}, DType::F32, "rope (rot=0.5 of d=8)");
  // Halves layout: the second half repeats the first; position 0 has angle 0.
  const float* emb = a.rotary_pos_emb.data<float>();
  for (int p = 0; p < 8; ++p)
    for (int i = 0; i < 2; ++i) EXPECT_EQ(emb[p * 4 + i], emb[p * 4 + 2 + i]);
  EXPECT_EQ(emb[0], 0.0f);
  EXPECT_GT(emb[4], 0.0f);
  EXPECT_TRUE(a.training);
  for (const auto& [name, t] : a.params)
    EXPECT_EQ(0, std::memcmp(t.raw(), b.params.at(name).raw(), t.nbytes())) << name;
  EXPECT_EQ(0, std::memcmp(a.attention_mask.raw(), b.attention_mask.raw(), a.attention_mask.nbytes()));
  const TransformerConfig cfg = to_config(c);
  EXPECT_EQ(cfg.tensor_model_parallel_size, 2);
  EXPECT_TRUE(cfg.sequence_parallel);
  EXPECT_EQ(cfg.attn_mask_type, "arbitrary");
  EXPECT_TRUE(cfg.bf16);
}

TEST(DenseCase, InterleavedRopeRepeatsEachAngleTwice) {
  const DenseCase c = parse_case_id(replace(replace(kId, "rope=half", "rope=interleaved"), "rot=0.5", "rot=1"));
  const DenseInputs in = make_inputs(c);
  in.rotary_pos_emb.expect({8, 1, 1, 8}, DType::F32, "rope");
  const float* emb = in.rotary_pos_emb.data<float>();
  for (int p = 0; p < 8; ++p)
    for (int i = 0; i < 4; ++i) EXPECT_EQ(emb[p * 8 + 2 * i], emb[p * 8 + 2 * i + 1]);
}
