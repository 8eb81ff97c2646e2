#include "parity/dense_case.h"

#include <cmath>
#include <fmt/format.h>
#include <random>
#include <set>
#include <sstream>
#include <vector>

namespace twin::parity {

const char* mask_kind_name(MaskKind m) {
  switch (m) {
    case MaskKind::Causal: return "causal";
    case MaskKind::None: return "none";
    case MaskKind::Padding: return "padding";
    case MaskKind::Arbitrary: return "arbitrary";
  }
  return "?";
}
const char* rope_kind_name(RopeKind r) {
  switch (r) {
    case RopeKind::None: return "none";
    case RopeKind::Half: return "half";
    case RopeKind::Interleaved: return "interleaved";
  }
  return "?";
}

bool DenseCase::operator==(const DenseCase& o) const { return to_id(*this) == to_id(o); }

static const char* dtype_short(DType dt) {
  switch (dt) {
    case DType::F32: return "fp32";
    case DType::BF16: return "bf16";
    case DType::F16: return "fp16";
    default: return "?";
  }
}

std::string to_id(const DenseCase& c) {
  // fmt's "{}" prints the shortest string that parses back to the same double.
  return fmt::format(
      "dense(h={},a={},g={},d={},ffn={},norm={},act={},glu={},bias={},qkv_bias={},rope={},rot={},qkln={},"
      "mask={},s={},b={},dtype={},tp={},sp={},drop={},seed={})",
      c.hidden, c.heads, c.groups, c.kv_channels, c.ffn, c.rms ? "rms" : "ln", c.act, int(c.glu), int(c.bias),
      int(c.qkv_bias), rope_kind_name(c.rope), c.rotary_percent, int(c.qk_layernorm), mask_kind_name(c.mask), c.s,
      c.b, dtype_short(c.dtype), c.tp, int(c.sp), c.dropout, c.seed);
}

namespace {

int parse_int(const std::string& key, const std::string& v, int lo, int hi) {
  std::size_t pos = 0;
  long long x = 0;
  try {
    x = std::stoll(v, &pos);
  } catch (...) {
    pos = std::string::npos;
  }
  if (pos != v.size() || v.empty() || x < lo || x > hi)
    throw CaseIdError(fmt::format("case id: {}={} is not an integer in [{}, {}]", key, v, lo, hi));
  return static_cast<int>(x);
}
bool parse_bool(const std::string& key, const std::string& v) {
  if (v == "0") return false;
  if (v == "1") return true;
  throw CaseIdError(fmt::format("case id: {}={} must be 0 or 1", key, v));
}
double parse_double(const std::string& key, const std::string& v) {
  std::size_t pos = 0;
  double x = 0;
  try {
    x = std::stod(v, &pos);
  } catch (...) {
    pos = std::string::npos;
  }
  if (pos != v.size() || v.empty() || !std::isfinite(x)) throw CaseIdError(fmt::format("case id: {}={} is not a number", key, v));
  return x;
}

}  // namespace

DenseCase parse_case_id(const std::string& id) {
  const std::string head = "dense(";
  if (id.rfind(head, 0) != 0 || id.size() < head.size() + 1 || id.back() != ')')
    throw CaseIdError("case id must look like dense(key=value,...), got '" + id + "'");
  const std::string body = id.substr(head.size(), id.size() - head.size() - 1);
  std::map<std::string, std::string> kv;
  std::stringstream ss(body);
  std::string item;
  while (std::getline(ss, item, ',')) {
    const auto eq = item.find('=');
    if (eq == std::string::npos) throw CaseIdError("case id: item '" + item + "' has no '='");
    const std::string k = item.substr(0, eq), v = item.substr(eq + 1);
    if (!kv.emplace(k, v).second) throw CaseIdError("case id: key '" + k + "' given twice");
  }
  static const std::vector<std::string> keys = {"h",    "a",     "g",   "d",    "ffn",  "norm", "act",
                                                "glu",  "bias",  "qkv_bias", "rope", "rot", "qkln", "mask",
                                                "s",    "b",     "dtype", "tp",  "sp",   "drop", "seed"};
  for (const auto& [k, v] : kv)
    if (std::find(keys.begin(), keys.end(), k) == keys.end()) throw CaseIdError("case id: unknown key '" + k + "'");
  for (const auto& k : keys)
    if (!kv.count(k)) throw CaseIdError("case id: missing key '" + k + "'");

  DenseCase c;
  c.hidden = parse_int("h", kv["h"], 1, 1 << 20);
  c.heads = parse_int("a", kv["a"], 1, 4096);
  c.groups = parse_int("g", kv["g"], 1, 4096);
  c.kv_channels = parse_int("d", kv["d"], 1, 4096);
  c.ffn = parse_int("ffn", kv["ffn"], 1, 1 << 22);
  if (kv["norm"] != "rms" && kv["norm"] != "ln") throw CaseIdError("case id: norm=" + kv["norm"] + " must be ln or rms");
  c.rms = kv["norm"] == "rms";
  c.act = kv["act"];
  c.glu = parse_bool("glu", kv["glu"]);
  c.bias = parse_bool("bias", kv["bias"]);
  c.qkv_bias = parse_bool("qkv_bias", kv["qkv_bias"]);
  const std::string& r = kv["rope"];
  if (r == "none") c.rope = RopeKind::None;
  else if (r == "half") c.rope = RopeKind::Half;
  else if (r == "interleaved") c.rope = RopeKind::Interleaved;
  else throw CaseIdError("case id: rope=" + r + " must be none, half or interleaved");
  c.rotary_percent = parse_double("rot", kv["rot"]);
  c.qk_layernorm = parse_bool("qkln", kv["qkln"]);
  const std::string& m = kv["mask"];
  if (m == "causal") c.mask = MaskKind::Causal;
  else if (m == "none") c.mask = MaskKind::None;
  else if (m == "padding") c.mask = MaskKind::Padding;
  else if (m == "arbitrary") c.mask = MaskKind::Arbitrary;
  else throw CaseIdError("case id: mask=" + m + " must be causal, none, padding or arbitrary");
  c.s = parse_int("s", kv["s"], 1, 1 << 20);
  c.b = parse_int("b", kv["b"], 1, 1 << 16);
  const std::string& dt = kv["dtype"];
  if (dt == "fp32") c.dtype = DType::F32;
  else if (dt == "bf16") c.dtype = DType::BF16;
  else if (dt == "fp16") c.dtype = DType::F16;
  else throw CaseIdError("case id: dtype=" + dt + " must be fp32, bf16 or fp16");
  c.tp = parse_int("tp", kv["tp"], 1, 64);
  c.sp = parse_bool("sp", kv["sp"]);
  c.dropout = parse_double("drop", kv["drop"]);
  {
    const std::string& v = kv["seed"];
    std::size_t pos = 0;
    unsigned long long x = 0;
    try {
      x = std::stoull(v, &pos);
    } catch (...) {
      pos = std::string::npos;
    }
    if (pos != v.size() || v.empty() || v[0] == '-') throw CaseIdError("case id: seed=" + v + " is not an unsigned integer");
    c.seed = x;
  }
  validate(c);
  return c;
}

void validate(const DenseCase& c) {
  auto fail = [&](const std::string& what) { throw CaseIdError("case " + to_id(c) + ": " + what); };
  if (c.heads % c.groups) fail(fmt::format("heads a={} not divisible by query groups g={}", c.heads, c.groups));
  if (c.heads % c.tp) fail(fmt::format("heads a={} not divisible by tp={}", c.heads, c.tp));
  if (c.groups % c.tp) fail(fmt::format("query groups g={} not divisible by tp={}", c.groups, c.tp));
  if (c.ffn % c.tp) fail(fmt::format("ffn={} not divisible by tp={}", c.ffn, c.tp));
  if (c.sp && c.tp == 1) fail("sequence parallelism needs tp > 1 (Megatron rejects it)");
  if (c.sp && c.s % c.tp) fail(fmt::format("s={} not divisible by tp={} with sequence parallelism", c.s, c.tp));
  if (c.act != "gelu" && c.act != "silu" && c.act != "relu") fail("act=" + c.act + " must be gelu, silu or relu");
  if (!(c.rotary_percent > 0.0 && c.rotary_percent <= 1.0)) fail("rot must be in (0, 1]");
  if (c.rope != RopeKind::None) {
    const int rot = c.rotary_percent < 1.0 ? int(c.kv_channels * c.rotary_percent) : c.kv_channels;
    if (rot <= 0 || rot % 2) fail(fmt::format("rotary dim {} (d={} x rot={}) must be even and > 0", rot, c.kv_channels, c.rotary_percent));
  }
  if (c.dtype != DType::F32 && c.dtype != DType::BF16 && c.dtype != DType::F16) fail("dtype must be fp32, bf16 or fp16");
  if (!(c.dropout >= 0.0 && c.dropout < 1.0)) fail("drop must be in [0, 1)");
}

TransformerConfig to_config(const DenseCase& c) {
  validate(c);
  TransformerConfig cfg;
  cfg.num_layers = 1;
  cfg.hidden_size = c.hidden;
  cfg.num_attention_heads = c.heads;
  cfg.num_query_groups = c.groups;
  cfg.kv_channels = c.kv_channels;
  cfg.ffn_hidden_size = c.ffn;
  cfg.params_dtype = c.dtype == DType::F32 ? "float32" : c.dtype == DType::BF16 ? "bfloat16" : "float16";
  cfg.bf16 = c.dtype == DType::BF16;
  cfg.fp16 = c.dtype == DType::F16;
  cfg.normalization = c.rms ? "RMSNorm" : "LayerNorm";
  cfg.qk_layernorm = c.qk_layernorm;
  cfg.activation_func = c.act;
  cfg.gated_linear_unit = c.glu;
  cfg.add_bias_linear = c.bias;
  cfg.add_qkv_bias = c.qkv_bias;
  cfg.hidden_dropout = c.dropout;
  cfg.attention_dropout = c.dropout;
  cfg.position_embedding_type = c.rope == RopeKind::None ? "none" : "rope";
  cfg.rotary_interleaved = c.rope == RopeKind::Interleaved;
  cfg.rotary_percent = c.rotary_percent;
  cfg.tensor_model_parallel_size = c.tp;
  cfg.sequence_parallel = c.sp;
  cfg.seq_length = c.s;
  cfg.micro_batch_size = c.b;
  switch (c.mask) {
    case MaskKind::Causal: cfg.attn_mask_type = "causal"; break;
    case MaskKind::None: cfg.attn_mask_type = "no_mask"; break;
    case MaskKind::Padding: cfg.attn_mask_type = "padding"; break;
    case MaskKind::Arbitrary: cfg.attn_mask_type = "arbitrary"; break;
  }
  return cfg;
}

DenseInputs make_inputs(const DenseCase& c) {
  DenseInputs in;
  in.config = to_config(c);
  in.training = c.dropout > 0.0;
  in.dropout_seed = c.seed;
  // One stream per tensor (seeded by the case seed and the tensor's ordinal), so adding a tensor
  // to one configuration does not change the values of the others.
  int ordinal = 0;
  auto rng_for = [&]() { return std::mt19937_64(c.seed * 0x9E3779B97F4A7C15ull + static_cast<std::uint64_t>(++ordinal)); };
  auto uniform = [&](Shape shape, double lo, double hi) {
    auto rng = rng_for();
    std::uniform_real_distribution<double> u(lo, hi);
    std::vector<double> v(static_cast<std::size_t>(shape_numel(shape)));
    for (auto& x : v) x = u(rng);
    return Tensor::from_doubles(c.dtype, std::move(shape), v);
  };
  const std::int64_t h = c.hidden, d = c.kv_channels, np = c.heads, ng = c.groups;
  // Linear weights ~ U(-a, a) with a = sqrt(3 / fan_in): unit-variance outputs for unit inputs.
  auto linear = [&](const std::string& name, std::int64_t out, std::int64_t in_features, bool bias) {
    const double a = std::sqrt(3.0 / double(in_features));
    in.params[name + ".weight"] = uniform({out, in_features}, -a, a);
    if (bias) in.params[name + ".bias"] = uniform({out}, -0.1, 0.1);
  };
  auto norm = [&](const std::string& name, std::int64_t n) {
    in.params[name + ".weight"] = uniform({n}, 0.8, 1.2);
    if (!c.rms) in.params[name + ".bias"] = uniform({n}, -0.1, 0.1);
  };
  norm("input_layernorm", h);
  linear("self_attention.linear_qkv", (np + 2 * ng) * d, h, c.bias || c.qkv_bias);
  if (c.qk_layernorm) {
    norm("self_attention.q_layernorm", d);
    norm("self_attention.k_layernorm", d);
  }
  linear("self_attention.linear_proj", h, np * d, c.bias);
  norm("pre_mlp_layernorm", h);
  linear("mlp.linear_fc1", c.glu ? 2 * c.ffn : c.ffn, h, c.bias);
  linear("mlp.linear_fc2", h, c.ffn, c.bias);

  in.hidden_states = uniform({c.s, c.b, h}, -1.7, 1.7);  // ~unit variance

  if (c.mask == MaskKind::Padding || c.mask == MaskKind::Arbitrary) {
    auto rng = rng_for();
    std::vector<bool> m(static_cast<std::size_t>(c.b * c.s * c.s));
    for (int bi = 0; bi < c.b; ++bi) {
      // Padding: keys at positions >= len are masked for every query (len in [1, s]).
      const int len = 1 + static_cast<int>(rng() % static_cast<std::uint64_t>(c.s));
      for (int i = 0; i < c.s; ++i)
        for (int j = 0; j < c.s; ++j) {
          const std::size_t k = (static_cast<std::size_t>(bi) * c.s + i) * c.s + j;
          m[k] = c.mask == MaskKind::Padding ? (j >= len) : (rng() % 10 < 3);  // arbitrary: 30% masked
        }
    }
    in.attention_mask = Tensor::from_vector<bool>({c.b, 1, c.s, c.s}, m);
  }

  if (c.rope != RopeKind::None) {
    // RotaryEmbedding.get_emb: inv_freq = 1 / base^(arange(0, dim, 2) / dim) in fp32, freqs =
    // outer(arange(s), inv_freq); halves: cat(freqs, freqs); interleaved: each freq twice in a row.
    const int dim = c.rotary_percent < 1.0 ? int(c.kv_channels * c.rotary_percent) : c.kv_channels;
    std::vector<float> inv(static_cast<std::size_t>(dim / 2));
    for (int i = 0; i < dim / 2; ++i)
      inv[i] = 1.0f / std::pow(10000.0f, static_cast<float>(2 * i) / static_cast<float>(dim));
    std::vector<float> emb(static_cast<std::size_t>(c.s) * dim);
    for (int p = 0; p < c.s; ++p)
      for (int i = 0; i < dim / 2; ++i) {
        const float f = static_cast<float>(p) * inv[i];
        if (c.rope == RopeKind::Half) {
          emb[p * dim + i] = f;
          emb[p * dim + dim / 2 + i] = f;
        } else {
          emb[p * dim + 2 * i] = f;
          emb[p * dim + 2 * i + 1] = f;
        }
      }
    in.rotary_pos_emb = Tensor::from_vector<float>({c.s, 1, 1, dim}, emb);
  }
  return in;
}

rc::Gen<DenseCase> gen_dense_case(CaseLimits lim) {
  return rc::gen::exec([lim]() {
    DenseCase c;
    // Draw the independent choices; derived sizes keep every divisibility Megatron requires, so
    // each shrink step is a valid case too.
    std::vector<int> tps = {1};
    if (lim.max_tp >= 2) tps.push_back(2);
    if (lim.max_tp >= 4) tps.push_back(4);
    c.tp = lim.force_tp ? lim.tp : *rc::gen::elementOf(tps);
    c.sp = c.tp > 1 && *rc::gen::arbitrary<bool>();
    const int groups_per_rank = *rc::gen::inRange(1, lim.max_groups_per_rank + 1);
    const int heads_per_group = *rc::gen::inRange(1, lim.max_heads_per_group + 1);
    c.groups = c.tp * groups_per_rank;
    c.heads = c.groups * heads_per_group;
    c.kv_channels = *rc::gen::element(4, 8, 16);
    c.hidden = 8 * *rc::gen::inRange(1, 5);
    c.ffn = c.tp * 4 * *rc::gen::inRange(1, 5);
    c.rms = *rc::gen::arbitrary<bool>();
    c.act = *rc::gen::element(std::string("gelu"), std::string("silu"), std::string("relu"));
    c.glu = *rc::gen::arbitrary<bool>();
    c.bias = !*rc::gen::arbitrary<bool>();  // shrinks toward bias = true, the common Megatron case
    c.qkv_bias = *rc::gen::arbitrary<bool>();
    c.rope = *rc::gen::element(RopeKind::None, RopeKind::Half, RopeKind::Interleaved);
    c.rotary_percent = *rc::gen::element(1.0, 0.5);
    c.qk_layernorm = *rc::gen::arbitrary<bool>();
    c.mask = *rc::gen::element(MaskKind::Causal, MaskKind::None, MaskKind::Padding, MaskKind::Arbitrary);
    const int s_per_rank = *rc::gen::inRange(1, lim.max_s_per_rank + 1);
    c.s = c.sp ? c.tp * s_per_rank : s_per_rank + *rc::gen::inRange(0, 3);
    c.b = *rc::gen::inRange(1, lim.max_b + 1);
    c.dtype = lim.any_dtype ? *rc::gen::element(DType::F32, DType::BF16, DType::F16) : lim.dtype;
    c.dropout = lim.allow_dropout ? *rc::gen::element(0.0, 0.1, 0.5) : 0.0;
    c.seed = *rc::gen::inRange<std::uint64_t>(1, 1000000);
    validate(c);
    return c;
  });
}

}  // namespace twin::parity
