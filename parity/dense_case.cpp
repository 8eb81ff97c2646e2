#include "parity/dense_case.h"

#include <cmath>
#include <cstdint>
#include <fmt/format.h>
#include <random>
#include <utility>
#include <vector>

#include "reference/rotary_pos_embedding.h"

namespace twin::parity {

namespace {
// The spellings of the enum-valued fields: the id's values and the *_name functions. Function-local
// statics, so a parse during another file's static initialisation finds them built.
const std::vector<std::pair<MaskKind, std::string>>& mask_spellings() {
  static const std::vector<std::pair<MaskKind, std::string>> s = {{MaskKind::Causal, "causal"},
                                                                  {MaskKind::None, "none"},
                                                                  {MaskKind::Padding, "padding"},
                                                                  {MaskKind::Arbitrary, "arbitrary"}};
  return s;
}
const std::vector<std::pair<RopeKind, std::string>>& rope_spellings() {
  static const std::vector<std::pair<RopeKind, std::string>> s = {
      {RopeKind::None, "none"}, {RopeKind::Half, "half"}, {RopeKind::Interleaved, "interleaved"}};
  return s;
}

template <class T>
const char* spelling(const std::vector<std::pair<T, std::string>>& spellings, T v) {
  for (const auto& [value, text] : spellings)
    if (value == v) return text.c_str();
  return "?";
}
}  // namespace

const char* mask_kind_name(MaskKind m) { return spelling(mask_spellings(), m); }
const char* rope_kind_name(RopeKind r) { return spelling(rope_spellings(), r); }

bool DenseCase::operator==(const DenseCase& o) const { return to_id(*this) == to_id(o); }

const std::vector<CaseField<DenseCase>>& dense_case_fields() {
  using C = DenseCase;
  // Id order. Integer bounds are sanity limits of the id, not Megatron's; samples are what the
  // property-test generator draws (fields without samples it derives, so that every size divides
  // by tp as Megatron requires). The first sample is the simplest, the one RapidCheck shrinks to.
  static const std::vector<CaseField<C>> fields = {
      int_field("h", "hidden_size", &C::hidden, 1, 1 << 20, {8, 16, 24, 32}),
      int_field("a", "num_attention_heads", &C::heads, 1, 4096),
      int_field("g", "num_query_groups", &C::groups, 1, 4096),
      int_field("d", "kv_channels", &C::kv_channels, 1, 4096, {4, 8, 16}),
      int_field("ffn", "ffn_hidden_size", &C::ffn, 1, 1 << 22),
      choice_field<C, bool>("norm", "normalization", &C::rms, {{false, "ln"}, {true, "rms"}}),
      choice_field<C, std::string>("act", "activation_func", &C::act,
                                   {{"gelu", "gelu"}, {"silu", "silu"}, {"relu", "relu"}}),
      bool_field<C>("glu", "gated_linear_unit", &C::glu),
      bool_field<C>("bias", "add_bias_linear", &C::bias, /*first=*/true),  // the common Megatron case first
      bool_field<C>("qkv_bias", "add_qkv_bias", &C::qkv_bias),
      choice_field<C, RopeKind>("rope", "position_embedding_type=rope, rotary_interleaved", &C::rope, rope_spellings()),
      real_field<C>("rot", "rotary_percent", &C::rotary_percent, {0.0, 1.0, true, false}, {1.0, 0.5}),
      bool_field<C>("qkln", "qk_layernorm", &C::qk_layernorm),
      choice_field<C, MaskKind>("mask", "attn_mask_type", &C::mask, mask_spellings()),
      optional_field(int_field("layer", "layer_number", &C::layer, 1, 4096, {1, 2, 3})),
      optional_field(bool_field<C>("qkls", "apply_query_key_layer_scaling", &C::qk_layer_scaling)),
      int_field("s", "seq_length", &C::s, 1, 1 << 20),
      int_field("b", "micro_batch_size", &C::b, 1, 1 << 16),
      choice_field<C, DType>("dtype", "params_dtype", &C::dtype,
                             {{DType::F32, "fp32"}, {DType::BF16, "bf16"}, {DType::F16, "fp16"}}),
      int_field("tp", "tensor_model_parallel_size", &C::tp, 1, 64, {1, 2, 4}),
      bool_field<C>("sp", "sequence_parallel", &C::sp),
      real_field<C>("drop", "hidden_dropout and attention_dropout", &C::dropout, {0.0, 1.0, false, true},
                    {0.0, 0.1, 0.5}),
      int_field<C, std::uint64_t>("seed", "data and dropout seed", &C::seed, 0, UINT64_MAX),
  };
  return fields;
}

std::string to_id(const DenseCase& c) { return format_case_id("dense", c, dense_case_fields()); }

DenseCase parse_case_id(const std::string& id) {
  const DenseCase c = parse_case_fields<DenseCase>("dense", id, dense_case_fields());
  validate(c);
  return c;
}

int rotary_dim(const DenseCase& c) { return reference::RotaryEmbedding(c.kv_channels, c.rotary_percent).dim(); }

void validate(const DenseCase& c) {
  auto fail = [&](const std::string& what) { throw CaseIdError("case " + to_id(c) + ": " + what); };
  if (const std::string e = first_field_error(c, dense_case_fields()); !e.empty()) fail(e);
  if (c.heads % c.groups) fail(fmt::format("heads a={} not divisible by query groups g={}", c.heads, c.groups));
  if (c.heads % c.tp) fail(fmt::format("heads a={} not divisible by tp={}", c.heads, c.tp));
  if (c.groups % c.tp) fail(fmt::format("query groups g={} not divisible by tp={}", c.groups, c.tp));
  if (c.ffn % c.tp) fail(fmt::format("ffn={} not divisible by tp={}", c.ffn, c.tp));
  if (c.sp && c.tp == 1) fail("sequence parallelism needs tp > 1 (Megatron rejects it)");
  if (c.sp && c.s % c.tp) fail(fmt::format("s={} not divisible by tp={} with sequence parallelism", c.s, c.tp));
  if (c.rope != RopeKind::None) {
    const int rot = rotary_dim(c);
    if (rot <= 0 || rot % 2)
      fail(fmt::format("rotary dim {} (d={} x rot={}) must be even and > 0", rot, c.kv_channels, c.rotary_percent));
  }
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
  cfg.apply_query_key_layer_scaling = c.qk_layer_scaling;
  cfg.seq_length = c.s;
  cfg.micro_batch_size = c.b;
  switch (c.mask) {
    case MaskKind::Causal:
      cfg.attn_mask_type = "causal";
      break;
    case MaskKind::None:
      cfg.attn_mask_type = "no_mask";
      break;
    case MaskKind::Padding:
      cfg.attn_mask_type = "padding";
      break;
    case MaskKind::Arbitrary:
      cfg.attn_mask_type = "arbitrary";
      break;
  }
  return cfg;
}

DenseInputs make_inputs(const DenseCase& c) {
  DenseInputs in;
  in.config = to_config(c);
  in.layer_number = c.layer;
  in.training = c.dropout > 0.0;
  in.dropout_seed = c.seed;
  // One stream per tensor (seeded by the case seed and the tensor's ordinal), so adding a tensor
  // to one configuration does not change the values of the others.
  int ordinal = 0;
  auto rng_for = [&]() {
    return std::mt19937_64(c.seed * 0x9E3779B97F4A7C15ull + static_cast<std::uint64_t>(++ordinal));
  };
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
    // The reference's RotaryEmbedding (Megatron's get_emb: fp32 inv_freq and outer product; halves
    // cat(freqs, freqs), interleaved each angle twice in a row): the angles Megatron's model feeds
    // the layer.
    in.rotary_pos_emb = reference::RotaryEmbedding(c.kv_channels, c.rotary_percent, c.rope == RopeKind::Interleaved,
                                                   in.config.rotary_base)
                            .forward(c.s);
  }
  return in;
}

}  // namespace twin::parity
