// `twin check`: the main job (ci/check runs it). For now it lists the fixture kinds and which twin
// supports each; the layer issues extend CheckOptions and run_check with the real checks.
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
