// Token dispatchers at one expert-parallel rank, mirroring
// megatron/core/transformer/moe/token_dispatcher.py (Megatron-LM 93ddc24):
// MoEAllGatherTokenDispatcher and MoEAlltoAllTokenDispatcher with tensor and expert parallel size
// 1, so their collectives (all-gather, all-to-all, reduce-scatter) are identities. Each keeps
// Megatron's six steps and its orderings: tokens are flattened sequence-major (t = s_idx * b +
// b_idx) and permuted expert-major, by token index within an expert; the combine scatter-adds
// each expert's rows back in that order. At one rank both dispatchers give bitwise-equal results.
//
// The attributes Megatron's dispatchers keep between dispatch and combine live in the plain
// struct DispatcherState, so MoETransformerLayer's phases can hand them over visibly.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "core/config.h"
#include "reference/moe/moe_utils.h"

namespace twin::reference::moe {

struct DispatcherState {
  Index seq_length = 0, bsz = 0, hidden = 0;                    // hidden_shape [s, b, h]
  BoolMat routing_map;                                          // [T, E]
  BoolMat local_map;                                            // [T, local E] (allgather)
  std::vector<Index> reversed_local_input_permutation_mapping;  // [N] source token of each row
  std::vector<Index> tokens_per_expert;                         // [local E]
  std::vector<Index> num_global_tokens_per_local_expert;        // [tp*ep * local E] (alltoall)
  Index capacity = 0;                                           // drop-and-pad capacity (alltoall)
  Index num_out_tokens = 0;                                     // rows after permutation 1 (alltoall)
};

// Tokens and probabilities between the dispatch steps: before permutation `probs` is [T, E];
// after it, [N, 1] (one probability per permuted row).
struct DispatchTensors {
  Mat hidden_states;  // [T, h] or [N, h]
  Mat probs;          // [T, E] or [N, 1]
  // 1 + max |logits|: the magnitude the probabilities' error follows (softmax and sigmoid are
  // 1-Lipschitz in the logits), for the bound of the permuted_probs tap.
  double probs_magnitude = 1.0;
};

// The experts' inputs (the fixture taps tap_in.mlp.experts.*).
struct ExpertInputs {
  Mat dispatched_input;                  // [N, h] expert-major
  std::vector<Index> tokens_per_expert;  // [local E]
  std::vector<double> permuted_probs;    // [N]
};

class MoETokenDispatcher {
 public:
  MoETokenDispatcher(const TransformerConfig& config, Precision p);
  virtual ~MoETokenDispatcher() = default;

  // hidden_states [T, h] (T = s * b), routing_map [T, E], probs [T, E].
  virtual DispatchTensors dispatch_preprocess(const Mat& hidden_states, Index seq_length, Index bsz,
                                              const BoolMat& routing_map, const Mat& probs) = 0;
  virtual DispatchTensors token_dispatch(DispatchTensors x) = 0;
  virtual ExpertInputs dispatch_postprocess(DispatchTensors x) = 0;
  virtual Mat combine_preprocess(const Mat& expert_output) = 0;  // [N, h] -> ...
  virtual Mat token_combine(Mat hidden_states) = 0;
  virtual Mat combine_postprocess(Mat hidden_states) = 0;  // -> [T, h]

  DispatcherState state;

 protected:
  TransformerConfig config_;
  Precision p_;
  int num_experts_;
  int num_local_experts_;
  std::vector<Index> local_expert_indices_;
  int tp_size_ = 1, ep_size_ = 1;  // one rank
};

class MoEAllGatherTokenDispatcher : public MoETokenDispatcher {
 public:
  using MoETokenDispatcher::MoETokenDispatcher;
  DispatchTensors dispatch_preprocess(const Mat& hidden_states, Index seq_length, Index bsz, const BoolMat& routing_map,
                                      const Mat& probs) override;
  DispatchTensors token_dispatch(DispatchTensors x) override;
  ExpertInputs dispatch_postprocess(DispatchTensors x) override;
  Mat combine_preprocess(const Mat& expert_output) override;
  Mat token_combine(Mat hidden_states) override;
  Mat combine_postprocess(Mat hidden_states) override;
};

class MoEAlltoAllTokenDispatcher : public MoETokenDispatcher {
 public:
  MoEAlltoAllTokenDispatcher(const TransformerConfig& config, Precision p);
  DispatchTensors dispatch_preprocess(const Mat& hidden_states, Index seq_length, Index bsz, const BoolMat& routing_map,
                                      const Mat& probs) override;
  DispatchTensors token_dispatch(DispatchTensors x) override;
  ExpertInputs dispatch_postprocess(DispatchTensors x) override;
  Mat combine_preprocess(const Mat& expert_output) override;
  Mat token_combine(Mat hidden_states) override;
  Mat combine_postprocess(Mat hidden_states) override;

 private:
  // Computes tokens per local expert, the capacity (drop-and-pad) and num_out_tokens.
  std::vector<Index> preprocess(const BoolMat& routing_map);
  bool drop_and_pad_;
  std::vector<Index> sort_input_by_local_experts_;      // [local E * tp * ep]
  std::vector<Index> restore_output_by_local_experts_;  // [tp * ep * local E]
};

// moe_token_dispatcher_type: allgather | alltoall (flex needs DeepEP / HybridEP: MoEError).
std::unique_ptr<MoETokenDispatcher> make_token_dispatcher(const TransformerConfig& config, Precision p);

}  // namespace twin::reference::moe
