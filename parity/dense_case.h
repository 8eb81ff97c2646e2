// Dense-layer parity cases: a small struct naming every knob of a dense TransformerLayer run
// (shape, numerics, parallelism), its canonical id string, deterministic inputs built from it, and
// a RapidCheck generator that shrinks toward the smallest case.
//
// The id is the way to rerun a case: `twin case '<id>'`. Every field appears, in a fixed order,
// so to_id(parse_case_id(id)) == id and parse_case_id(to_id(c)) == c.
//   dense(h=16,a=4,g=2,d=8,ffn=32,norm=rms,act=silu,glu=1,bias=1,qkv_bias=0,rope=half,rot=0.5,
//         qkln=0,mask=causal,s=8,b=2,dtype=bf16,tp=2,sp=1,drop=0,seed=7)
#pragma once

#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>

#include <rapidcheck.h>

#include "core/config.h"
#include "core/tensor.h"

namespace twin::parity {

enum class MaskKind { Causal, None, Padding, Arbitrary };
enum class RopeKind { None, Half, Interleaved };

const char* mask_kind_name(MaskKind m);  // causal | none | padding | arbitrary
const char* rope_kind_name(RopeKind r);  // none | half | interleaved

struct DenseCase {
  int hidden = 16;        // h
  int heads = 2;          // a
  int groups = 2;         // g (num_query_groups)
  int kv_channels = 8;    // d
  int ffn = 32;
  bool rms = false;       // norm=rms | ln
  std::string act = "gelu";  // gelu | silu | relu
  bool glu = false;
  bool bias = true;       // add_bias_linear
  bool qkv_bias = false;  // add_qkv_bias
  RopeKind rope = RopeKind::None;
  double rotary_percent = 1.0;
  bool qk_layernorm = false;
  MaskKind mask = MaskKind::Causal;
  int s = 4;
  int b = 1;
  DType dtype = DType::F32;  // params / activations dtype (F32, BF16, F16)
  int tp = 1;
  bool sp = false;
  double dropout = 0.0;   // hidden_dropout and attention_dropout; > 0 runs in training mode
  std::uint64_t seed = 1; // data and dropout seed

  bool operator==(const DenseCase& o) const;
  bool operator!=(const DenseCase& o) const { return !(*this == o); }
};

struct CaseIdError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

std::string to_id(const DenseCase& c);
// Strict: every key once, in any order; unknown keys, bad values and invalid combinations throw
// CaseIdError naming the key.
DenseCase parse_case_id(const std::string& id);
// Throws CaseIdError when Megatron would reject the combination (heads % groups, groups % tp,
// ffn % tp, SP without TP, s % tp with SP, odd rotary dims, unknown activation).
void validate(const DenseCase& c);

// The Megatron TransformerConfig of the case (tensor_model_parallel_size and sequence_parallel set
// from tp/sp; the reference ignores them, the optimized twin shards by them).
TransformerConfig to_config(const DenseCase& c);

// Deterministic inputs from c.seed: full (unsharded) parameters under Megatron's state_dict keys,
// hidden_states [s, b, h], attention_mask [b, 1, s, s] (bool, True = masked; only for padding and
// arbitrary masks), rotary_pos_emb [s, 1, 1, rot_dim] (fp32 angles, as RotaryEmbedding.get_emb).
struct DenseInputs {
  TransformerConfig config;
  std::map<std::string, Tensor> params;
  Tensor hidden_states;   // [s, b, h]
  Tensor attention_mask;  // [b, 1, s, s] or undefined
  Tensor rotary_pos_emb;  // [s, 1, 1, rot_dim] or undefined
  bool training = false;
  std::uint64_t dropout_seed = 0;
};
DenseInputs make_inputs(const DenseCase& c);

// Sizes the generator draws from; defaults are tiny so the simulator runs 100 cases quickly.
struct CaseLimits {
  int max_tp = 4;            // tp drawn from {1, 2, 4} up to this
  int max_groups_per_rank = 2;
  int max_heads_per_group = 2;
  int max_s_per_rank = 4;
  int max_b = 2;
  bool allow_dropout = false;
  bool any_dtype = true;     // false: only `dtype`
  DType dtype = DType::F32;
  bool force_tp = false;     // true: tp = `tp` exactly
  int tp = 1;
};
rc::Gen<DenseCase> gen_dense_case(CaseLimits limits = {});

}  // namespace twin::parity

namespace rc {
template <>
struct Arbitrary<twin::parity::DenseCase> {
  static Gen<twin::parity::DenseCase> arbitrary() { return twin::parity::gen_dense_case(); }
};
}  // namespace rc

namespace twin::parity {
// RapidCheck prints a counterexample with this: the id, rerunnable with `twin case`.
inline void showValue(const DenseCase& c, std::ostream& os) { os << to_id(c); }
}  // namespace twin::parity
