// Dense-layer parity cases: canonical id round trip, strict parsing with one message per field
// (naming the field, the bad value and the allowed values), validity of every generated and shrunk
// case, deterministic inputs, RoPE angles against Megatron's formula.
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <set>

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
// The id with `key`'s value replaced by `value` (the key found as a whole item, not a suffix).
std::string with_value(std::string id, const std::string& key, const std::string& value) {
  for (const char* before : {"(", ","}) {
    const auto p = id.find(before + key + "=");
    if (p == std::string::npos) continue;
    const auto start = p + 1 + key.size() + 1;
    const auto end = id.find_first_of(",)", start);
    return id.replace(start, end - start, value);
  }
  ADD_FAILURE() << "no key " << key << " in " << id;
  return id;
}
bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }
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

// One bad value per field: the message names the field (key and Megatron name), the value and
// the allowed values. Every field of the table has a row here, so a new field comes with its test.
TEST(DenseCase, EachFieldRejectsABadValueNamingTheFieldAndTheAllowedValues) {
  const std::map<std::string, std::pair<std::string, std::string>> bad = {
      // key: {bad value, allowed values as the message writes them}
      {"h", {"0", "an integer in [1, 1048576]"}},
      {"a", {"x", "an integer in [1, 4096]"}},
      {"g", {"-1", "an integer in [1, 4096]"}},
      {"d", {"4097", "an integer in [1, 4096]"}},
      {"ffn", {"1.5", "an integer in [1, 4194304]"}},
      {"norm", {"bn", "one of ln, rms"}},
      {"act", {"swish", "one of gelu, silu, relu"}},
      {"glu", {"2", "one of 0, 1"}},
      {"bias", {"yes", "one of 0, 1"}},
      {"qkv_bias", {"-1", "one of 0, 1"}},
      {"rope", {"full", "one of none, half, interleaved"}},
      {"rot", {"0", "a number in (0, 1]"}},
      {"qkln", {"true", "one of 0, 1"}},
      {"mask", {"padding_causal", "one of causal, none, padding, arbitrary"}},
      {"layer", {"0", "an integer in [1, 4096]"}},
      {"qkls", {"yes", "one of 0, 1"}},
      {"s", {"+8", "an integer in [1, 1048576]"}},
      {"b", {"65537", "an integer in [1, 65536]"}},
      {"dtype", {"fp8", "one of fp32, bf16, fp16"}},
      {"tp", {"65", "an integer in [1, 64]"}},
      {"sp", {"", "one of 0, 1"}},
      {"drop", {"1", "a number in [0, 1)"}},
      {"seed", {"18446744073709551616", "an integer in [0, 18446744073709551615]"}},
  };
  std::set<std::string> keys;
  for (const auto& f : dense_case_fields()) {
    keys.insert(f.key);
    ASSERT_TRUE(bad.count(f.key)) << "no bad value for field " << f.key;
    const auto& [value, allowed] = bad.at(f.key);
    EXPECT_EQ(f.allowed, allowed) << f.key;
    const std::string msg =
        expect_error(with_value(replace(kId, "mask=causal,", "mask=causal,layer=2,qkls=1,"), f.key, value));
    EXPECT_TRUE(contains(msg, f.key + "=" + value + ":")) << msg;
    EXPECT_TRUE(contains(msg, f.key + " (" + f.megatron + ") must be " + allowed)) << msg;
  }
  EXPECT_EQ(keys.size(), bad.size());
}

// A case built in code (not parsed) is checked against the same table.
TEST(DenseCase, ValidateChecksFieldsOfACaseBuiltInCode) {
  DenseCase c;
  validate(c);
  c.act = "swish";
  try {
    validate(c);
    ADD_FAILURE() << "act=swish accepted";
  } catch (const CaseIdError& e) {
    EXPECT_TRUE(contains(e.what(), "act=swish: act (activation_func) must be one of gelu, silu, relu")) << e.what();
  }
  c = DenseCase{};
  c.dtype = DType::F64;
  try {
    validate(c);
    ADD_FAILURE() << "dtype F64 accepted";
  } catch (const CaseIdError& e) {
    EXPECT_TRUE(contains(e.what(), "dtype=F64: dtype (params_dtype) must be one of fp32, bf16, fp16")) << e.what();
  }
  c = DenseCase{};
  c.rotary_percent = std::numeric_limits<double>::quiet_NaN();
  EXPECT_THROW(validate(c), CaseIdError);
}

