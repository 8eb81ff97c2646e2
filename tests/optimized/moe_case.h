// The optimized MoE layer's property-test cases, shared by the test binaries that draw random MoE
// layers (router score function, pre-softmax, group-limited top-k, scaling, expert bias, capacity
// and drop policies, losses, shared experts and gate, biases, GLU, fp32, bf16 and fp16): the drawn
// case (OptMoECase, a property case of tests/case_id.h) made a layer's parameters and inputs
// (MoECase), and both twins' forward and backward runs on it with their records.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <string>

#include <rapidcheck.h>

#include "core/config.h"
#include "core/record.h"
#include "core/tensor.h"
#include "optimized/moe/moe_transformer_layer.h"
#include "parity/dense_case.h"
#include "reference/moe/moe_transformer_layer.h"
#include "tests/case_id.h"

namespace twin::moe_case {

// A MoE layer case made: the dense half's case (dtype, sizes, the data seed), the layer's config,
// its parameters by state-dict name and its inputs.
struct MoECase {
  parity::DenseCase dense;
  TransformerConfig config;
  std::map<std::string, Tensor> params;
  Tensor hidden_states, attention_mask, rotary_pos_emb;
};

// A tensor of `shape` in dtype dt, its elements drawn from N(0, scale^2) by rng.
Tensor random(DType dt, Shape shape, double scale, std::mt19937_64& rng);

// One drawn MoE layer case, everything the properties compute from: the dense half's fields
// (dtype, sizes, norm, activation, biases, RoPE, the data seed) and the MoE config's choices. Its id
// prints on a failure (tests/case_id.h) and TWIN_CASE='<id>' reruns exactly that case.
struct OptMoECase : proptest::PropertyCase {
  static constexpr const char* kKind = "opt_moe";
  DType dtype = DType::F32;
  int s = 1, b = 1;
  bool rms = false, glu = false;
  std::string act = "gelu";
  bool bias = false;
  std::string rope = "none";  // none | half
  std::uint64_t seed = 1;
  int E = 2, k = 1, ffn = 8;
  std::string score = "softmax";  // softmax | sigmoid
  bool pre = false;
  int groups = 0, group_topk = 0;  // 0: no group-limited routing
  bool scale = false;              // moe_router_topk_scaling_factor 2.5
  std::string dispatcher = "allgather";
  std::string lb = "none";
  bool z_loss = false, expert_bias = false, shared = false, gate = false;
  double capacity = 0.0;  // 0: no capacity factor
  std::string drop = "probs";
  bool pad = false;
  template <class V>
  void fields(V& v) {
    v("dtype", dtype);
    v("s", s);
    v("b", b);
    v("rms", rms);
    v("glu", glu);
    v("act", act);
    v("bias", bias);
    v("rope", rope);
    v("seed", seed);
    v("E", E);
    v("k", k);
    v("ffn", ffn);
    v("score", score);
    v("pre", pre);
    v("groups", groups);
    v("group_topk", group_topk);
    v("scale", scale);
    v("dispatcher", dispatcher);
    v("lb", lb);
    v("z_loss", z_loss);
    v("expert_bias", expert_bias);
    v("shared", shared);
    v("gate", gate);
    v("capacity", capacity);
    v("drop", drop);
    v("pad", pad);
  }
};

// experts_multiple_of: num_moe_experts is drawn among the multiples of it in [2, 8].
rc::Gen<OptMoECase> gen_opt_moe_case(int experts_multiple_of = 1);

// A drawn case made one the layer runs at tensor-parallel size tp with sequence parallelism: the
// sequence a multiple of tp, no expert capacity (each rank would cut its own slice of the tokens).
// (make_case's heads: a multiple of tp.)
void shape_for_tensor_parallel(OptMoECase& o, int tp);

// The layer, its parameters and inputs of a drawn case (with `heads` attention heads and as many
// query groups).
MoECase make_case(const OptMoECase& o, int heads = 2);

// A case's config in one line, for RC_LOG.
std::string describe(const MoECase& m);

// The reference layer of a case, FP32 mode (Megatron's rounding points) or exact (fp64).
std::unique_ptr<reference::moe::MoETransformerLayer> make_reference(const MoECase& m, bool exact);

// The reference layer's training forward of the case's inputs, counting roundings; its taps into
// rec when rec is not null.
Tensor reference_forward(const MoECase& m, reference::moe::MoETransformerLayer& layer, Record* rec);
// The same on a fresh reference layer (make_reference).
Tensor reference_forward(const MoECase& m, bool exact, Record* rec);

// The case's attention mask and rotary embedding (null where the case has none) as the optimized
// layer's inputs.
opt::MoEForwardInputs optimized_inputs(const MoECase& m);

// The optimized layer's training forward of the case's inputs, counting roundings; its record into
// rec when rec is not null.
Tensor optimized_forward(const MoECase& m, opt::MoETransformerLayer& layer, Record* rec);
// The same on a fresh optimized layer.
// ep: the config's expert_model_parallel_size (the drawn dispatcher between the ranks).
Tensor optimized_forward(const MoECase& m, Record* rec, int ep = 1);

// Whether a and b have the same shape, dtype and bytes.
bool bitwise_equal(const Tensor& a, const Tensor& b);

// Whether some token has two logits within `gap` of each other (a near-tie in what routes it).
bool has_near_tie(const Tensor& logits, std::int64_t E, double gap);

// The one rule by which the records differ: the reference taps the GEMMs inside each local expert
// (SequentialMLP runs one MLP per expert); the optimized twin runs the experts as one grouped
// GEMM pass and records what goes in (tap_in) and each expert's output, not the GEMMs inside.
bool inside_an_expert(const std::string& key);

// The case with other hidden states of the same shape (every third element negated, exact in any
// dtype): a second forward through the same layers.
MoECase with_second_input(MoECase m);

// ---- backward ----------------------------------------------------------------------------------

// A drawn case the layer's backward covers: no biases (add_bias_linear, which both twins' MoE
// backward refuses).
MoECase make_backward_case();

// Discards the case when the two records' routing maps differ, after checking that they may: some
// token has two logits within both twins' logits difference plus two roundings (a near-tie either
// implementation may order either way).
void discard_if_routed_on_a_near_tie(const Record& ref, const Record& got, std::int64_t E);

// A random gradient of the layer's output [s, b, h] in the params dtype.
Tensor output_gradient(const MoECase& m);

// The reference's forward record, then its gradients (Role::Grad), counted from the forward's.
Record reference_with_gradients(const MoECase& m, const Tensor& dout);

// The optimized twin's, likewise, at expert-parallel size ep or tensor-parallel size tp (with
// sequence parallelism). processes: the layer's ranks one per MPI process (LayerOptions::processes)
// rather than threads of this one.
Record optimized_with_gradients(const MoECase& m, const Tensor& dout, int ep = 1, int tp = 1, bool processes = false);

}  // namespace twin::moe_case
