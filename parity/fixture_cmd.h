// `twin fixture [--twin reference|optimized|both] [--isolate] [--json] FILE...`: runs each Megatron
// fixture file through the named twin(s) and reports every compared tensor, in the order the layer
// computes them. End to end by default; --isolate runs each module on the golden's own input to
// it (parity/fixture_kinds.h), and the report says `isolated`. --tp N [--sp] runs the optimized twin
// sharded over N simulated ranks (its taps gathered across them), against the same unsharded golden
// (without --tp: at the golden's own layout, which a capture of a tensor-parallel job records);
// --ep N runs its MoE layer over N expert-parallel ranks. A file that is not
// .safetensors or .json (a README beside the fixtures) is reported `unsupported`: no twin runs it.
//
// Exit codes: 0 every compared tensor within tolerance; 1 a mismatch; 2 bad input (unreadable or
// corrupt file, bad config); 3 the twin does not support the fixture kind yet. Over several
// files (and twins): 2 if any error, else 1 if any failure, else 3 if any unsupported, else 0.
#pragma once

#include <ostream>
#include <string>
#include <vector>

#include "parity/fixture_kinds.h"

namespace twin::cli {

struct FixtureOptions {
  std::vector<std::string> files;
  std::string twin = "reference";  // reference | optimized | both
  bool json = false;               // one JSON object per file (and twin) per line on stdout
  bool isolate = false;            // each module on the golden's own input to it
  // The optimized twin sharded over tp simulated ranks (RunMode::tp), with sequence parallelism;
  // tp 0: the golden's own layout (its config's tensor_model_parallel_size and sequence_parallel).
  int tp = 0;
  bool sp = false;
  int ep = 0;  // over ep expert-parallel ranks (RunMode::ep); 0: the golden's own
  // The Megatron-Core commit whose semantics the goldens are held to; "": each golden's own.
  std::string megatron;
  // The reference's threads (reference/parallel.h: the results are bitwise the same at any count);
  // 0: as set before (`twin` sets every core).
  int threads = 0;
  // The reference in fast mode (RunMode::fast): its GEMMs in fp32 through a BLAS.
  bool fast = false;
  // Where handlers come from: the registry, or a test's own.
  FixtureHandler (*lookup)(const std::string& kind, TwinKind twin, const RunMode& mode) = find_fixture_handler;
};

int run_fixture(const FixtureOptions& opt, std::ostream& out, std::ostream& err);

}  // namespace twin::cli