TEST(DenseCase, ValuesAtTheEdgesRoundTrip) {
  // The largest seed, reals printed as the shortest text that reads back to the same double.
  for (const auto& [key, value] : std::vector<std::pair<std::string, std::string>>{
           {"seed", "18446744073709551615"}, {"seed", "0"}, {"rot", "0.3"}, {"drop", "0.999"}, {"drop", "1e-05"}}) {
    const std::string id = with_value(kId, key, value);
    EXPECT_EQ(to_id(parse_case_id(id)), id);
  }
  // Keys in any order parse to the same case; the printed id is in table order.
  const std::string shuffled =
      "dense(seed=7,drop=0.1,sp=1,tp=2,dtype=bf16,b=2,s=8,mask=causal,qkln=0,rot=0.5,rope=half,"
      "qkv_bias=0,bias=1,glu=1,act=silu,norm=rms,ffn=32,d=8,g=2,a=4,h=16)";
  EXPECT_EQ(to_id(parse_case_id(shuffled)), kId);
  // Syntax a canonical id never has.
  EXPECT_TRUE(contains(expect_error(replace(kId, "seed=7)", "seed=7,)")), "has no '='"));
  EXPECT_TRUE(contains(expect_error(replace(kId, "h=16", "h= 16")), "h= 16"));
}

