// MoELayer's work at one rank (megatron/core/transformer/moe/moe_layer.py) as plain numbers and
// device pointers, crossing from its host side (moe_layer.cpp) into the per-backend kernel
// sequence (moe_layer.cuh): the router, the token dispatcher, the experts and shared experts.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "core/dtype.h"
#include "core/rounding.h"
#include "optimized/layer/kernel_types.h"

namespace twin::rt {
class Communicator;
}

namespace twin::opt {

// Where the MoE forward has just produced what a tap names (the host downloads it there).
enum class MoETapPoint {
  SharedFc1,      // mlp.shared_experts.linear_fc1.0
  SharedFc2,      // mlp.shared_experts.linear_fc2.0
  SharedExperts,  // mlp.shared_experts
  RouterLogits,   // mlp.router.logits
  RouterProbs,    // mlp.router.0 / .1, the losses, the token counter
  ExpertInputs,   // tap_in.mlp.experts.*
  ExpertsFc1,     // mlp.experts.local_experts.<i>.linear_fc1.0 (ep 1)
  ExpertsFc2,     // mlp.experts.local_experts.<i>.linear_fc2.0 (ep 1)
  ExpertsOutput,  // mlp.experts.local_experts.<i>.0, mlp.experts.0
  MlpOutput       // mlp.0
};

// MoELayer's part of a rank's plan: the router, the dispatcher, the experts and shared experts.
// Its input is the attention half's pre_mlp_layernorm output, its residual the half's h1.
struct MoELayerPlan {
  // ---- router
  int E = 0, topk = 1;
  DType rdt = DType::F32;   // router dtype
  bool cast_input = false;  // the gating input is cast from the params dtype to rdt first
  ScoreFunction score = ScoreFunction::Softmax;
  bool scores_fp32 = false, aux_scores_fp32 = false;  // MegatronSwitches: where the scores are held
  bool pre_softmax = false;
  int num_groups = 0, group_topk = 0;
  float scaling_factor = 0.0f;
  bool drop = false;  // capacity factor set
  double capacity_factor = 0.0;
  bool drop_by_probs = true, pad_to_capacity = false;
  std::optional<AuxLossKind> aux_kind;  // the load-balancing loss, none when off (or not training)
  double aux_coeff = 0.0;
  bool z_loss = false;
  double z_coeff = 0.0;
  const void* router_w = nullptr;              // [E, h] rdt
  const void* router_b = nullptr;              // [E] rdt
  const float* expert_bias = nullptr;          // [E] fp32
  const std::uint8_t* padding = nullptr;       // [T] device, 1 = padding (token order t = s * b + b_idx)
  const std::uint8_t* recorded_map = nullptr;  // host [T, E]: Megatron's map a golden fixes (MoEForwardInputs)
  double* global_tokens = nullptr;             // [E] device, global_aux_loss accumulator
  double ga_steps = 0.0;                       // forwards since the accumulator's reset (incl. this)

  // ---- experts
  int ffn = 0;  // moe_ffn_hidden_size
  bool glu = false;
  Act act = Act::Gelu;
  const void* fc1_w = nullptr;  // [E, (glu ? 2 : 1) * ffn, h]
  const void* fc1_b = nullptr;  // [E, (glu ? 2 : 1) * ffn] or null
  const void* fc2_w = nullptr;  // [E, h, ffn]
  const void* fc2_b = nullptr;  // [E, h] or null
  // ---- shared experts
  int shared_ffn = 0;  // 0: none
  bool shared_gate = false;
  const void* shared_fc1_w = nullptr;   // [(glu ? 2 : 1) * shared_ffn, h]
  const void* shared_fc2_w = nullptr;   // [h, shared_ffn]
  const void* shared_gate_w = nullptr;  // [1, h]

