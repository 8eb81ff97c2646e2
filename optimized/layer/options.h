// How an optimized layer is built (the parallel layout it shards for, the backend it runs on, its
// layer number and its self-attention's mask type) and how a forward runs and what it returns.
// Shared by every layer kind.
#pragma once

#include <cstdint>
#include <string>

#include "core/record.h"
#include "core/tensor.h"
#include "optimized/runtime/device.h"

namespace twin::opt {

struct LayerOptions {
  int tp = 1;
  bool sp = false;
  rt::Backend backend = rt::Backend::Sim;
  int layer_number = 1;
  // The self-attention's attn_mask_type: a spec parameter in Megatron (the local GPT spec fixes
  // "causal"), not the config's run description. "causal": causal mask when no attention_mask is
  // given; "no_mask" / "padding" / "arbitrary": only a given mask applies.
  std::string attn_mask_type = "causal";
  // One rank per process of an MPI launch (runtime/processes.h; the process count must be the
  // layer's rank count): this process runs its own rank, the others theirs (layer/rank_runner.h).
  // False: every rank a thread of this process.
  bool processes = false;
};

struct ForwardOptions {
  bool training = false;           // dropout active (hidden_dropout, attention_dropout of the config)
  std::uint64_t seed = 0;          // Philox key of every dropout call of this forward
  std::uint64_t offset = 0;        // the layer's base Philox offset; each dropout call draws at its
                                   // DropoutSite's offset from it (core/dropout_site.h), as the reference
  bool record_taps = false;        // download each submodule output under its module path, with the
                                   // rounding points counted before it (in a CountRoundings scope); at
                                   // tp > 1 the ranks' shards gathered into the full tensor, in rank order
  bool use_graph = false;          // capture the forward into a CUDA graph once, then replay it
  bool keep_for_backward = false;  // keep what backward() reads (each rank's attention softmax statistics;
                                   // the activations stay in the layer's buffers anyway)
};

struct LayerOutput {
  Tensor hidden_states;  // [s, b, h] in the params dtype (SP: the ranks' slices gathered)
  Record record;         // taps, when record_taps
};

}  // namespace twin::opt