// layer and qkls came after ids were written down: an id without them is the layer-1 unscaled
// case and prints back unchanged; set, they print in table order (after mask) and round-trip; they
// are never given twice (bad values: EachFieldRejectsABadValueNamingTheFieldAndTheAllowedValues).
TEST(DenseCase, LayerNumberAndQueryKeyLayerScalingAreOptionalKeys) {
  const DenseCase old = parse_case_id(kId);
  EXPECT_EQ(old.layer, 1);
  EXPECT_FALSE(old.qk_layer_scaling);
  const std::string scaled = replace(kId, "mask=causal,", "mask=causal,layer=3,qkls=1,");
  const DenseCase c = parse_case_id(scaled);
  EXPECT_EQ(c.layer, 3);
  EXPECT_TRUE(c.qk_layer_scaling);
  EXPECT_EQ(to_id(c), scaled);
  EXPECT_TRUE(to_config(c).apply_query_key_layer_scaling);
  EXPECT_EQ(make_inputs(c).layer_number, 3);
  EXPECT_EQ(to_id(parse_case_id(replace(kId, "seed=7)", "seed=7,qkls=0,layer=1)"))), kId);
  EXPECT_TRUE(contains(expect_error(replace(scaled, "seed=7)", "seed=7,layer=2)")), "given twice"));
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

// Every generated case validates, under any limits, and every field with samples in the table
// takes one of them (the generator's domain is the table's).
RC_GTEST_PROP(DenseCase, GeneratedCasesValidateAndDrawFromTheTable, ()) {
  CaseLimits lim;
  lim.max_tp = *rc::gen::element(1, 2, 4);
  lim.max_groups_per_rank = *rc::gen::inRange(1, 4);
  lim.max_heads_per_group = *rc::gen::inRange(1, 4);
  lim.max_s_per_rank = *rc::gen::inRange(1, 6);
  lim.max_b = *rc::gen::inRange(1, 4);
  lim.allow_dropout = *rc::gen::arbitrary<bool>();
  const DenseCase c = *gen_dense_case(lim);
  validate(c);
  RC_ASSERT(c.tp <= lim.max_tp);
  RC_ASSERT(c.b <= lim.max_b);
  for (const auto& f : dense_case_fields()) {
    if (f.samples.empty()) continue;
    const std::string v = f.print(c);
    RC_ASSERT(std::find(f.samples.begin(), f.samples.end(), v) != f.samples.end());
  }
  if (!lim.allow_dropout) RC_ASSERT(c.dropout == 0.0);
}

TEST(DenseCase, EveryShrinkIsValidAndShrinkingReachesTheMinimalCase) {
  // Walk down the shrink tree as RapidCheck does for a property failing whenever heads >= 4: the
  // walk must end at a valid case that still fails and has nothing left to shrink (heads == 4,
  // the smallest s and b, the first sample of every field the table gives samples for).
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
    // Every field drawn from the table's samples ends at its first (tp may have to stay above 1
    // to keep heads at 4).
    for (const auto& f : dense_case_fields()) {
      if (!f.samples.empty() && f.key != "tp") {
        EXPECT_EQ(f.print(cur), f.samples.front()) << f.key << " in " << to_id(cur);
      }
    }
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

namespace {
// Megatron's RotaryEmbedding (megatron/core/models/common/embeddings/rotary_pos_embedding.py),
// written out in double: inv_freq = 1 / base^(arange(0, dim, 2) / dim), freqs = outer(arange(s),
// inv_freq); get_emb: cat((freqs, freqs), -1) for halves, stack((freqs, freqs), -1).view(s, -1)
// (each angle twice in a row) when rotary_interleaved. dim = int(kv_channels * rotary_percent)
// when rotary_percent < 1.
std::vector<double> megatron_rope_emb(int s, int kv_channels, double rotary_percent, bool interleaved, double base) {
  const int dim = rotary_percent < 1.0 ? static_cast<int>(kv_channels * rotary_percent) : kv_channels;
  std::vector<double> inv_freq;
  for (int k = 0; k < dim; k += 2) inv_freq.push_back(1.0 / std::pow(base, double(k) / double(dim)));
  const int n = static_cast<int>(inv_freq.size());
  std::vector<double> emb;
  for (int p = 0; p < s; ++p)
    for (int j = 0; j < 2 * n; ++j) emb.push_back(double(p) * inv_freq[interleaved ? j / 2 : j % n]);
  return emb;
}
}  // namespace

// The inputs' RoPE angles are Megatron's within fp32 rounding. Megatron computes in fp32: the
// exponent k / dim (one rounding, which base^e amplifies by ln(base)), the power, the reciprocal
// and the product by the position (one rounding each): |got - exact| <= (3 + ln(base)) u |exact|
// to first order, u = 2^-24; twice that leaves room for the power's own last-bit error.
TEST(DenseCase, RopeAnglesMatchMegatronsFormulaInDouble) {
  const double u = std::ldexp(1.0, -24);
  int checked = 0;
  for (const char* rope : {"half", "interleaved"})
    for (const auto& [d, rot] :
         std::vector<std::pair<int, std::string>>{{8, "1"}, {8, "0.5"}, {16, "1"}, {12, "0.5"}, {64, "0.25"}}) {
      std::string id = with_value(with_value(with_value(kId, "rope", rope), "d", std::to_string(d)), "rot", rot);
      id = with_value(with_value(with_value(id, "s", "40"), "tp", "1"), "sp", "0");
      const DenseCase c = parse_case_id(id);
      const DenseInputs in = make_inputs(c);
      const double base = in.config.rotary_base;
      ASSERT_EQ(base, 10000.0);
      const std::vector<double> want =
          megatron_rope_emb(c.s, c.kv_channels, c.rotary_percent, c.rope == RopeKind::Interleaved, base);
      const std::int64_t dim = static_cast<std::int64_t>(want.size()) / c.s;
      EXPECT_EQ(dim, rotary_dim(c)) << id;
      in.rotary_pos_emb.expect({c.s, 1, 1, dim}, DType::F32, "rotary_pos_emb");
      const float* got = in.rotary_pos_emb.data<float>();
      const double rel = 2.0 * (3.0 + std::log(base)) * u;
      for (std::size_t i = 0; i < want.size(); ++i)
        ASSERT_LE(std::fabs(got[i] - want[i]), rel * std::fabs(want[i]))
            << id << " position " << i / dim << " channel " << i % dim << ": " << got[i] << " vs " << want[i];
      ++checked;
    }
  EXPECT_EQ(checked, 10);
}

TEST(DenseCase, NoRopeTableWithoutRope) {
  EXPECT_FALSE(make_inputs(parse_case_id(with_value(kId, "rope", "none"))).rotary_pos_emb.defined());
}