  // ---- activations (device), T = s * b tokens (tensor parallel: the rank's, below), N_max = T * E rows
  void* x_r = nullptr;                            // [T, h] rdt (cast_input)
  void* logits = nullptr;                         // [T, E] rdt
  void* probs_pre = nullptr;                      // [T, E] rdt (before the capacity drop)
  std::uint8_t* map_pre = nullptr;                // [T, E]
  void* probs = nullptr;                          // [T, E] rdt
  std::uint8_t* routing_map = nullptr;            // [T, E]
  float* aux_scores = nullptr;                    // [T, E]
  std::uint8_t* aux_map = nullptr;                // [T, E]
  float* z = nullptr;                             // [T]
  double* loss_scratch = nullptr;                 // [2 * b * E]
  float* losses = nullptr;                        // [2]: load-balancing loss / coeff, z_loss / coeff
  std::int64_t* tokens_per_expert_dev = nullptr;  // [E]
  std::int64_t* offsets = nullptr;                // [E + 1]
  std::int64_t* row_id_map = nullptr;             // [E, T]
  void* permuted = nullptr;                       // [N_max, h]
  void* permuted_probs = nullptr;                 // [N_max] rdt
  void* fc1 = nullptr;                            // [N_max, (glu ? 2 : 1) * ffn]
  void* act_out = nullptr;                        // [N_max, ffn]
  void* expert_out = nullptr;                     // [N_max, h]
  void* combined = nullptr;                       // [T, h]
  void* shared_fc1 = nullptr;                     // [T, (glu ? 2 : 1) * shared_ffn]
  void* shared_act = nullptr;                     // [T, shared_ffn]
  void* shared_out = nullptr;                     // [T, h]
  void* shared_fc2 = nullptr;   // [T, h] linear_fc2's output: shared_out without a gate, kept apart with one
  void* gate_logits = nullptr;  // [T]
  void* mlp_out = nullptr;      // [T, h]

  // ---- tensor parallelism with sequence parallelism (the attention half's tp > 1 and sp): this
  // rank routes its slice of the tokens, T = s / tp * b, through every expert whole (expert
  // tensor-parallel size 1); the shared experts are a tensor-parallel MLP over all s * b tokens,
  // holding shared_ffn / tp of its columns (shared_fc1 [s * b, (glu ? 2 : 1) * shared_ffn / tp],
  // shared_act [s * b, shared_ffn / tp]).
  double* tp_counts = nullptr;         // [2 * b * E] the load-balancing loss's column counts over the ranks
  void* shared_fc2_partial = nullptr;  // [s * b, h] this rank's part of the shared linear_fc2's output

  // ---- expert parallelism, ep > 1: this rank holds the local experts
  // [ep_rank * local_E, (ep_rank + 1) * local_E) (fc1_w .. fc2_b above are those experts only).
  // A rank receives at most ep * T rows for each of its local_E experts: ep * T * local_E = T * E
  // = N_max rows, so every buffer below has the N_max rows of the ep = 1 ones.
  int ep = 1, ep_rank = 0, local_E = 0;
  rt::Communicator* ep_comm = nullptr;
  // The expert-parallel ranks hold replicas of one batch (ep alone); false at ep = tp, where the
  // expert-parallel group is the tensor-parallel one and each rank holds its slice of the sequence
  // (Megatron's groups at expert tensor-parallel size 1).
  bool ep_replicas = true;
  std::int64_t* ep_counts = nullptr;          // [ep, E] device: every rank's tokens per expert
  void* ep_recv = nullptr;                    // [N_max, h] rows by source rank, then local expert
  void* ep_recv_probs = nullptr;              // [N_max] rdt
  void* ep_in = nullptr;                      // [N_max, h] rows by local expert, then source rank
  void* ep_in_probs = nullptr;                // [N_max] rdt
  void* ep_out = nullptr;                     // [N_max, h] the local experts' outputs
  std::int64_t* ep_offsets = nullptr;         // [local_E + 1] device: exclusive prefix of local tokens per expert
  std::vector<std::int64_t> ep_offsets_host;  // [local_E + 1] (the upload's source stays alive)
  std::vector<std::int64_t> local_tokens_per_expert;  // [local_E] rows this rank's experts computed
  // The allgather dispatcher (else alltoall); TG = ep * T gathered tokens, rank q's at [q T, (q + 1) T).
  bool allgather = false;
  bool gather_expert_taps = false;       // the recording ranks assemble their ep = 1 expert outputs for the taps
  void* ag_x = nullptr;                  // [TG, h] the gathered pre_mlp_layernorm outputs
  std::uint8_t* ag_map = nullptr;        // [TG, E] the gathered routing maps
  void* ag_probs = nullptr;              // [TG, E] rdt
  std::uint8_t* ag_local_map = nullptr;  // [TG, local_E] local_map: the local experts' columns
  void* ag_local_probs = nullptr;        // [TG, local_E] rdt
  std::int64_t* ag_tokens_per_expert = nullptr;  // [local_E] device
  std::int64_t* ag_row_id_map = nullptr;         // [local_E, TG]
  void* ag_partial = nullptr;                    // [TG, h] the local experts' rows unpermuted
  void* ag_partial_r = nullptr;                  // [TG, h] rdt (router dtype != dt)
  void* ag_combined_r = nullptr;                 // [T, h] rdt (router dtype != dt)
  std::vector<std::uint8_t> ag_local_map_host;   // the uploads' sources stay alive
  std::vector<unsigned char> ag_local_probs_host;

