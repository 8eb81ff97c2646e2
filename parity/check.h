// `twin check`: the main job (ci/check runs it). Embedded dense-layer configurations (tiny for the
// simulator; realistic ones added when a GPU is present) through the reference and the optimized
// twin at several dtypes and TP/SP sizes, then every golden fixture through each twin that has its
// kind. Prints a table (layer, dtype, backend, TP, max error, bound, share, time, status), progress
// on stderr; exit 1 when any row fails, 2 on an error.
#pragma once

#include <ostream>
#include <string>
#include <vector>

namespace twin::cli {

struct CheckOptions {
  bool json = false;
};

// The fixture kinds of fixtures/megatron-core/README.md, in the order the README lists them.
const std::vector<std::string>& known_fixture_kinds();

// Exit codes as `twin fixture`: 0 pass, 1 mismatch, 2 bad input, 3 nothing supported yet.
int run_check(const CheckOptions& opt, std::ostream& out, std::ostream& err);

}  // namespace twin::cli
