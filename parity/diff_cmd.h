// `twin diff A B [--json]`: two captures of one layer (golden files of one kind) compared tensor
// by tensor in computation order, each within the bound of its dtype and the rounding points
// before it, naming the first computed tensor that diverges (parity/capture_diff.h). Inputs and
// parameters that differ are reported (exact comparison) but are not the first divergence.
// Gradients are compared with the backward's counted bounds; `--exact` compares every tensor bit
// for bit instead (two runs that should be deterministic).
//
// Exit codes: 0 no computed tensor diverges; 1 one does; 2 bad input (unreadable file, a JSON
// table, different kinds, tensors, dtypes or shapes).
#pragma once

#include <ostream>
#include <string>

namespace twin::cli {

struct DiffOptions {
  std::string a, b;
  bool json = false;   // one JSON object on stdout: a, b, kind, status, message, first_divergence, grads, tensors[]
  bool exact = false;  // bit for bit (parity/capture_diff.h)
};

int run_diff(const DiffOptions& opt, std::ostream& out, std::ostream& err);

}  // namespace twin::cli