  // ---- host results of the forward
  std::vector<std::int64_t> tokens_per_expert;        // [E] this rank's tokens, routed
  std::vector<double>* local_tokens = nullptr;        // expert-bias counter (non-padding routed tokens), or null
  std::vector<std::uint8_t>* padding_host = nullptr;  // [T] or null

  std::function<void(MoETapPoint)> on_tap;
  bool capturing = false;  // the phase is being captured into a graph: no host synchronisation
};

// MoELayer's backward at one rank (moe_layer_backward.cuh): its input and output gradients, its
// parameters' gradients (in the params dtype, shaped as the plan's weights) and the scratch
// between the ops, on the device; T = s * b tokens, N_max = T * E rows as the forward's buffers.
struct MoELayerGrads {
  const void* d_output = nullptr;  // [T, h] the MoE output's gradient
  void* d_input = nullptr;         // [T, h] pre_mlp_layernorm's output's gradient
  // ---- parameter gradients
  void* router_w = nullptr;  // [E, h]
  void* fc1_w = nullptr;     // [local_E, (glu ? 2 : 1) * ffn, h] this rank's experts (at ep = 1 all E)
  void* fc2_w = nullptr;     // [local_E, h, ffn]
  void *shared_fc1_w = nullptr, *shared_fc2_w = nullptr, *shared_gate_w = nullptr;  // as the weights
  // ---- scratch
  void* d_rows = nullptr;            // [N_max, h] each dispatched row's gradient
  void* d_act = nullptr;             // [N_max, ffn] d of the scaled activation
  void* d_fc1 = nullptr;             // [N_max, (glu ? 2 : 1) * ffn]
  void* d_permuted = nullptr;        // [N_max, h] d of the permuted tokens
  void* d_permuted_probs = nullptr;  // [N_max] rdt
  void* d_hidden = nullptr;          // [T, h] the dispatch's part of d input
  void* dprobs = nullptr;            // [T, E] rdt
  float* aux_grad = nullptr;         // [T, E] the load-balancing loss's gradient of its scores
  double* aux_scratch = nullptr;     // [2 * b * E]
  void* dlogits = nullptr;           // [T, E] rdt
  void* d_x_r = nullptr;             // [T, h] rdt != dt: the gating dgrad in rdt
  void* d_router_w_r = nullptr;      // [E, h] rdt != dt: the gating wgrad in rdt
  void* d_x_router = nullptr;        // [T, h] the router's part of d input
  void* d_shared_mlp = nullptr;      // [T, h] with the gate: the shared MLP's output gradient
  void* d_gate_logits = nullptr;     // [T]
  void* d_shared_act = nullptr;      // [T, shared_ffn]
  void* d_shared_fc1 = nullptr;      // [T, (glu ? 2 : 1) * shared_ffn]
  void* d_x_shared = nullptr;        // [T, h] the shared experts' part of d input
  // tp > 1 (sequence parallel): the shared MLP's output gradient all-gathered [s * b, h] and this
  // rank's part of its input gradient [s * b, h] (reduce-scattered into d_x_shared); the shared
  // buffers above then hold all s * b tokens and shared_ffn / tp columns.
  void* d_shared_full = nullptr;
  void* d_x_shared_partial = nullptr;
  // expert parallelism, ep > 1 (the alltoall dispatcher's duals), N_max rows each
  void* ep_d_recv = nullptr;        // [N_max, h] rows' gradients by source rank, then local expert
  void* ep_d_out = nullptr;         // [N_max, h] the local experts' output gradient (local expert-major)
  void* ep_d_in = nullptr;          // [N_max, h] the local experts' input gradient
  void* ep_d_in_probs = nullptr;    // [N_max] rdt
  void* ep_d_recv_probs = nullptr;  // [N_max] rdt, by source rank
  // the allgather dispatcher's, TG = ep * T gathered tokens
  void* ag_d = nullptr;              // [TG, h] the gathered output gradients, then the gathered tokens'
  void* ag_d_local_probs = nullptr;  // [TG, local_E] rdt the local experts' probabilities' gradients
  void* ag_d_probs_recv = nullptr;   // [ep, T, local_E] rdt each expert rank's columns of this rank's tokens
  // The most rows one token was dispatched to in the forward (host): the permute backward's
  // index_add stores that many times.
  int most_rows = 0;
  // The rounding count from phase to phase (host): at the layer's output gradient, at MoELayer's,
  // at the end of the shared experts' branch.
  RoundingCount at_input, at_output, shared_end;
};

}  // namespace twin::opt
