// Dense-layer parity cases: a small struct naming every knob of a dense TransformerLayer run
// (shape, numerics, parallelism), its canonical id string and deterministic inputs built from it.
// The property-test generator that draws cases lives with the tests (tests/parity/dense_case_gen.h)
// so the `twin` tool does not carry RapidCheck.
//
// The id is the way to rerun a case: `twin case '<id>'`. Every field appears, in a fixed order,
// so to_id(parse_case_id(id)) == id and parse_case_id(to_id(c)) == c.
//   dense(h=16,a=4,g=2,d=8,ffn=32,norm=rms,act=silu,glu=1,bias=1,qkv_bias=0,rope=half,rot=0.5,
//         qkln=0,mask=causal,s=8,b=2,dtype=bf16,tp=2,sp=1,drop=0,seed=7)
// `layer` and `qkls` (layer number, query-key layer scaling) came later: an id may omit them while
// they hold their defaults (layer=1, qkls=0), and to_id prints them only otherwise.
// One table (dense_case_fields) spells each field once: its key, its domain, how it prints and
// parses; printing, parsing, validation messages and the generator all read it.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/tensor.h"
#include "parity/case_field.h"

namespace twin::parity {

enum class MaskKind { Causal, None, Padding, Arbitrary };
enum class RopeKind { None, Half, Interleaved };

const char* mask_kind_name(MaskKind m);  // causal | none | padding | arbitrary
const char* rope_kind_name(RopeKind r);  // none | half | interleaved

struct DenseCase {
  int hidden = 16;      // h
  int heads = 2;        // a
  int groups = 2;       // g (num_query_groups)
  int kv_channels = 8;  // d
  int ffn = 32;
  bool rms = false;          // norm=rms | ln
  std::string act = "gelu";  // gelu | silu | relu
  bool glu = false;
  bool bias = true;       // add_bias_linear
  bool qkv_bias = false;  // add_qkv_bias
  RopeKind rope = RopeKind::None;
  double rotary_percent = 1.0;
  bool qk_layernorm = false;
  MaskKind mask = MaskKind::Causal;
  int layer = 1;                  // layer_number (1-based, as TransformerLayer takes it)
  bool qk_layer_scaling = false;  // apply_query_key_layer_scaling: scores / layer, the softmax * layer
  int s = 4;
  int b = 1;
  DType dtype = DType::F32;  // params / activations dtype (F32, BF16, F16)
  int tp = 1;
  bool sp = false;
  double dropout = 0.0;    // hidden_dropout and attention_dropout; > 0 runs in training mode
  std::uint64_t seed = 1;  // data and dropout seed

  bool operator==(const DenseCase& o) const;
  bool operator!=(const DenseCase& o) const { return !(*this == o); }
};

// The field table of `dense(...)` ids, in id order (CaseIdError comes from parity/case_field.h).
const std::vector<CaseField<DenseCase>>& dense_case_fields();

std::string to_id(const DenseCase& c);
// Strict: every key once, in any order; unknown keys, bad values and invalid combinations throw
// CaseIdError naming the key (for a bad value also the allowed values).
DenseCase parse_case_id(const std::string& id);
// Throws CaseIdError when a field is outside its domain (the message names the field, its value
// and the allowed values) or Megatron would reject the combination (heads % groups, heads % tp,
// groups % tp, ffn % tp, SP without TP, s % tp with SP, odd rotary dims).
void validate(const DenseCase& c);

// The number of channels RoPE rotates: RotaryEmbedding's dim, int(d * rot) when rot < 1.
int rotary_dim(const DenseCase& c);

// The Megatron TransformerConfig of the case (tensor_model_parallel_size and sequence_parallel set
// from tp/sp; the reference ignores them, the optimized twin shards by them).
TransformerConfig to_config(const DenseCase& c);

// Deterministic inputs from c.seed: full (unsharded) parameters under Megatron's state_dict keys,
// hidden_states [s, b, h], attention_mask [b, 1, s, s] (bool, True = masked; only for padding and
// arbitrary masks), rotary_pos_emb [s, 1, 1, rot_dim] (fp32 angles from the reference's
// RotaryEmbedding, which computes them as Megatron's RotaryEmbedding.get_emb does).
struct DenseInputs {
  TransformerConfig config;
  int layer_number = 1;  // what both twins' layers are built with
  std::map<std::string, Tensor> params;
  Tensor hidden_states;   // [s, b, h]
  Tensor attention_mask;  // [b, 1, s, s] or undefined
  Tensor rotary_pos_emb;  // [s, 1, 1, rot_dim] or undefined
  bool training = false;
  std::uint64_t dropout_seed = 0;
};
DenseInputs make_inputs(const DenseCase& c);

}  // namespace twin::parity
