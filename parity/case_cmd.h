// `twin case <id>`: rerun one dense-layer parity case from its canonical id (the string a failing
// property test prints), through the reference and the optimized twin, with a tap-by-tap diff.
#pragma once

#include <ostream>
#include <string>

namespace twin::cli {

struct CaseOptions {
  std::string id;
  std::string backend = "sim";  // sim | cuda
  bool graph = false;           // replay the optimized layer from a CUDA graph
};

// 0 pass, 1 mismatch, 2 bad id / bad input.
int run_case_command(const CaseOptions& opt, std::ostream& out, std::ostream& err);

}  // namespace twin::cli
