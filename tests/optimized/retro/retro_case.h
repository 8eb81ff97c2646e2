// A random Retro case for the optimized-twin tests: a decoder layer (later / first, with or
// without context_mask) or a decoder block (6 or 9 layers) with its Retro sizes, dtype, dropout
// and seed, a printable id, and both twins' runs with their records (rounding counts included).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "core/config.h"
#include "core/record.h"
#include "core/tensor.h"
#include "parity/golden.h"
#include "tests/case_id.h"

namespace twin::test {

enum class RetroKind { Later, First, Block };
// "later" | "first" | "block" in a case id (found by ADL from tests/case_id.h's templates).
std::string format_case_value(RetroKind v);
void parse_case_value(const std::string& key, const std::string& s, RetroKind& v);

// A property case of tests/case_id.h: its id reruns it (TWIN_CASE='<id>' with the property's binary).
struct RetroCase : proptest::PropertyCase {
  static constexpr const char* kKind = "retro";
  RetroKind kind = RetroKind::Later;
  int block_layers = 6;                              // RetroKind::Block
  int m = 2, k = 2, chunks = 1, encoder_layers = 1;  // chunk length, neighbours, retrieved chunks
  int ns = 4, bs = 1;
  int heads = 1, head_dim = 4, ffn = 8;
  DType dtype = DType::F32;  // fp32 | bf16 | fp16 (params, activations)
  bool context_mask = false, bias = true;
  double dropout = 0.0;  // hidden, attention and the encoder's; training when > 0
  int tp = 1;            // the optimized twin's tensor_model_parallel_size (the reference is unsharded)
  std::uint64_t seed = 1;

  template <class V>
  void fields(V& v) {
    v("kind", kind);
    v("layers", block_layers);
    v("m", m);
    v("k", k);
    v("chunks", chunks);
    v("enc", encoder_layers);
    v("ns", ns);
    v("bs", bs);
    v("np", heads);
    v("hn", head_dim);
    v("ffn", ffn);
    v("dtype", dtype);
    v("cmask", context_mask);
    v("bias", bias);
    v("drop", dropout);
    v("tp", tp);
    v("seed", seed);
  }
};

// "retro(kind=first,layers=6,m=3,k=2,chunks=1,enc=2,ns=7,bs=2,np=2,hn=4,ffn=16,dtype=bf16,cmask=1,bias=1,drop=0.1,tp=1,seed=9)"
inline std::string to_id(const RetroCase& c) { return proptest::case_id(c); }
TransformerConfig to_config(const RetroCase& c);

struct RetroRun {
  Tensor hidden_states;
  std::optional<Tensor> context;
  Record record;  // outputs and taps, then (with backward) the gradients as a golden names them
};
// backward: then the backward of random gradients of the outputs (of the hidden states, and of a
// layer's context too: the context handed on is in the loss), the gradients recorded after the
// outputs ("param.<key>" with its magnitude, "input.hidden_states", "input.context").
RetroRun run_reference(const RetroCase& c, bool backward = false);
// use_graph: the twin's CUDA-graph path, no taps. The graph is captured on other inputs of the
// same shapes (the case's seed + 1) and then replayed on the case's: the outputs are the replay's
// only if the replay recomputes from the refilled input buffers.
RetroRun run_optimized(const RetroCase& c, bool use_graph = false, bool backward = false);

// Both records compared entry by entry with compare_record's golden bound from the counted
// rounding points: every reference entry is expected of the optimized twin (the per-neighbour
// calls inside the retriever encoder's cross attention aside, which the optimized twin runs as
// one), and an entry only the optimized twin recorded fails.
std::vector<Comparison> compare_runs(const RetroRun& optimized, const RetroRun& reference);

}  // namespace twin::test
